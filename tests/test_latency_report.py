"""The latency benchmark's report over several rounds (benchmarks/pipeline_latency.py): medians of
each round's own ratios, and the rounds that met each goal."""
from benchmarks.pipeline_latency import median, report, summarise_rounds


def phase(round_no: int, system: str, p50: float, p99: float, cpu: float = 1.0) -> dict:
    return {"round": round_no, "rate": 200.0, "system": system, "p50_ms": p50, "p90_ms": p50, "p99_ms": p99,
            "max_ms": p99, "achieved_rate": 200.0, "replies": 3000, "lost": 0,
            "cpu": {"system_cpu_ms_per_request": cpu}}


def test_median_skips_missing_values():
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert median([None]) is None


def test_rounds_are_summarised_by_the_median_of_their_own_ratios():
    # The echo is slow in round 1 and the worker in round 3: per-round ratios 1.5, 1.8, 3.5.
    results = [phase(1, "echo", 4.0, 10.0), phase(1, "switchyard", 6.0, 20.0, cpu=3.0),
               phase(2, "echo", 3.0, 10.0), phase(2, "switchyard", 5.4, 30.0, cpu=2.0),
               phase(3, "echo", 2.0, 10.0), phase(3, "switchyard", 7.0, 24.0, cpu=4.0)]
    ratios = []
    for n in (1, 2, 3):
        _, per_round = report([r for r in results if r["round"] == n], [200.0])
        ratios += [dict(q, round=n) for q in per_round]
    assert [q["p50_vs_echo"] for q in ratios] == [1.5, 1.8, 3.5]

    text, (summary,) = summarise_rounds(results, ratios, [200.0])

    assert summary["rounds"] == 3
    assert summary["p50_vs_echo"] == 1.8      # not 6.0 / 3.0 = 2.0 from the medians of the p50s
    assert summary["p99_vs_echo"] == 2.4
    assert summary["p50_vs_pipeline"] is None  # not measured
    assert summary["goals_met_in_rounds"] == {"p50 <= 3.0x echo": 2, "p99 < 25.0 ms": 2, "no lost replies": 3}
    assert "switchyard      p50    6.00 ms  p99   24.00 ms  CPU 3.000 ms/request" in text
    assert "p50 <= 3.0x echo: 2/3" in text
