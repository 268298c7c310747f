"""Where a journal comes from: a JSON Lines file, an Avro object container file (as `export --avro`
writes), or a Kafka topic partition (live journal); and where the recorded decisions come from for
an audit (lines of the same file, or a decisions topic).

Entries are read as they are consumed: a day's journal (≈ 12 M entries) does not fit in memory as
dicts, so `run`, `audit` and `explain` hold only the router's state (and an audit the decisions).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Iterable, Iterator

from fastavro import parse_schema, reader as avro_reader

from streams import codec
from streams.client import auth
from streams.kafka_security import KafkaSecurity
from streams.jsonl import JournalEntry, read_journal
from streams.router import OUTPUT_TYPES

from .child_process import ReadInChild

AVRO_MAGIC = b"Obj\x01"  # the first bytes of an Avro object container file
# The container's event is a union of records: its branch name tells the type. Nested optional
# records (["null", Record]) must come back as plain dicts, as the core reads them.
AVRO_READ = {"return_record_name": True, "return_record_name_override": True}


def container_schema() -> dict:
    """The record of an Avro object container journal: one JournalEntry per entry, the event as a
    union of every record type (a journal topic holds input events and Ticks; a union of all
    types also takes anything else a topic holds)."""
    return parse_schema({"type": "record", "name": "JournalEntry", "namespace": "switchyard",
                         "fields": [{"name": "journal_offset", "type": "long"},
                                    {"name": "journal_time_ms", "type": ["null", "long"]},
                                    {"name": "event", "type": [codec.schema(n) for n in sorted(codec.RECORD_NAMES)]}]})


class JournalIncomplete(ValueError):
    """A journal that does not begin with its first entry (offset 0). A replay starts from the
    initial state, so replaying what is left would give other decisions than the worker's."""


def incomplete(where: str, first: int, why: str) -> JournalIncomplete:
    return JournalIncomplete(
        f"{where} begins at offset {first}, not 0: {why}. A replay starts from the initial state "
        f"and needs every entry from offset 0; replay an export taken while they were all there.")


def is_avro_container(path: str) -> bool:
    with open(path, "rb") as fp:
        return fp.read(4) == AVRO_MAGIC


def avro_entries(path: str) -> Iterator[JournalEntry]:
    """The entries of an Avro object container file with `JournalEntry` records."""
    with open(path, "rb") as fp:
        for row in avro_reader(fp, **AVRO_READ):
            name, record = row["event"]
            yield JournalEntry(row["journal_offset"], row["journal_time_ms"], name.rsplit(".", 1)[-1], record)


class FromFirstEntry:
    """The entries of a journal file, read once; JournalIncomplete if its first input entry's
    offset is more than the lines before it (outputs, or lines the reader skipped: each takes up
    an offset). `skipped` is the reader's."""

    def __init__(self, path: str, entries: Iterable[JournalEntry]):
        self.path, self.entries = path, entries

    @property
    def skipped(self) -> Counter:
        return getattr(self.entries, "skipped", Counter())

    def __iter__(self) -> Iterator[JournalEntry]:
        lines_before, rest = 0, iter(self.entries)
        for entry in rest:
            if entry.type in OUTPUT_TYPES:
                lines_before += 1
                yield entry
                continue
            if entry.journal_offset > lines_before + sum(self.skipped.values()):
                raise incomplete(self.path, entry.journal_offset, "the entries before it are not in the "
                                 "file (an export of a journal whose first entries were deleted, or of a window)")
            yield entry
            break
        yield from rest


class JournalStream:
    """The input entries of a journal file, read as they are iterated (once). The recorded
    decisions in it are kept as they pass (`recorded`); `count` is the input entries so far and
    `skipped` the JSON Lines reader's skipped lines by reason (empty for a container file)."""

    def __init__(self, path: str):
        self.path = path
        self.recorded: list[dict] = []
        self.count = 0
        self.skipped: Counter = Counter()

    def __iter__(self) -> Iterator[JournalEntry]:
        path = self.path
        read = avro_entries if is_avro_container(path) else read_journal
        entries = ReadInChild(lambda: FromFirstEntry(path, read(path)))  # decoded on the other core
        self.skipped = entries.skipped
        for entry in entries:
            if entry.type == "RouteDecision":
                self.recorded.append(entry.record)
            elif entry.type not in OUTPUT_TYPES:
                self.count += 1
                yield entry


async def _kafka_batches(bootstrap: str, topic: str, partition: int, start: int | None, end: int | None,
                         start_ms: int | None = None, end_ms: int | None = None, from_first: bool = False,
                         security: KafkaSecurity | None = None):
    from aiokafka import AIOKafkaConsumer, TopicPartition
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                auto_offset_reset="earliest", **auth(security))
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
        if from_first and low > 0:
            raise incomplete(f"{topic} partition {partition}", low,
                             "the entries before it were deleted (the topic's retention.ms or retention.bytes; "
                             "the worker logs a warning at start when they are set)")
        consumer.seek(tp, max(low, start or 0))  # an explicit seek: seek_to_beginning can race
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=10_000)
            yield [r for r in batch.get(tp, []) if r.offset < end]
    finally:
        await consumer.stop()


def kafka_records(bootstrap: str, topic: str, partition: int = 0, start: int | None = None,
                  end: int | None = None, start_ms: int | None = None, end_ms: int | None = None,
                  from_first: bool = False, security: KafkaSecurity | None = None) -> Iterator:
    """The records of a topic partition (optionally between offsets or times), fetched in batches
    as they are consumed. `from_first`: raise JournalIncomplete if its first records were deleted."""
    loop = asyncio.new_event_loop()
    batches = _kafka_batches(bootstrap, topic, partition, start, end, start_ms, end_ms, from_first, security)
    try:
        while True:
            try:
                batch = loop.run_until_complete(batches.__anext__())
            except StopAsyncIteration:
                return
            yield from batch
    finally:
        loop.run_until_complete(batches.aclose())  # stops the consumer, also when abandoned early
        loop.close()


def kafka_journal(bootstrap: str, topic: str, partition: int = 0, **window) -> Iterator[JournalEntry]:
    """Journal entries from Kafka: offset = Kafka offset, journal time = the record timestamp."""
    for rec in kafka_records(bootstrap, topic, partition, **window):
        try:
            name, value = codec.decode(rec.value)
        except codec.CodecError:
            continue
        yield JournalEntry(rec.offset, rec.timestamp, name, value)


class KafkaJournal:
    """The entries of a journal topic partition, read as they are iterated (once); like
    `JournalStream`, with no recorded decisions (they are on their own topic)."""

    def __init__(self, bootstrap: str, topic: str, partition: int = 0, **window):
        self.args = (bootstrap, topic, partition)
        self.window = window
        self.recorded = None
        self.count = 0
        self.skipped: Counter = Counter()

    def __iter__(self) -> Iterator[JournalEntry]:
        args, window = self.args, self.window
        for entry in ReadInChild(lambda: kafka_journal(*args, **window)):  # fetched on the other core
            self.count += 1
            yield entry


def kafka_decisions(bootstrap: str, topic: str, security: KafkaSecurity | None = None) -> list[dict]:
    out = []
    for rec in kafka_records(bootstrap, topic, 0, security=security):
        try:
            name, value = codec.decode(rec.value)
        except codec.CodecError:
            continue
        if name == "RouteDecision":
            out.append(value)
    return out
