"""A replay's reading and writing in child processes (`replay.child_process`): the same entries and
the same bytes as in-process, in the same order; the source's skipped counts; errors raised with
their type; no child left behind."""
from __future__ import annotations

import math
import multiprocessing
import os

from pathlib import Path

import pytest

from replay import child_process
from replay.child_process import ReadInChild, WriteInChild
from replay.sources import JournalStream, avro_entries
from streams import codec
from streams.jsonl import JournalEntry, read_journal, write_record
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
    monkeypatch.setattr(child_process, "BATCH", 7)  # many hand-overs, and a short last one
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
    monkeypatch.setattr(child_process, "CAN_FORK", False)
    child = ReadInChild(lambda: read_journal(journal))
    assert list(child) == list(read_journal(journal))
    assert not multiprocessing.active_children()


def test_special_floats_cross_the_hand_over():
    entries = [JournalEntry(0, None, "Heartbeat", {"x": math.inf, "y": -0.0, "z": 1, "b": True, "n": None,
                                                   "raw": b"\x00\x01", "l": [1.5, {"k": "v"}]})]
    (got,) = list(ReadInChild(lambda: iter(entries)))
    assert got == entries[0]
    assert math.copysign(1, got.record["y"]) == -1 and got.record["b"] is True and type(got.record["z"]) is int


def _decisions(journal):
    return [e.record for e in read_journal(journal) if e.type == "RouteDecision"]


@pytest.mark.parametrize("fork", [True, False])
def test_the_writer_writes_the_bytes_write_record_writes(journal, tmp_path, monkeypatch, fork):
    monkeypatch.setattr(child_process, "BATCH", 7)
    monkeypatch.setattr(child_process, "CAN_FORK", fork)
    records = _decisions(journal)
    assert len(records) > 100
    want = tmp_path / "want.jsonl"
    with open(want, "w") as fp:
        for r in records:
            write_record(fp, "RouteDecision", r)
    got = tmp_path / "got.jsonl"
    with WriteInChild(str(got)) as out:
        for r in records:
            out.write("RouteDecision", r)
    assert got.read_bytes() == want.read_bytes()
    assert not multiprocessing.active_children()


def test_the_writer_to_stdout_writes_once(journal, tmp_path):
    """Through a real stdout (a file descriptor): pending output is not duplicated by the fork."""
    import subprocess
    import sys
    code = ("import sys; from replay.child_process import WriteInChild; print('before', end='\\n'); "
            "w = WriteInChild(None)\n"
            "with w as out:\n    out.write('Tick', {'at_ms': 1})\n    out.write('Tick', {'at_ms': 2})\n"
            "print('after')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.stdout.splitlines() == ["before", '{"type": "Tick", "at_ms": 1}', '{"type": "Tick", "at_ms": 2}', "after"]


def test_a_record_the_schema_refuses_is_raised_with_its_type(journal, tmp_path, monkeypatch):
    monkeypatch.setattr(child_process, "BATCH", 2)
    records = _decisions(journal)[:50]
    records[3] = dict(records[3], http_status="two hundred")
    with pytest.raises(codec.CodecError):
        with WriteInChild(str(tmp_path / "out.jsonl")) as out:
            for r in records:
                out.write("RouteDecision", r)
    assert not multiprocessing.active_children()


def test_an_error_in_the_parent_stops_the_writer(tmp_path):
    with pytest.raises(KeyError):
        with WriteInChild(str(tmp_path / "out.jsonl")) as out:
            out.write("Tick", {"at_ms": 1})
            raise KeyError("core bug")
    assert not multiprocessing.active_children()
