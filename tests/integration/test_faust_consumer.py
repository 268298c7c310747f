"""The worker's consumer rewinds never-committed stream partitions on `seek_to_committed` (Faust's
way to re-fetch records a rebalance made it drop), and leaves the partitions it is told to skip."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition

from streams.faust_consumer import SwitchyardConsumer, install
from tests.integration.kafka_io import produce

pytestmark = pytest.mark.kafka


async def _positions_after_reading_and_seeking_to_committed(bootstrap: str) -> dict[str, int]:
    stream, changelog = f"t{uuid.uuid4().hex[:8]}.stream", f"t{uuid.uuid4().hex[:8]}-changelog"
    for topic in (stream, changelog):
        await produce(bootstrap, topic, [(b"k", b"v%d" % i) for i in range(5)])
    install(rewind=lambda tp: tp.topic == stream)
    consumer = SwitchyardConsumer(bootstrap_servers=bootstrap, group_id=f"g{uuid.uuid4().hex[:8]}",
                                  enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(stream, 0), TopicPartition(changelog, 0)]
        consumer.assign(tps)
        seen = 0
        while seen < 10:
            seen += sum(len(r) for r in (await consumer.getmany(timeout_ms=1000)).values())
        await consumer.seek_to_committed()  # nothing was ever committed
        return {tp.topic: await consumer.position(tp) for tp in tps} | {"stream": stream, "changelog": changelog}
    finally:
        await consumer.stop()


def test_never_committed_stream_partitions_are_rewound_and_changelogs_are_not(kafka_bootstrap):
    got = asyncio.run(_positions_after_reading_and_seeking_to_committed(kafka_bootstrap))
    assert got[got["stream"]] == 0  # aiokafka alone leaves it at 5: the fetched records were lost
    assert got[got["changelog"]] == 5
