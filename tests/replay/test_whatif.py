"""what-if on journals with a known pathology: the satisficing band spreads a hot-spotted fleet, and
the prefill fallback in enforce mode cuts ttft_too_slow on a long-prompt workload."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from replay.report import compare_runs, gini, top_share
from replay.whatif import what_if
from streams.jsonl import read_journal, write_record
from streams.router import Router
from tests.core.helpers import GPT_OSS, completion, config_change, heartbeat, registered, request, slot

ROOT = Path(__file__).resolve().parents[2]


def record_journal(path: Path, fleet: list[dict], requests: list[tuple[int, dict]], settings: dict,
                   serve_ms: int) -> Path:
    """A journal as a live run would record it: the fleet, requests, heartbeats every 5 s, and a
    completion `serve_ms` after each reservation (decided by a Router as the live worker would)."""
    router, lines = Router(), []

    def emit(line: dict, t: int):
        line = dict(line)
        kind = line.pop("type")
        outputs = router.apply(len(lines), t, kind, dict(line))
        lines.append((kind, line, t))
        return outputs

    emit(config_change(settings, at_ms=0), 0)
    for reg in fleet:
        emit(reg, 0)
    seqs = {reg["provider_id"]: 0 for reg in fleet}
    due: list[tuple[int, str, str]] = []
    next_beat = 0
    for t, req in requests:
        while due and due[0][0] <= t:
            at, rid, pid = due.pop(0)
            emit(completion(rid, pid, ttft_ms=400.0, at_ms=at), at)
        if t >= next_beat:
            for pid in seqs:
                seqs[pid] += 1
                emit(heartbeat(pid, seqs[pid], [slot(GPT_OSS)], at_ms=t), t)
            next_beat = t + 5_000
        for kind, rec in emit(req, t):
            if kind == "Reservation":
                due.append((t + serve_ms, rec["request_id"], rec["provider_id"]))
                due.sort()
    with path.open("w") as fp:
        for offset, (kind, line, t) in enumerate(lines):
            write_record(fp, kind, line, journal_offset=offset, journal_time_ms=t)
    return path


def hotspot(tmp_path) -> Path:
    fleet = [registered(f"fast-{i}", 90.0) for i in range(2)] + [registered(f"slow-{i:02d}", 30.0) for i in range(18)]
    # Light load (about 1.5 requests in flight): cheapest-cost sends nearly everything to the two
    # fast boxes while 18 adequate ones idle — the production hot spot.
    reqs = [(1_000 + 1_000 * i, request(f"r{i}", prompt=500, max_tokens=200, at_ms=1_000 + 1_000 * i))
            for i in range(300)]
    return record_journal(tmp_path / "hotspot.jsonl", fleet, reqs, {"EIGENINFERENCE_MIN_DECODE_TPS": "15"},
                          serve_ms=1_500)


def test_the_band_spreads_traffic_on_a_hot_spotted_fleet(tmp_path):
    entries = list(read_journal(hotspot(tmp_path)))
    result = what_if(entries, {"EIGENINFERENCE_SATISFICING_BAND": "true"})
    rec, wi = compare_runs(result.recorded.decisions, result.whatif.decisions, result.providers)[GPT_OSS].values()
    assert rec["top10_share"] > 0.5                  # two fast boxes took most of the traffic
    assert wi["top10_share"] < rec["top10_share"] - 0.2
    assert wi["idle_share"] < rec["idle_share"]
    assert wi["outcomes"].get("routed") == rec["outcomes"].get("routed") == 300


def test_enforce_mode_cuts_ttft_too_slow_on_long_prompts(tmp_path):
    fleet = [registered(f"box-{i}", 20.0 + 5 * i) for i in range(6)]  # static prefill 240..540 tok/s
    reqs = [(1_000 + 2_000 * i, request(f"r{i}", prompt=6_000 + 1_000 * (i % 8), max_tokens=256,
                                         at_ms=1_000 + 2_000 * i)) for i in range(60)]
    journal = record_journal(tmp_path / "long.jsonl", fleet, reqs, {"EIGENINFERENCE_TTFT_HARD_REJECT": "true"},
                             serve_ms=3_000)
    result = what_if(list(read_journal(journal)), {"EIGENINFERENCE_PREFILL_FALLBACK_MODE": "enforce"})
    rec, wi = compare_runs(result.recorded.decisions, result.whatif.decisions, result.providers)[GPT_OSS].values()
    assert rec["outcomes"].get("ttft_too_slow", 0) >= 30
    assert wi["outcomes"].get("ttft_too_slow", 0) < rec["outcomes"]["ttft_too_slow"] / 2
    assert wi["prefill_sources"].get("anchor", 0) > 0 and "anchor" not in rec["prefill_sources"]


def test_the_cli_writes_a_markdown_report_with_plots(tmp_path):
    journal = hotspot(tmp_path)
    report = tmp_path / "out" / "whatif.md"
    res = subprocess.run([sys.executable, "-m", "replay", "what-if", "--journal", str(journal), "--set",
                          "SATISFICING_BAND=true", "--report", str(report), "--quiet"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert "top-10% share" in res.stdout
    text = report.read_text()
    assert "| top-10% providers' share of routed |" in text and "method:" in text
    assert list(report.parent.glob("whatif-*.png"))


def test_spread_metrics():
    assert gini([1, 1, 1, 1]) == 0.0
    assert abs(gini([0, 0, 0, 10]) - 0.75) < 1e-9
    assert top_share([10] + [0] * 9) == 1.0 and top_share([1] * 10) == 0.1
