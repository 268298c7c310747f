"""The journal read in a child process (`replay.reader_process`): the same entries in the same order
as reading in-process, the source's skipped counts, its errors, and no child left behind."""
from __future__ import annotations

import math
import multiprocessing
import os

import pytest

from replay import reader_process
from replay.reader_process import ReadInChild
from replay.sources import JournalStream, avro_entries
from streams.jsonl import JournalEntry, read_journal
from streams.sim import offline, scenario

PRESET_SECONDS = 120


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    """A simulated journal (hundreds of entries: many hand-overs) as JSON Lines."""
    path = tmp_path_factory.mktemp("reader") / "journal.jsonl"
    scn = scenario.resolve("default", providers=40, duration_s=PRESET_SECONDS, seed=3, environ={})
    offline.run(scn, str(path), with_decisions=True)
    return path


def test_the_child_yields_the_entries_the_source_yields_in_order(journal, monkeypatch):
    monkeypatch.setattr(reader_process, "BATCH", 7)  # many hand-overs, and a short last one
    want = list(read_journal(journal))
    got = list(ReadInChild(lambda: read_journal(journal)))
    assert len(want) > 500 and len(want) % 7
    assert got == want
    assert all(type(e) is JournalEntry for e in got)
    # values keep their types (an int stays an int, a float a float), so decisions are byte-identical
    assert [[type(v) for v in e.record.values()] for e in got] == [[type(v) for v in e.record.values()] for e in want]


def test_an_avro_container_reads_the_same_through_the_child(journal, tmp_path):
    from benchmarks.replay_speed import to_avro
    avro = tmp_path / "journal.avro"
    to_avro(journal, avro)
    assert list(ReadInChild(lambda: avro_entries(str(avro)))) == list(read_journal(journal))
    stream = JournalStream(str(avro))
    assert [e for e in stream] == [e for e in read_journal(journal) if e.type != "RouteDecision"]


def test_skipped_lines_are_counted_as_in_process(tmp_path, journal):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(journal.read_text().split("\n", 1)[0] + "\n{not json\n" + '{"type": "Nope"}\n')
    in_process = read_journal(bad)
    list(in_process)
    child = ReadInChild(lambda: read_journal(bad))
    assert len(list(child)) == 1
    assert child.skipped == in_process.skipped and sum(child.skipped.values()) == 2


def test_an_error_of_the_source_is_raised_with_its_type(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(ReadInChild(lambda: read_journal(tmp_path / "missing.jsonl")))

    def broken():
        yield JournalEntry(0, 1, "Tick", {"at_ms": 1})
        raise ValueError("a bad block")
    it = iter(ReadInChild(broken))
    with pytest.raises(ValueError, match="a bad block"):
        list(it)


def test_a_child_that_dies_is_an_error_not_a_short_journal():
    def dies():
        yield JournalEntry(0, 1, "Tick", {"at_ms": 1})
        os._exit(3)
    with pytest.raises(RuntimeError, match="exit code 3"):
        list(ReadInChild(dies))


def test_stopping_early_leaves_no_child(journal):
    it = iter(ReadInChild(lambda: read_journal(journal)))
    first = next(it)
    assert first.journal_offset == 0
    it.close()
    assert not multiprocessing.active_children()


def test_without_fork_the_source_is_read_in_process(journal, monkeypatch):
    monkeypatch.setattr(reader_process, "CAN_FORK", False)
    child = ReadInChild(lambda: read_journal(journal))
    assert list(child) == list(read_journal(journal))
    assert not multiprocessing.active_children()


def test_special_floats_cross_the_hand_over():
    entries = [JournalEntry(0, None, "Heartbeat", {"x": math.inf, "y": -0.0, "z": 1, "b": True, "n": None,
                                                   "raw": b"\x00\x01", "l": [1.5, {"k": "v"}]})]
    (got,) = list(ReadInChild(lambda: iter(entries)))
    assert got == entries[0]
    assert math.copysign(1, got.record["y"]) == -1 and got.record["b"] is True and type(got.record["z"]) is int
