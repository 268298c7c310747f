"""Overload: one worker with a route-wait budget (EIGENINFERENCE_ROUTE_WAIT_BUDGET_MS=500, recorded
in the journal by the worker at start) and a fleet with room to spare.

The worker runs at a quarter of one core (`cpu_share`: SIGSTOP/SIGCONT on a 100 ms period, what a
container limit of `cpus: 0.25` does), so twice its rate stays within what the load driver and the
broker carry on the same two cores: at full speed it decides ~3,000/s, and at 4,000–5,000/s the
driver itself fell behind (client acks p99 3–55 s), so the "shedding" measured was the driver's.

1. Ramp: steps of rising request rate, each drained before the next, until a step sheds (answers
   `expired` to more than 1 % of its requests) or cannot keep up. The highest clean step's decision
   rate is the rate one router decides; the first shedding step is where shedding starts.
2. Overload: twice that rate for OVERLOAD_S seconds (shorter when that would be more than
   OVERLOAD_REQUESTS requests). Requests
   that waited past their budget must be answered `expired` (503, Retry-After), and the latency of
   the others must stay bounded — p99 under a few seconds and not growing with the length of the
   overload — instead of growing without bound.
3. Every request gets exactly one distinct decision, and an audit of the journal reproduces every
   decision, the expired ones included (they are decided from recorded times).

    pytest -m slow tests/faults/test_overload.py -s
"""
from __future__ import annotations

import os
import time
import uuid
from collections import Counter

import pytest

from streams.worker_process import Worker
from tests.faults.support import (Load, agent_crashes, audit, check_decisions, cpu_share, percentile,
                                  wall_ms, write_report)
from tests.integration.kafka_io import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(1200)]

BUDGET_MS = 500
STEP_S = float(os.environ.get("SWITCHYARD_OVERLOAD_STEP_S", "6"))
OVERLOAD_S = float(os.environ.get("SWITCHYARD_OVERLOAD_S", "20"))
CPU_SHARE = float(os.environ.get("SWITCHYARD_OVERLOAD_CPU_SHARE", "0.25"))
# ... or shorter: the load driver, the broker and the worker share two cores (before the worker was
# held to a quarter core, at 6,000/s for 20 s the broker timed out fetches and 91,000 requests were
# unanswered after 5 minutes).
OVERLOAD_REQUESTS = 36_000
RAMP = (20, 40, 80, 120, 160, 200, 240, 300, 360, 420, 500, 600, 700, 800, 1000, 1250, 1500, 2000, 2500, 3000, 4000,
        5000, 6000, 8000)
# "a few seconds": the budget, plus what ingest may append ahead of the apply loop (APPEND_AHEAD_MAX)
# at a quarter core; 20 s at twice the capacity without shedding would queue ~10 s
P99_BOUND_S = 2.5


def window_stats(load: Load, ids: set, t0_ms: int, t1_ms: int) -> dict:
    """Decisions of the requests in `ids`: outcome counts, latency (decision timestamp − sent_at) of
    the non-expired ones, and the decision rate inside [t0, t1]."""
    final, lat_ok, lat_expired = {}, [], []
    for ts, _, d in list(load.decisions):
        key = (d["request_id"], d["attempt"])
        if key not in ids or key in final or d["outcome"] == "queued":
            continue
        final[key] = d
        lat = (ts - load.requests[key]["sent_at_ms"]) / 1000
        (lat_expired if d["reason"] == "expired" else lat_ok).append(lat)
    in_window = [d for ts, _, d in list(load.decisions)
                 if t0_ms <= ts <= t1_ms and (d["request_id"], d["attempt"]) in ids and d["outcome"] != "queued"]
    span = (t1_ms - t0_ms) / 1000
    outcomes = Counter(d["reason"] or d["outcome"] for d in final.values())
    # the client's own delay: sent_at_ms (stamped when the gateway made the request) to the broker's ack
    acked = [load.accepted[k] - load.requests[k]["sent_at_ms"] / 1000 for k in ids if k in load.accepted]
    return {"requests": len(ids), "answered": len(final), "outcomes": dict(outcomes),
            "expired_share": round(outcomes.get("expired", 0) / max(1, len(final)), 4),
            "decided_per_s": round(len(in_window) / span, 1),
            "not_expired_per_s": round(sum(d["reason"] != "expired" for d in in_window) / span, 1),
            "latency_s": {"p50": percentile(lat_ok, 50), "p99": percentile(lat_ok, 99),
                          "max": max(lat_ok, default=float("nan"))},
            "expired_latency_s": {"p50": percentile(lat_expired, 50), "max": max(lat_expired, default=float("nan"))},
            "client_ack_s": {"p50": percentile(acked, 50), "p99": percentile(acked, 99)}}


def _or0(x: float) -> float:
    return 0.0 if x != x else x  # NaN (no sample) counts as nothing waited


def offer(load: Load, rate: float, seconds: float, what: str, drain_timeout: float) -> tuple[set, int, int]:
    """Requests at `rate` for `seconds`, then every one answered: (their identities, t0, t1 in ms)."""
    before = set(load.requests)
    t0 = wall_ms()
    load.set_rate(rate)
    time.sleep(seconds)
    load.set_rate(0)
    t1 = wall_ms()
    missing = load.wait_answered(timeout=drain_timeout)
    assert not missing, f"{what}: {load.explain_missing(missing)}"
    return set(load.requests) - before, t0, t1


def run_step(load: Load, rate: float, seconds: float) -> tuple[dict, set]:
    ids, t0, t1 = offer(load, rate, seconds, f"the {rate}/s step", drain_timeout=180)
    stats = window_stats(load, ids, t0, t1)
    stats["rate"] = rate
    stats["offered_per_s"] = round(len(ids) / seconds, 1)
    stats["drain_s"] = round((wall_ms() - t1) / 1000, 1)
    return stats, ids


def test_overload_is_shed_as_expired_and_latency_stays_bounded(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"ovl{tag}.", f"switchyard-ovl{tag}"
    worker = Worker(kafka_bootstrap, tmp_path / "worker", app_id, prefix,
                    env={"EIGENINFERENCE_ROUTE_WAIT_BUDGET_MS": str(BUDGET_MS)})
    load = None
    try:
        worker.start()
        # 160 boxes × 6 concurrent = 960 reservations: routing, not queueing, is what is measured
        # (with 40 boxes, from 1,500/s most requests were refused `queue_full`, cheap to decide, and
        # the router no longer shed at 4,000/s); a routed request completes 50–200 ms after its decision.
        load = Load(kafka_bootstrap, prefix, rate=0, providers=160, heartbeat_s=2.0,
                    complete_after=(0.05, 0.2), prompt=(100, 1500), linger_ms=5, seed=3).start()
        wait_for(lambda: worker.metric("switchyard_providers_online") == 160, timeout=60, what="160 boxes online")
        with cpu_share(worker, CPU_SHARE):  # see the module's docstring
            steps, shedding = [], None
            for rate in RAMP:
                stats, _ = run_step(load, rate, STEP_S)
                steps.append(stats)
                print(f"  ramp {rate}/s: {stats}")
                if stats["expired_share"] > 0.01:
                    shedding = rate
                    break
            assert shedding is not None, f"no shedding up to {RAMP[-1]}/s: {steps}"
            # What one router decides: the most requests per second it answered other than `expired`.
            capacity = max(s["not_expired_per_s"] for s in steps)

            # Overload: twice the rate one router decides (the driver keeps up: asserted below).
            over_rate = 2 * capacity
            over_s = min(OVERLOAD_S, OVERLOAD_REQUESTS / over_rate)
            ids, t0, t1 = offer(load, over_rate, over_s, "the overload", drain_timeout=300)
        overall = window_stats(load, ids, t0, t1)
        # the same for the first and the second half of the overload (by send time)
        mid = (t0 + t1) // 2
        halves = [window_stats(load, {k for k in ids if load.requests[k]["sent_at_ms"] < mid}, t0, mid),
                  window_stats(load, {k for k in ids if load.requests[k]["sent_at_ms"] >= mid}, mid, t1)]
        assert worker.running() and not agent_crashes(worker), agent_crashes(worker)
        # the router saturated: ingest waited for the apply loop (inputs held in their topics)
        assert worker.metric("switchyard_ingest_held_back_seconds_total") > 0
        # expired answers must be the router's shedding, not a driver that fell behind its schedule
        assert overall["client_ack_s"]["p99"] < BUDGET_MS / 1000, f"the load driver lagged: {overall}"
        overall["offered_per_s"] = round(len(ids) / over_s, 1)
        figures = {"budget_ms": BUDGET_MS, "cpu_share": CPU_SHARE, "step_s": STEP_S, "ramp": steps,
                   "capacity_decisions_per_s": capacity,
                   "shedding_starts_at_rate": shedding,
                   "first_expired_at_rate": next((s["rate"] for s in steps if s["outcomes"].get("expired")), None),
                   "goodput_share_by_half": [round(h["not_expired_per_s"] / capacity, 3) for h in halves], "overload_rate": over_rate, "overload_s": round(over_s, 1),
                   "overload": overall, "overload_halves": halves}

        load.stop()
        check = check_decisions(set(load.requests), load.decision_list())
        assert check.ok, check.problems[:20]
        report = audit(kafka_bootstrap, prefix)
        assert report.ok, report.summary()
        figures["audit"] = {"compared": report.compared, "expired": check.outcomes.get(("rejected", "expired"), 0)}
        write_report("overload", figures)

        assert overall["outcomes"].get("expired", 0) > 0, "no request was shed at twice the capacity"
        expired = [d for d in load.decision_list() if d["reason"] == "expired"]
        assert all(d["http_status"] == 503 and d["retry_after_s"] and d["outcome"] == "rejected" for d in expired)
        assert _or0(overall["latency_s"]["p99"]) < P99_BOUND_S, overall
        # bounded, not growing with the overload's length (a half without any non-expired answer
        # has no latency to grow)
        assert _or0(halves[1]["latency_s"]["p99"]) <= _or0(halves[0]["latency_s"]["p99"]) + 2.0, halves
    finally:
        if load is not None:
            load.stop()
        worker.stop()
