"""Offline mode: deterministic from the seed, written as write_record writes, and replayed by
`python -m replay` to the very decisions the simulation made."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path


from replay.audit import compare
from replay.run import decisions
from replay.sources import JournalStream
from streams.jsonl import dumps_record, read_journal
from streams.sim import offline, scenario

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path, name, seed=1, preset="default", duration=180.0, with_decisions=False, **kw):
    scn = scenario.resolve(preset, providers=kw.pop("providers", 30), duration_s=duration, seed=seed, environ={},
                           **kw)
    path = tmp_path / name
    res = offline.run(scn, str(path), with_decisions=with_decisions)
    return path, res


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a, ra = run(tmp_path, "a.jsonl", seed=5)
    b, _ = run(tmp_path, "b.jsonl", seed=5)
    c, _ = run(tmp_path, "c.jsonl", seed=6)
    assert ra.sent > 100 and ra.entries["Completion"] > 50 and ra.entries["Heartbeat"] > 100
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


def test_trace_runs_are_deterministic_too(tmp_path):
    a, ra = run(tmp_path, "a.jsonl", seed=2, trace="mooncake", rate=3.0, duration=120.0)
    b, _ = run(tmp_path, "b.jsonl", seed=2, trace="mooncake", rate=3.0, duration=120.0)
    assert digest(a) == digest(b) and ra.sent > 200
    affinity = [e.record["cache_affinity_key"] for e in read_journal(a) if e.type == "RouteRequest"]
    assert sum(1 for k in affinity if k) > 100


def test_lines_are_exactly_what_write_record_writes(tmp_path):
    path = tmp_path / "j.jsonl"
    scn = scenario.resolve("default", providers=20, duration_s=120.0, seed=3, environ={})
    with open(path, "w") as fp:
        offline.OfflineSim(scn, fp, with_decisions=True).run()
    lines = path.read_text().splitlines()
    entries = list(read_journal(path))
    assert len(lines) == len(entries) > 500
    types = set()
    for line, e in zip(lines, entries):
        types.add(e.type)
        extra = {} if e.type == "RouteDecision" else {"journal_offset": e.journal_offset,
                                                      "journal_time_ms": e.journal_time_ms}
        assert line == dumps_record(e.type, e.record, **extra)
    assert {"ConfigChange", "ProviderRegistered", "Heartbeat", "RouteRequest", "Completion", "Tick",
            "RouteDecision"} <= types


def test_replay_reproduces_the_decisions_of_the_run(tmp_path):
    path, res = run(tmp_path, "j.jsonl", seed=4, preset="postmortem", duration=240.0, with_decisions=True,
                    providers=40)
    f = JournalStream(str(path))
    replayed = list(decisions(f))
    assert not f.skipped
    assert len(f.recorded) == res.decisions > 500
    report = compare(f.recorded, replayed)
    assert report.ok, report.summary()
    assert report.matched == len(f.recorded)
    # and through the command line, from the file without decisions
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(x + "\n" for x in path.read_text().splitlines() if '"type": "RouteDecision"' not in x))
    out = tmp_path / "decisions.jsonl"
    subprocess.run([sys.executable, "-m", "replay", "run", "--journal", str(plain), "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    replayed = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(d["request_id"], d["outcome"], d["provider_id"]) for d in replayed] == \
           [(d["request_id"], d["outcome"], d["provider_id"]) for d in f.recorded]


def test_environment_settings_are_recorded_in_the_journal(tmp_path):
    scn = scenario.resolve("postmortem", providers=10, duration_s=30.0, seed=1,
                           environ={"EIGENINFERENCE_QUALITY_CONCURRENCY_CAP": "false"},
                           settings=["MIN_DECODE_TPS=12"])
    path = tmp_path / "j.jsonl"
    offline.run(scn, str(path))
    first = next(iter(read_journal(path)))
    assert first.type == "ConfigChange"
    assert first.record["settings"]["EIGENINFERENCE_QUALITY_CONCURRENCY_CAP"] == "false"
    assert first.record["settings"]["EIGENINFERENCE_MIN_DECODE_TPS"] == "12"
    req = next(e for e in read_journal(path) if e.type == "RouteRequest")
    assert req.record["min_decode_tps"] == 12.0


def test_cli_offline_and_presets(tmp_path):
    out, report = tmp_path / "j.jsonl", tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "streams.sim", "offline", "--preset", "hotspot", "--duration", "60",
                          "--seed", "2", "--providers", "12", "--out", str(out), "--report", str(report), "--quiet"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert "outcomes" in res.stdout and "spread" in res.stdout and "entries/s" in res.stdout
    figures = json.loads(report.read_text())
    assert figures["total_entries"] == len(out.read_text().splitlines())
    assert figures["spread"]["machines"] == 12
    listing = subprocess.run([sys.executable, "-m", "streams.sim", "presets"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    for name in ("default", "postmortem", "prefill-starved", "hotspot", "v2-migration"):
        assert name in listing
