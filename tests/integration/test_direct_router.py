"""The latency benchmark's experiment (`benchmarks/direct_router.py`: the hot path on bare aiokafka)
does the worker's work, so its figures are comparable: on a real broker, every decision equals a
replay of its journal, routed requests are spread over several boxes and reserved, a message
the worker would refuse is dead-lettered while good traffic flows, and with its state on, the
changelog it writes loads back into the state of a replay."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from benchmarks.pipeline_latency import DIRECT_INPUT_TOPICS, WORKER_OUTPUT_TOPICS
from replay.audit import compare
from replay.run import decisions as replay_decisions
from replay.sources import kafka_decisions, kafka_journal
from streams import codec
from streams.client import ensure_topics
from streams.core_store import CoreStore
from streams.persistence import snapshot
from streams.router import Router
from streams.worker_process import Worker
from tests.integration.kafka_io import changelog_items, produce, produce_events, read_topic, wait_for
from tests.integration.test_pipeline import fleet, request

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


@pytest.mark.parametrize("state", [False, True], ids=["stateless", "state"])
def test_the_direct_router_decides_as_a_replay_of_its_journal(kafka_bootstrap, tmp_path, state):
    prefix = f"d{uuid.uuid4().hex[:8]}."
    asyncio.run(ensure_topics(kafka_bootstrap, [prefix + t for t in DIRECT_INPUT_TOPICS + WORKER_OUTPUT_TOPICS]))
    router = Worker(kafka_bootstrap, tmp_path / "direct", "unused", prefix, module="benchmarks.direct_router",
                    env={"SWITCHYARD_DIRECT_STATE": "1" if state else "0"})
    router.start()
    try:
        produce_events(kafka_bootstrap, prefix + "switchyard.providers", fleet(3))
        asyncio.run(produce(kafka_bootstrap, prefix + "switchyard.providers", [(b"box-0", b"\x01garbage")]))
        produce_events(kafka_bootstrap, prefix + "switchyard.requests",
                       [(f"r{i}", "RouteRequest", request(f"r{i}", prompt=200 + 300 * i)) for i in range(24)])
        got = wait_for(lambda: (d := kafka_decisions(kafka_bootstrap, prefix + "switchyard.decisions"))
                       and len({x["request_id"] for x in d}) >= 24 and d, what="24 decisions")
        wait_for(lambda: router.metric("switchyard_events_dead_lettered_total",
                                       f'reason="bad_magic",topic="{prefix}switchyard.providers"') == 1,
                 timeout=10, what="the bad message dead-lettered")
    finally:
        router.stop()
    routed = [d for d in got if d["outcome"] == "routed"]
    assert len({d["provider_id"] for d in routed}) > 1
    reservations = [codec.decode(r.value)[1] for r in read_topic(kafka_bootstrap, prefix + "switchyard.reservations")]
    assert sorted(r["request_id"] for r in reservations) == sorted(d["request_id"] for d in routed)
    journal = list(kafka_journal(kafka_bootstrap, prefix + "switchyard.journal"))
    report = compare(got, list(replay_decisions(journal)))
    assert report.ok, report.summary()
    assert report.compared == len(got)
    if state:
        replayed = Router()
        for e in journal:
            replayed.apply(e.journal_offset, e.journal_time_ms, e.type, e.record)
        stored = CoreStore(changelog_items(read_topic(kafka_bootstrap, prefix + "direct-core-changelog"))).load()[0]
        assert stored.offset == replayed.offset == journal[-1].journal_offset
        assert snapshot(stored) == snapshot(replayed)
