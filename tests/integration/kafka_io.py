"""Small aiokafka helpers for integration tests: produce Avro events, read a topic to the end."""
from __future__ import annotations

import asyncio
import json
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams import codec
from streams.core_store import CoreStore


async def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in messages:
            await producer.send_and_wait(topic, key=key, value=value)
    finally:
        await producer.stop()


def produce_events(bootstrap: str, topic: str, events: list[tuple[str, str, dict]]) -> None:
    """events: (key, record name, record)."""
    asyncio.run(produce(bootstrap, topic, [(k.encode(), codec.encode(n, r)) for k, n, r in events]))


async def _read_all(bootstrap: str, topic: str, timeout_ms: int) -> list:
    """Everything in the topic up to its end offsets at the time of the call."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if partitions is None:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return []
        consumer.assign(tps)
        for tp, low in (await consumer.beginning_offsets(tps)).items():
            consumer.seek(tp, low)  # explicit: seek_to_beginning can race the assignment
        end = await consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + timeout_ms / 1000
        async def behind() -> bool:
            for tp in tps:
                if await consumer.position(tp) < end[tp]:
                    return True
            return False

        while await behind() and time.monotonic() < deadline:
            batch = await consumer.getmany(*tps, timeout_ms=200)
            for tp, records in batch.items():
                out.extend(r for r in records if r.offset < end[tp])
        return out
    finally:
        await consumer.stop()


def read_topic(bootstrap: str, topic: str, timeout_ms: int = 10_000) -> list:
    return asyncio.run(_read_all(bootstrap, topic, timeout_ms))


def journal_types(bootstrap: str, topic: str, skip=("Tick", "ConfigChange")) -> list[str]:
    names = [codec.decode(r.value)[0] for r in read_topic(bootstrap, topic)]
    return [n for n in names if n not in skip]


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


def changelog_items(records) -> dict:
    """A table's changelog records as the table they leave: the last JSON value per key."""
    items = {}
    for rec in records:
        k = json.loads(rec.key)
        if rec.value is None:
            items.pop(k, None)
        else:
            items[k] = json.loads(rec.value)
    return items


def core_table(records) -> dict:
    """The worker's core table as its changelog records leave it, with the deltas after the last
    checkpoint re-applied (streams/core_store.py)."""
    return CoreStore(changelog_items(records)).current()


def provider_rows(records) -> dict:
    """Provider sessions in the core table (key `p<SEP><provider id>`)."""
    return {k[2:]: v for k, v in core_table(records).items() if k.startswith("p\x1f")}
