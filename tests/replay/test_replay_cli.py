"""`python -m replay` on files: run reproduces the spec's example journals, audit finds an altered
decision, explain names the reasons."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT.parent / "shared" / "spec" / "examples"
if not EXAMPLES.exists():
    EXAMPLES = Path("/work/shared/spec/examples")


def replay(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, check=check)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("name", ["dedicated-cap-sheds", "queue-timeout"])
def test_run_reproduces_the_example_decisions(name, tmp_path):
    out = tmp_path / "decisions.jsonl"
    replay("run", "--journal", EXAMPLES / f"{name}.jsonl", "--out", out)
    got, want = lines(out), lines(EXAMPLES / f"{name}.expected.jsonl")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["type"] == "RouteDecision"
        for key, value in w.items():
            if key in ("estimated_ttft_ms", "cost_ms"):
                assert g[key] == pytest.approx(value, abs=0.01), key
            else:
                assert g[key] == value, key


def test_run_skips_unknown_lines_without_crashing(tmp_path):
    journal = tmp_path / "j.jsonl"
    journal.write_text((EXAMPLES / "queue-timeout.jsonl").read_text()
                       + '{"type": "Mystery", "x": 1}\nnot json\n')
    res = replay("run", "--journal", journal, "--out", tmp_path / "d.jsonl")
    assert "unknown_type" in res.stderr and "bad_json" in res.stderr
    assert len(lines(tmp_path / "d.jsonl")) == 4


def _journal_with_decisions(tmp_path, name) -> Path:
    out = tmp_path / "decisions.jsonl"
    replay("run", "--journal", EXAMPLES / f"{name}.jsonl", "--out", out)
    combined = tmp_path / f"{name}-audit.jsonl"
    combined.write_text((EXAMPLES / f"{name}.jsonl").read_text() + out.read_text())
    return combined


def test_audit_of_an_untouched_journal_shows_no_difference(tmp_path):
    res = replay("audit", "--journal", _journal_with_decisions(tmp_path, "dedicated-cap-sheds"))
    assert "AUDIT OK" in res.stdout and "identical: 4" in res.stdout


def test_audit_finds_a_deliberately_altered_decision(tmp_path):
    journal = _journal_with_decisions(tmp_path, "dedicated-cap-sheds")
    rows = journal.read_text().splitlines()
    r4 = next(i for i, row in enumerate(rows) if '"RouteDecision"' in row and '"r4"' in row)
    rows[r4] = rows[r4].replace('"provider_id": "box-b"', '"provider_id": "box-a"')
    journal.write_text("\n".join(rows) + "\n")
    res = replay("audit", "--journal", journal, check=False)
    assert res.returncode == 1
    assert "r4#0" in res.stdout and "provider_id: recorded 'box-a', replayed 'box-b'" in res.stdout


def test_explain_names_the_capacity_rejection_and_the_winner():
    res = replay("explain", "r3", "--journal", EXAMPLES / "dedicated-cap-sheds.jsonl")
    assert "box-a: at its concurrency cap" in res.stdout and "load 2 of cap 2" in res.stdout
    assert "REJECTED machine_busy" in res.stdout and "Retry-After 2 s" in res.stdout
    res = replay("explain", "r4", "--journal", EXAMPLES / "dedicated-cap-sheds.jsonl", "--json")
    report = json.loads(res.stdout)
    assert report["decision"]["provider_id"] == "box-b"
    verdicts = {row["provider_id"]: row["verdict"] for row in report["candidates"]}
    assert verdicts == {"box-a": "no_headroom", "box-b": "candidate"}
    assert replay("explain", "nope", "--journal", EXAMPLES / "queue-timeout.jsonl", check=False).returncode == 2


def _container(jsonl: Path, out: Path) -> Path:
    """The journal as the Avro object container `export --avro` writes."""
    from fastavro import writer

    from replay.sources import container_schema
    from streams.jsonl import read_journal
    with out.open("wb") as fp:
        writer(fp, container_schema(), ({"journal_offset": e.journal_offset, "journal_time_ms": e.journal_time_ms,
                                         "event": (f"switchyard.{e.type}", e.record)} for e in read_journal(jsonl)))
    return out


@pytest.mark.parametrize("name", ["dedicated-cap-sheds", "queue-timeout"])
def test_run_and_explain_read_an_avro_container_as_the_json_lines_file(name, tmp_path):
    avro = _container(EXAMPLES / f"{name}.jsonl", tmp_path / "j.avro")
    replay("run", "--journal", EXAMPLES / f"{name}.jsonl", "--out", tmp_path / "from-jsonl.jsonl")
    res = replay("run", "--journal", avro, "--out", tmp_path / "from-avro.jsonl")
    assert (tmp_path / "from-avro.jsonl").read_text() == (tmp_path / "from-jsonl.jsonl").read_text()
    assert len(lines(tmp_path / "from-avro.jsonl")) == len(lines(EXAMPLES / f"{name}.expected.jsonl"))
    assert "decisions from" in res.stderr
    first = lines(tmp_path / "from-jsonl.jsonl")[0]["request_id"]
    assert replay("explain", first, "--journal", avro, "--json").stdout == \
        replay("explain", first, "--journal", EXAMPLES / f"{name}.jsonl", "--json").stdout


def test_a_journal_file_is_read_as_it_is_replayed(tmp_path):
    """A day's journal (≈ 12 M entries) does not fit in memory as dicts: entries stream."""
    from replay.sources import JournalStream
    for path in (EXAMPLES / "dedicated-cap-sheds.jsonl",
                 _container(EXAMPLES / "dedicated-cap-sheds.jsonl", tmp_path / "j.avro")):
        stream = JournalStream(str(path))
        entries = iter(stream)
        next(entries)
        assert stream.count == 1
        total = 1 + sum(1 for _ in entries)
        assert stream.count == total > 1


def test_audit_refuses_what_it_cannot_compare_instead_of_passing_or_failing_it(tmp_path):
    bare = tmp_path / "no-decisions.jsonl"  # as `export` writes without --decisions-topic
    bare.write_text((EXAMPLES / "dedicated-cap-sheds.jsonl").read_text())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for args, says in ([bare], "no RouteDecision lines"), ([empty], "no entries"), \
            ([bare, "--decisions-topic", "switchyard.decisions"], "--decisions-topic needs --bootstrap"):
        res = replay("audit", "--journal", *args, check=False)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_audit_of_a_journal_cut_short_compares_the_decisions_of_the_entries_it_has(tmp_path):
    journal = _journal_with_decisions(tmp_path, "dedicated-cap-sheds")
    rows = journal.read_text().splitlines()
    inputs = [r for r in rows if '"RouteDecision"' not in r]
    recorded = [r for r in rows if '"RouteDecision"' in r]
    cut = tmp_path / "cut.jsonl"  # the last input (a request) gone; all its decisions still there
    cut.write_text("\n".join(inputs[:-1] + recorded) + "\n")
    res = replay("audit", "--journal", cut)
    assert "AUDIT OK" in res.stdout and "identical: 3" in res.stdout
    assert "1 recorded decisions of entries after the journal's last replayed offset" in res.stderr


def test_replay_commands_say_what_is_wrong_without_a_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for args, says in (["run", "--journal", tmp_path / "missing.jsonl"], "No such file"),  \
            (["run", "--journal", empty], "no entries"), \
            (["what-if", "--journal", tmp_path / "missing.jsonl", "--set", "NO_SUCH=1"], "--set refused"), \
            (["what-if", "--journal", EXAMPLES / "queue-timeout.jsonl", "--set", "QUEUE_MAX_DEPTH=abc"],
             "--set refused"):
        res = replay(*args, check=False)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
