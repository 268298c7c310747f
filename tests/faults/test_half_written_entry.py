"""The crash the kill -9 test hits by chance, made deterministic: the active router dies after the
delta of journal entry o reached the table's changelog but before anything else did — the keys
are only written at the next checkpoint (streams/core_store.py, docs/exactly-once.md).

The next router loads the table and re-applies the delta, so entry o is complete in memory; the
delta stays in the table until a checkpoint has written its keys, so entry o is still complete for
every later takeover. Here entry o is a RouteRequest, so the key that matters is its request-dedup
key: a worker that loads the table later must still refuse a duplicate of that request — otherwise
the request is decided twice and a second reservation is made.

    pytest -m slow tests/faults/test_half_written_entry.py
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from replay.run import replay
from replay.sources import kafka_decisions
from streams import codec
from streams.core_store import DELTA
from streams.persistence import export
from streams.persistence import key as pkey
from streams.router import Router
from streams.worker_process import Worker
from tests.faults.support import Load, check_decisions, journal, live_router, reservations, wall_ms
from replay.audit import by_identity
from tests.integration.kafka_io import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]


async def _send(bootstrap: str, topic: str, key: bytes, value: bytes, timestamp_ms: int | None = None):
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        return await producer.send_and_wait(topic, key=key, value=value, partition=0, timestamp_ms=timestamp_ms)
    finally:
        await producer.stop()


def test_a_half_written_entry_is_completed_in_the_table(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"half{tag}.", f"switchyard-half{tag}"
    bootstrap = kafka_bootstrap
    first = Worker(bootstrap, tmp_path / "first", app_id, prefix)
    first.start()
    load = Load(bootstrap, prefix, rate=5, providers=4, complete_after=None, seed=5).start()
    try:
        wait_for(lambda: len(load.decisions) >= 10, timeout=60, what="first decisions")
        load.set_rate(0)
        assert not load.wait_answered(60)
    finally:
        load.stop()
    first.stop()  # graceful: everything it applied is in the changelog, its offsets committed
    applied = live_router(bootstrap, app_id).offset
    # (a tick the leader appended just before stopping may be unapplied: harmless here, a tick
    # only changes `meta`, which the delta below rewrites whole)
    assert all(e.type == "Tick" for e in journal(bootstrap, prefix) if e.journal_offset > applied)

    # Entry o: a request appended to the journal as ingest would, then ONLY its delta written to
    # the changelog — the worker "died" before the keys after it.
    rid = f"half-{tag}"
    request = {"request_id": rid, "attempt": 0, "model": "gpt-oss-20b", "prompt_tokens": 500,
               "max_tokens": 128, "sent_at_ms": wall_ms()}
    meta = asyncio.run(_send(bootstrap, prefix + "switchyard.journal", b"default",
                             codec.encode("RouteRequest", request), timestamp_ms=wall_ms()))
    entries = journal(bootstrap, prefix)
    assert entries[-1].journal_offset == meta.offset
    router = Router()
    for _ in replay(entries[:-1], router=router):
        pass
    router.take_dirty()
    entry = entries[-1]
    outputs = router.apply(entry.journal_offset, entry.journal_time_ms, entry.type, entry.record)
    decision = next(r for k, r in outputs if k == "RouteDecision")
    assert decision["outcome"] == "routed", decision
    changes = export(router, router.take_dirty())
    changes[pkey("reply", rid, 0)] = None          # what ReplyTopics records for a final decision
    assert any(k.startswith(pkey("rqb", "")) and [rid, 0] in [e[:2] for e in v or ()] for k, v in changes.items())
    messages = [(prefix + "switchyard.decisions", rid.encode(), codec.encode("RouteDecision", decision))]
    messages += [(prefix + "switchyard.reservations", r["provider_id"].encode(), codec.encode("Reservation", r))
                 for k, r in outputs if k == "Reservation"]
    o = entry.journal_offset
    delta = {"o": o, "f": o, "changes": changes, "flushed": -1,
             "outputs": [(o, [(t, base64.b64encode(k).decode(), base64.b64encode(v).decode()) for t, k, v in messages])]}
    asyncio.run(_send(bootstrap, f"{app_id}-core-changelog", json.dumps(f"{DELTA}{o}-{o}").encode(),
                      json.dumps(delta).encode()))

    # The takeover: a worker with an empty data dir recovers the table from the changelog, loads
    # (re-applying the delta), re-sends the entry's outputs, and applies newer entries (ticks).
    second = Worker(bootstrap, tmp_path / "second", app_id, prefix)
    second.start()
    try:
        wait_for(lambda: any(d["request_id"] == rid for d in kafka_decisions(bootstrap, prefix + "switchyard.decisions")),
                 timeout=60, what="the half-written entry's decision re-sent from the delta")
        time.sleep(4)  # a few ticks: newer deltas follow entry o's
    finally:
        second.stop()

    # The table as the changelog now holds it must contain every key entry o changed.
    table = live_router(bootstrap, app_id)
    assert (rid, 0) in table.seen_requests, "the request's dedup key never reached the table"
    assert table.reservations.get((rid, 0)) == decision["provider_id"], "its reservation is missing from the table"

    # And what that means: a later worker, loading that table, refuses a duplicate of the request.
    third = Worker(bootstrap, tmp_path / "third", app_id, prefix)
    third.start()
    try:
        asyncio.run(_send(bootstrap, prefix + "switchyard.requests", rid.encode(), codec.encode("RouteRequest", request)))
        wait_for(lambda: third.metric("switchyard_journal_entries_applied_total", 'type="RouteRequest"') >= 1,
                 timeout=60, what="the duplicate applied")
        time.sleep(2)
    finally:
        third.stop()
    recorded = kafka_decisions(bootstrap, prefix + "switchyard.decisions")
    by, _ = by_identity(recorded)
    assert len(by[(rid, 0)]) == 1, f"the request was decided twice: {by[(rid, 0)]}"
    held = [r for r in reservations(bootstrap, prefix) if r["request_id"] == rid]
    assert len({json.dumps(r, sort_keys=True) for r in held}) == 1, f"reservations: {held}"
    assert check_decisions(set(load.requests) | {(rid, 0)}, recorded).ok
