"""A frozen router (SIGSTOP past the session timeout — a VM pause, a swap storm) under load: the
standby takes over; the frozen worker is thawed (SIGCONT) and rejoins as a zombie that may still
hold fetched entries and buffered writes; later the new active is killed (kill -9), so the former
zombie becomes the router again with the in-memory state it had before it froze.

Afterwards the same checks as the crash test: one distinct decision per identity (plus the queue
follow-up), reservations equal routed decisions, the journal audit reproduces every decision, and
the core state in the table changelog equals a replay of the journal.

    pytest -m slow tests/faults/test_worker_pause.py -s
"""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from streams.worker_process import Worker
from tests.faults.support import (Load, active_worker, agent_crashes, audit, check_decisions, check_reservations,
                                  journal, live_router, replayed_router, reservations, restart, same_state, trace_missing,
                                  wall_ms, write_report)
from tests.integration.kafka_io import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(900)]

PAUSE_S = 15.0   # > the 10 s broker session timeout
ROUNDS = int(os.environ.get("SWITCHYARD_FAULT_PAUSES", "2"))


def test_a_frozen_router_comes_back_as_a_zombie_without_harm(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"pause{tag}.", f"switchyard-pause{tag}"
    workers = [Worker(kafka_bootstrap, tmp_path / f"w{i}", app_id, prefix) for i in range(2)]
    load = None
    rounds = []
    try:
        for w in workers:
            w.start()
        load = Load(kafka_bootstrap, prefix, rate=10, providers=10, complete_after=(0.3, 2.5), seed=11).start()
        wait_for(lambda: len(load.decisions) >= 30, timeout=60, what="first decisions")
        for n in range(ROUNDS):
            frozen = active_worker(workers)
            other = workers[1 - workers.index(frozen)]
            stop_ms = wall_ms()
            os.killpg(frozen.proc.pid, signal.SIGSTOP)
            wait_for(lambda: load.decision_times()[-1] > stop_ms + 1000, timeout=90, interval=0.1,
                     what="the standby deciding while the active is frozen")
            takeover_s = (min(t for t in load.decision_times() if t > stop_ms) - stop_ms) / 1000
            time.sleep(max(0.0, PAUSE_S - (wall_ms() - stop_ms) / 1000))
            os.killpg(frozen.proc.pid, signal.SIGCONT)     # the zombie wakes up
            time.sleep(8)
            # now the other one dies: the former zombie must route again
            kill_ms = wall_ms()
            other.stop(sig=signal.SIGKILL)
            wait_for(lambda: load.decision_times()[-1] > kill_ms, timeout=90, interval=0.1,
                     what="decisions after the kill")
            rounds.append({"takeover_after_freeze_s": takeover_s,
                           "takeover_after_kill_s": (min(t for t in load.decision_times() if t > kill_ms)
                                                     - kill_ms) / 1000})
            restart(other)
            time.sleep(5)
        load.set_rate(0)
        missing = load.wait_answered(timeout=120)
        assert not missing, (f"{len(missing)} requests without a final decision: {sorted(missing)[:10]}; "
                                + trace_missing(kafka_bootstrap, prefix, app_id, set(sorted(missing)[:10])))
        wait_for(lambda: set(load.completions) >= set(load.first_routed), timeout=60, what="completions sent")
        time.sleep(3)
        load.stop()
        for w in workers:
            w.stop()

        crashed = [line for w in workers for line in agent_crashes(w)]
        assert not crashed, f"agents crashed: {crashed[:5]}"
        entries = journal(kafka_bootstrap, prefix)
        from replay.sources import kafka_decisions
        recorded = kafka_decisions(kafka_bootstrap, prefix + "switchyard.decisions")
        check = check_decisions(set(load.requests), recorded)
        assert check.ok, check.problems[:20]
        res = check_reservations(reservations(kafka_bootstrap, prefix), recorded)
        assert res["ok"], res
        report = audit(kafka_bootstrap, prefix, entries)
        assert report.ok, report.summary()
        live = live_router(kafka_bootstrap, app_id)
        differing = same_state(live, replayed_router(entries, upto=live.offset))
        assert not differing, f"live core state differs from the replay at {differing[:20]}"
        write_report("worker_pause", {"rounds": rounds, "requests": len(load.requests),
                                      "identical_resent_copies": check.duplicates,
                                      "audit": {"compared": report.compared}})
    finally:
        if load is not None:
            load.stop()
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            w.stop()
