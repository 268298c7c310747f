"""Broker restart under load: the test's own LocalKafka (other tests never see it go away), two
workers, a fleet heartbeating and requests flowing; the broker is stopped and started again mid-
stream (once gracefully with a pause while it is down, once with kill -9). Workers and clients are
never restarted: they must reconnect by themselves. The load client retries a request until the
broker acknowledges it, as a gateway would; every request is eventually accepted and gets exactly
one distinct decision, reservations match, the journal audit reproduces every decision, and the
workers' core state equals a replay of the journal.

    pytest -m slow tests/faults/test_broker_restart.py -s
"""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from streams.broker import LocalKafka
from streams.worker_process import Worker
from tests.faults.support import (Load, agent_crashes, audit, check_decisions, check_reservations, journal, live_router,
                                  replayed_router, reservations, same_state, trace_missing, wall_ms, write_report)
from tests.integration.kafka_io import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(900)]

DOWN_S = 8.0     # how long the broker stays away in the graceful outage
RATE = 10.0


@pytest.fixture
def own_kafka(tmp_path):
    """A broker of this test only, with a kept data dir: stop() + start() is a restart on the same
    port with the same data."""
    kafka = LocalKafka(data_dir=tmp_path / "kafka")
    kafka.start()
    yield kafka
    kafka.stop()


def _kill_9(kafka: LocalKafka) -> None:
    os.killpg(kafka.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while kafka.running() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_workers_and_clients_ride_out_broker_restarts(own_kafka, tmp_path):
    kafka = own_kafka
    bootstrap = kafka.bootstrap
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"brk{tag}.", f"switchyard-brk{tag}"
    workers = [Worker(bootstrap, tmp_path / f"w{i}", app_id, prefix) for i in range(2)]
    load = None
    outages = []
    try:
        for w in workers:
            w.start()
        load = Load(bootstrap, prefix, rate=RATE, providers=10, complete_after=(0.3, 2.5), seed=7).start()
        wait_for(lambda: len(load.decisions) >= 50, timeout=60, what="first decisions")

        for how in ("stop, wait, start", "kill -9, start"):
            time.sleep(5)
            down_ms = wall_ms()
            last_before = load.decision_times()[-1]
            if how.startswith("stop"):
                kafka.stop()                # graceful: SIGTERM, the data dir is kept
                time.sleep(DOWN_S)
            else:
                _kill_9(kafka)
            kafka.start()                   # same port, same data
            up_ms = wall_ms()
            wait_for(lambda: load.decision_times()[-1] > up_ms, timeout=120, interval=0.1,
                     what=f"a decision after the broker came back ({how})")
            first_after = min(t for t in load.decision_times() if t > up_ms)
            outages.append({"how": how, "down_s": round((up_ms - down_ms) / 1000, 2),
                            "broker_start_s": round(kafka.start_seconds, 2),
                            "first_decision_after_up_s": (first_after - up_ms) / 1000,
                            "decision_pause_s": (first_after - last_before) / 1000,
                            "down_ms": down_ms, "up_ms": up_ms})
            assert all(w.running() for w in workers), "a worker died with the broker"
            time.sleep(10)                  # the load runs on after the outage
            assert all(w.running() for w in workers), "a worker died after the broker came back"

        load.set_rate(0)
        missing = load.wait_answered(timeout=180)
        assert not missing, (f"{len(missing)} accepted requests without a final decision: {sorted(missing)[:10]}; "
                                + trace_missing(bootstrap, prefix, app_id, set(sorted(missing)[:10])))
        assert len(load.accepted) == len(load.requests)
        wait_for(lambda: set(load.completions) >= set(load.first_routed), timeout=60, what="completions sent")
        time.sleep(3)
        load.stop()
        for w in workers:
            w.stop()

        crashed = [line for w in workers for line in agent_crashes(w)]
        assert not crashed, f"agents crashed: {crashed[:5]}"
        entries = journal(bootstrap, prefix)
        from replay.sources import kafka_decisions
        recorded = kafka_decisions(bootstrap, prefix + "switchyard.decisions")
        check = check_decisions(set(load.requests), recorded)
        assert check.ok, check.problems[:20]
        res = check_reservations(reservations(bootstrap, prefix), recorded)
        assert res["ok"], res
        report = audit(bootstrap, prefix, entries)
        assert report.ok, report.summary()
        live = live_router(bootstrap, app_id)
        differing = same_state(live, replayed_router(entries, upto=live.offset))
        assert not differing, f"live core state differs from the replay at {differing[:20]}"
        for o in outages:  # requests the gateway created while the broker was away: all accepted later
            during = [k for k, r in load.requests.items() if o["down_ms"] <= r["sent_at_ms"] < o["up_ms"]]
            o["requests_created_while_down"] = len(during)
            o["accepted_after_retry"] = sum(k in load.accepted for k in during)
            assert o["accepted_after_retry"] == len(during)
        write_report("broker_restart", {
            "outages": outages, "requests": len(load.requests), "send_errors": dict(load.send_errors),
            "heartbeat_errors": load.heartbeat_errors, "decisions": check.decisions,
            "identical_resent_copies": check.duplicates,
            "outcomes": {str(k): v for k, v in check.outcomes.items()},
            "reservations": {k: res[k] for k in ("distinct", "copies", "routed")},
            "audit": {"compared": report.compared, "duplicates": report.duplicates}})
    finally:
        if load is not None:
            load.stop()
        for w in workers:
            w.stop()
