"""Where a journal comes from: a JSON Lines file, or a Kafka topic partition (live journal), and
where the recorded decisions come from for an audit (lines of the same file, or a decisions topic).
"""
from __future__ import annotations

import asyncio
from typing import Iterator

from streams import codec
from streams.jsonl import JournalEntry, read_journal
from streams.router import OUTPUT_TYPES


class JournalFile:
    """Input entries and recorded outputs of a JSON Lines journal."""

    def __init__(self, path: str):
        self.path = path
        self.reader = read_journal(path)
        self.entries: list[JournalEntry] = []
        self.recorded: list[dict] = []
        for entry in self.reader:
            if entry.type == "RouteDecision":
                self.recorded.append(entry.record)
            elif entry.type not in OUTPUT_TYPES:
                self.entries.append(entry)

    @property
    def skipped(self):
        return self.reader.skipped


async def _read_kafka(bootstrap: str, topic: str, partition: int, start: int | None, end: int | None,
                      start_ms: int | None = None, end_ms: int | None = None) -> list:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        high = (await consumer.end_offsets([tp]))[tp]
        if start_ms is not None:
            found = (await consumer.offsets_for_times({tp: start_ms}))[tp]
            start = found.offset if found else high
        if end_ms is not None:
            found = (await consumer.offsets_for_times({tp: end_ms}))[tp]
            end = min(end if end is not None else high, found.offset if found else high)
        end = high if end is None else min(end, high)
        low = (await consumer.beginning_offsets([tp]))[tp]
        consumer.seek(tp, max(low, start or 0))  # an explicit seek: seek_to_beginning can race
        out = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=10_000)
            out.extend(r for r in batch.get(tp, []) if r.offset < end)
        return out
    finally:
        await consumer.stop()


def kafka_records(bootstrap: str, topic: str, partition: int = 0, start: int | None = None,
                  end: int | None = None, start_ms: int | None = None, end_ms: int | None = None) -> list:
    return asyncio.run(_read_kafka(bootstrap, topic, partition, start, end, start_ms, end_ms))


def kafka_journal(bootstrap: str, topic: str, partition: int = 0, **window) -> Iterator[JournalEntry]:
    """Journal entries from Kafka: offset = Kafka offset, journal time = the record timestamp."""
    for rec in kafka_records(bootstrap, topic, partition, **window):
        try:
            name, value = codec.decode(rec.value)
        except codec.CodecError:
            continue
        yield JournalEntry(rec.offset, rec.timestamp, name, value)


def kafka_decisions(bootstrap: str, topic: str) -> list[dict]:
    out = []
    for rec in kafka_records(bootstrap, topic, 0):
        try:
            name, value = codec.decode(rec.value)
        except codec.CodecError:
            continue
        if name == "RouteDecision":
            out.append(value)
    return out
