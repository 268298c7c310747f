"""An experiment for the latency benchmark: the worker's hot path on bare aiokafka, without Faust.

    python -m benchmarks.pipeline_latency --worker direct   (runs this module as the system under test)

What the worker does per entry, and only that: consume the four input topics, decode and refuse
what the worker refuses (to the dead-letter topic, as the raw message: no DeadLetter envelope), append the accepted events to the journal, apply each
entry to the real `Router` in journal order as soon as its append is acknowledged (the worker's
sequencer), and publish the decisions (to `reply_to`) and reservations. Consumption and
production are batched the way the bare pipeline baseline does it (`getmany`, buffered sends).

What it leaves out, so it is an upper bound for "take Faust off the hot path", not a worker:
no consumer group (it reads every input from the start and owns the journal alone), no
failover, no capacity feed, and by default no state. It answers the question the benchmark notes
leave open: with Faust's per-message path gone, does the core plus Kafka I/O meet the latency
goals on this machine? With SWITCHYARD_DIRECT_STATE=1 it also records each entry as the worker
does (`CoreStore`: a JSON delta per entry, the changed keys every 500 entries), produced to a
`<prefix>direct-core-changelog` topic instead of a Faust table: what the state writes cost.

Environment, as for a worker: KAFKA_BOOTSTRAP_SERVERS, SWITCHYARD_TOPIC_PREFIX,
SWITCHYARD_WEB_PORT (`/metrics` with the worker's metric names the benchmark reads).
"""
from __future__ import annotations

import asyncio
import json
import os
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import Counter, Gauge, start_http_server

from benchmarks.echo_baselines import run_until_stopped
from streams import codec
from streams.client import ensure_topics
from streams.config import Config
from streams.core_store import CoreStore, json_bytes
from streams.router import Router
from streams.scan_kernel import warm_up

DOMAIN_KEY = b"default"
INPUTS = {t: codec.TOPIC_TYPES[t] for t in
          ("switchyard.providers", "switchyard.requests", "switchyard.completions", "switchyard.config")}

APPLIED = Counter("switchyard_journal_entries_applied_total", "Journal entries applied", ["type"])
INGESTED = Counter("switchyard_events_ingested_total", "Input events appended", ["topic", "type"])
DEAD = Counter("switchyard_events_dead_lettered_total", "Input events refused", ["topic", "reason"])
DECISIONS = Counter("switchyard_decisions_total", "Decisions", ["outcome", "reason"])


def wall_ms() -> int:
    return int(time.time() * 1000)


class Changelog(dict):
    """A table that only collects its writes, for the apply loop to produce to a changelog topic."""

    def __init__(self):
        super().__init__()
        self.writes: list[tuple[str, bytes | None]] = []

    def __setitem__(self, key, value) -> None:
        self.writes.append((key, value))

    def pop(self, key, default=None):
        self.writes.append((key, None))
        return default


class DirectRouter:
    def __init__(self, bootstrap: str, prefix: str, state: bool = False):
        self.bootstrap, self.prefix = bootstrap, prefix
        self.router = Router(track_changes=state)
        self.changelog = Changelog() if state else None
        self.store = CoreStore(self.changelog, encode=json_bytes) if state else None
        Gauge("switchyard_providers_online", "Provider sessions online").set_function(
            lambda: len(self.router.providers))
        self.journal = prefix + "switchyard.journal"
        self.acks: asyncio.Queue = asyncio.Queue()
        self.send_lock = asyncio.Lock()
        self.reply_to: dict[tuple[str, int], str] = {}

    async def append(self, raw: bytes, name: str, record: dict) -> None:
        """Append to the journal; the ack joins the queue in send order (= journal order)."""
        time_ms = wall_ms()
        async with self.send_lock:
            ack = await self.producer.send(self.journal, value=raw, key=DOMAIN_KEY, partition=0,
                                           timestamp_ms=time_ms)
            self.acks.put_nowait((ack, time_ms, name, record))

    async def ingest(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100, max_records=1000)
            for tp, records in batches.items():
                allowed = INPUTS[tp.topic[len(self.prefix):]]
                for r in records:
                    why = None
                    try:
                        name, record = codec.decode(r.value)
                    except codec.CodecError as e:
                        why = e.reason
                    else:
                        if name not in allowed:
                            why = "unexpected_type"
                        elif name in codec.PROVIDER_TYPES and (r.key or b"").decode("utf-8", "replace") != \
                                record.get("provider_id"):
                            why = "key_mismatch"
                    if why is not None:
                        DEAD.labels(tp.topic, why).inc()
                        await self.producer.send(self.prefix + "switchyard.deadletter", value=r.value or b"",
                                                 key=r.key)
                        continue
                    await self.append(r.value, name, record)
                    INGESTED.labels(tp.topic, name).inc()

    async def apply(self) -> None:
        decisions = self.prefix + "switchyard.decisions"
        reservations = self.prefix + "switchyard.reservations"
        changelog = self.prefix + "direct-core-changelog"
        while True:
            ack, time_ms, name, record = await self.acks.get()
            offset = (await ack).offset
            if name == "RouteRequest" and record.get("reply_to"):
                self.reply_to[(record["request_id"], record["attempt"])] = record["reply_to"]
            messages = []
            for kind, out in self.router.apply(offset, time_ms, name, record):
                if kind == "RouteDecision":
                    k = (out["request_id"], out["attempt"])
                    topic = self.reply_to.get(k) if out["outcome"] == "queued" else self.reply_to.pop(k, None)
                    messages.append((topic or decisions, out["request_id"].encode(), codec.encode(kind, out)))
                    DECISIONS.labels(out["outcome"], out["reason"] or "").inc()
                elif kind == "Reservation":
                    messages.append((reservations, out["provider_id"].encode(), codec.encode(kind, out)))
            for topic, key, value in messages:
                await self.producer.send(topic, value=value, key=key)
            if self.store is not None:  # the reply keys are left out: the worker's would add a few
                self.store.save(self.router, offset, messages)
                for key, value in self.changelog.writes:
                    await self.producer.send(changelog, key=json.dumps(key).encode(), value=value, partition=0)
                self.changelog.writes.clear()
            APPLIED.labels(name).inc()

    async def tick(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            tick = {"at_ms": wall_ms()}
            await self.append(codec.encode("Tick", tick), "Tick", tick)

    async def run(self) -> None:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                         enable_auto_commit=False, fetch_max_wait_ms=100)
        await self.producer.start()
        await self.consumer.start()
        try:
            if self.store is not None:
                await ensure_topics(self.bootstrap, [self.prefix + "direct-core-changelog"])
            tps = [TopicPartition(self.prefix + t, 0) for t in INPUTS]
            self.consumer.assign(tps)
            await self.consumer.seek_to_beginning(*tps)
            config = Config.from_env(os.environ)
            start = {"config_id": config.config_id, "settings": dict(config.raw), "changed_at_ms": wall_ms(),
                     "author": "direct_router at start"}
            await self.append(codec.encode("ConfigChange", start), "ConfigChange", start)
            await run_until_stopped([self.ingest(), self.apply(), self.tick(config.tick_interval_ms / 1000.0)],
                                    ready="direct router ready")  # Worker.start waits for "ready"
        finally:
            await self.consumer.stop()
            await self.producer.stop()


def main() -> None:
    warm_up()
    start_http_server(int(os.environ.get("SWITCHYARD_WEB_PORT", "6066")), addr="127.0.0.1")
    asyncio.run(DirectRouter(os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
                             os.environ.get("SWITCHYARD_TOPIC_PREFIX", ""),
                             state=os.environ.get("SWITCHYARD_DIRECT_STATE") == "1").run())


if __name__ == "__main__":
    main()
