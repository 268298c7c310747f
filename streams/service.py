"""The Faust application: topics of the wire contract, ingest agents, the journal, the router agent,
tables on RocksDB (rocksdict), the dead-letter path and `/metrics`.

A thin adapter around the pure core (`streams.router`): this module reads the environment, the
clock and Kafka; the core reads none of them. Start a worker with `faust -A app worker`.

Environment (adapter settings, not routing settings):
  KAFKA_BOOTSTRAP_SERVERS  broker list (default 127.0.0.1:9092)
  SWITCHYARD_DATADIR       worker data dir with the RocksDB tables (default ./var/worker)
  SWITCHYARD_WEB_PORT      web port for /metrics (default 6066)
  SWITCHYARD_WEB_BIND      interface the web server listens on (default 127.0.0.1: not exposed)
  SWITCHYARD_APP_ID        consumer group / app id (default switchyard)
  SWITCHYARD_TOPIC_PREFIX  prefix for every topic name (default none; tests isolate with it)
  EIGENINFERENCE_*         routing settings; recorded in the journal before the first decision
  KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD,
  KAFKA_SSL_CAFILE         broker connection security (streams/kafka_security.py, docs/security.md)
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

import faust
from faust.serializers import codecs
from faust.web import Request as WebRequest, Response, View
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from . import codec, faust_consumer, faust_table
from .config import Config
from .kafka_security import KafkaSecurity
from .core_store import CoreStore, json_bytes
from .persistence import SEP
from .persistence import key as pkey
from .router import Router
from .scan_kernel import warm_up as warm_up_scan_kernel

DOMAIN_KEY = b"default"  # one routing domain: the journal's (and config topic's) constant key
MAX_DEAD_LETTER_ORIGINAL = codec.MAX_MESSAGE_BYTES - 64 * 1024


# --- the Avro codec as a Faust codec ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decoded:
    name: str
    record: dict


@dataclass(frozen=True, slots=True)
class Undecodable:
    reason: str
    detail: str


class AvroCodec(codecs.Codec):
    """Confluent-framed Avro. Encodes `(record_name, record)`; decoding never raises, so an agent
    can dead-letter a bad message instead of the consumer crashing on it."""

    def _dumps(self, obj) -> bytes:
        name, record = obj
        return codec.encode(name, record)

    def _loads(self, s: bytes):
        try:
            return Decoded(*codec.decode(s))
        except codec.CodecError as e:
            return Undecodable(e.reason, e.detail)


codecs.register("avro", AvroCodec())


# --- app ------------------------------------------------------------------------------------------
def _rocksdb_options() -> dict:
    # Faust's defaults give every table partition a 2 GiB block cache; keep it small.
    return {"driver": "rocksdict", "block_cache_size": 64 * 2**20, "write_buffer_size": 8 * 2**20,
            "max_open_files": 256}


SECURITY = KafkaSecurity.from_env()  # PLAINTEXT unless KAFKA_SECURITY_PROTOCOL says otherwise

app = faust.App(
    os.environ.get("SWITCHYARD_APP_ID", "switchyard"),
    broker="kafka://" + os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    broker_credentials=SECURITY.faust_credentials(),
    # RocksDB (rocksdict); the table and store are writable from the sequencer's task
    store=f"{faust_table.SCHEME}://",
    Table=faust_table.Table,
    datadir=os.environ.get("SWITCHYARD_DATADIR", "var/worker"),
    web_bind=os.environ.get("SWITCHYARD_WEB_BIND", "127.0.0.1"),
    web_host="127.0.0.1",
    web_port=int(os.environ.get("SWITCHYARD_WEB_PORT", "6066")),
    web_tables_enabled=False,
    web_router_enabled=False,
    topic_partitions=1,
    topic_replication_factor=1,
    broker_session_timeout=10.0,
    broker_heartbeat_interval=1.0,
    stream_wait_empty=False,
    consumer_auto_offset_reset="earliest",
    producer_acks=-1,
)


BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
TOPIC_PREFIX = os.environ.get("SWITCHYARD_TOPIC_PREFIX", "")


def _topic(name: str, value_serializer: str = "avro", **kw):
    # internal=True: the worker creates the topic at start if it is missing (one partition unless
    # told otherwise), so agents never subscribe to a topic that does not exist yet.
    return app.topic(TOPIC_PREFIX + name, key_type=bytes, value_serializer=value_serializer,
                     key_serializer="raw", internal=True, **kw)


providers_topic = _topic("switchyard.providers")
requests_topic = _topic("switchyard.requests")
completions_topic = _topic("switchyard.completions")
config_topic = _topic("switchyard.config")
# Raw: the router agent skips most entries (the sequencer applied them when they were acknowledged)
# and decodes only those it applies.
journal_topic = _topic("switchyard.journal", value_serializer="raw", partitions=1)
decisions_topic = _topic("switchyard.decisions")
reservations_topic = _topic("switchyard.reservations")
capacity_topic = _topic("switchyard.capacity")
deadletter_topic = _topic("switchyard.deadletter")

INPUTS = {
    providers_topic.get_topic_name(): codec.PROVIDER_TYPES,
    requests_topic.get_topic_name(): ("RouteRequest",),
    completions_topic.get_topic_name(): ("Completion",),
    config_topic.get_topic_name(): ("ConfigChange",),
}
faust_consumer.install(rewind=lambda tp: tp.topic in INPUTS or tp.topic == journal_topic.get_topic_name())

# The routing core's state, key by key (streams/persistence.py), checkpointed, with the deltas of
# the last entries since (streams/core_store.py).
# Values are JSON bytes that CoreStore encodes once: with Faust's own JSON serializer each write
# was serialised twice, for RocksDB and for the changelog. The changelog still carries JSON.
core_table = app.Table("core", default=None, partitions=1, key_type=str, value_type=bytes,
                       options=_rocksdb_options())

# --- metrics --------------------------------------------------------------------------------------
registry = CollectorRegistry()
EVENTS_INGESTED = Counter("switchyard_events_ingested_total", "Input events appended to the journal",
                          ["topic", "type"], registry=registry)
DEAD_LETTERED = Counter("switchyard_events_dead_lettered_total", "Input events refused, by reason",
                        ["topic", "reason"], registry=registry)
PROVIDERS_ONLINE = Gauge("switchyard_providers_online", "Provider sessions online", registry=registry)
PROVIDERS_ONLINE.set_function(lambda: len(router.providers))
JOURNAL_APPLIED = Counter("switchyard_journal_entries_applied_total", "Journal entries applied",
                          ["type"], registry=registry)


@app.page("/metrics")
class Metrics(View):
    async def get(self, request: WebRequest) -> Response:
        return self.bytes(generate_latest(registry), content_type="text/plain; version=0.0.4")


# --- ingest ---------------------------------------------------------------------------------------
def wall_ms() -> int:
    return int(time.time() * 1000)


def ms_to_kafka_seconds(ms: int) -> float:
    # Faust multiplies by 1000 and truncates; the half-millisecond keeps the integer exact.
    return (ms + 0.5) / 1000.0


async def dead_letter(message, reason: str, detail: str = "") -> None:
    DEAD_LETTERED.labels(message.topic, reason).inc()
    original = bytes(message.value or b"")
    if len(original) > MAX_DEAD_LETTER_ORIGINAL:  # the dead letter itself must fit a message
        detail = f"original truncated from {len(original)} bytes; {detail}"
        original = original[:MAX_DEAD_LETTER_ORIGINAL]
    await app.producer.send(
        deadletter_topic.get_topic_name(), key=message.key, partition=None, timestamp=None,
        headers=None, value=codec.encode("DeadLetter", {
            "original_key": message.key, "original_value": original, "topic": message.topic,
            "partition": message.partition, "offset": message.offset, "reason": reason,
            "detail": detail[:1000], "at_ms": wall_ms()}))


def refusal(topic: str, key: bytes | None, value) -> tuple[str, str] | None:
    """Why an input event may not enter the journal, or None. Stateless checks only: clamps and
    semantic checks that need state live in the core (rules §4)."""
    if value is None:  # a tombstone: Faust hands a null value over without calling the codec
        return "empty", "null value (tombstone)"
    if isinstance(value, Undecodable):
        return value.reason, value.detail
    if value.name not in INPUTS[topic]:
        return "unexpected_type", value.name
    if topic == providers_topic.get_topic_name():
        pid = value.record.get("provider_id") or ""
        if key is None or key.decode("utf-8", "replace") != pid:
            return "key_mismatch", f"key {key!r} != provider_id {pid!r}"
    return None


async def ingest(stream) -> None:
    async for event in stream.events():
        message = event.message
        why = refusal(message.topic, message.key, event.value)
        if why is not None:
            await dead_letter(message, *why)
            continue
        # The raw bytes are already framed with their schema id: append them unchanged. The send
        # is buffered; Faust flushes the producer before it commits the input offsets, so an
        # event is in the journal before its input offset counts as processed (at-least-once).
        await sequencer.append(bytes(message.value), event.value.name, event.value.record)
        EVENTS_INGESTED.labels(message.topic, event.value.name).inc()


for _topic_obj, _name in ((providers_topic, "ingest_providers"), (requests_topic, "ingest_requests"),
                          (completions_topic, "ingest_completions"), (config_topic, "ingest_config")):
    app.agent(_topic_obj, name=_name)(ingest)


# --- the router -----------------------------------------------------------------------------------
warm_up_scan_kernel()  # before the worker starts: not on the first request's path
router = Router()
worker_config = Config.from_env(os.environ)  # recorded in the journal before it decides anything

DECISIONS = Counter("switchyard_decisions_total", "Route decisions by outcome and reason",
                    ["outcome", "reason"], registry=registry)
DECISION_LATENCY = Histogram(
    "switchyard_decision_latency_seconds", "Latency to the decision's publication",
    ["since"], registry=registry,
    buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
TRIPWIRES = Counter("switchyard_v2_concurrency_tripwire_total",
                    "v2 boxes reporting max_concurrency above the ceiling", ["model"], registry=registry)
PREFILL_SHADOW = Counter("switchyard_prefill_fallback_shadow_total",
                         "Prefill-fallback shadow verdicts", ["decision", "gate"], registry=registry)
BAND_SELECTIONS = Counter("switchyard_band_selections_total", "Decisions picked by the satisficing band",
                          registry=registry)
JOURNAL_LAG = Gauge("switchyard_journal_lag_seconds", "Wall time minus the last applied entry's time",
                    registry=registry)
REPLAYED = Counter("switchyard_journal_entries_replayed_total",
                   "Entries folded from the journal at start because the tables were behind",
                   registry=registry)
APPLIED_ON_ACK = Counter("switchyard_journal_entries_applied_on_ack_total",
                         "Entries applied when their journal append was acknowledged (the sequencer), "
                         "not when fetched from the journal", registry=registry)
RESENT = Counter("switchyard_outputs_resent_total",
                 "Entries whose outputs were re-sent from the outbox after a restart", registry=registry)
CORE_ERRORS = Counter("switchyard_core_errors_total", "Journal entries the core failed on (bugs)",
                      ["error"], registry=registry)


class QueueDepth:
    """switchyard_queue_depth{model}, read from the router when /metrics is scraped (setting a
    labelled gauge for every model after every entry cost more than the scrapes do)."""

    def collect(self):
        family = GaugeMetricFamily("switchyard_queue_depth", "Requests waiting per model", labels=["model"])
        for model, queue in sorted(router.queues.items()):
            family.add_metric([model], len(queue))
        yield family


registry.register(QueueDepth())


async def send_raw(topic: str, key: bytes, value: bytes) -> None:
    # Buffered like ingest's journal append: flushed before the journal offset is committed.
    await app.producer.send(topic, key=key, value=value, partition=None, timestamp=None, headers=None)


class ReplyTopics:
    """Where each request's decisions go: its `reply_to`, remembered until its final decision (a
    queued request is answered later, while some other entry is being applied). Saved with the
    core's state (keys `reply<SEP><request_id><SEP><attempt>`)."""

    LIMIT = 200_000

    def __init__(self):
        self.by_request: OrderedDict[tuple[str, int], str] = OrderedDict()
        self.dirty: set[tuple[str, int]] = set()

    def note(self, name: str, record: dict) -> None:
        if name == "RouteRequest" and record.get("reply_to"):
            k = (record.get("request_id"), record.get("attempt"))
            self.by_request[k] = record["reply_to"]
            self.dirty.add(k)
            if len(self.by_request) > self.LIMIT:
                self.dirty.add(self.by_request.popitem(last=False)[0])

    def topic_for(self, decision: dict) -> str:
        k = (decision["request_id"], decision["attempt"])
        if decision["outcome"] == "queued":
            topic = self.by_request.get(k)
        else:
            topic = self.by_request.pop(k, None)
            self.dirty.add(k)
        return topic or decisions_topic.get_topic_name()


reply_topics = ReplyTopics()


def apply_entry(offset: int, time_ms: int, name: str, record: dict) -> list:
    reply_topics.note(name, record)
    return router.apply(offset, time_ms, name, record)


CORE_REFUSAL_ORIGINAL = 4096  # the whole entry stays in the journal at the dead letter's offset


def encode_outputs(outputs: list, entry: tuple | None = None) -> list[tuple[str, bytes, bytes]]:
    """(topic, key, value) of every message an entry's outputs publish. `entry` = (offset, journal
    time ms, key, raw value) of the journal entry: an event the core refuses is dead-lettered with
    the core's reason (at_ms is the journal time, so a copy re-sent from the outbox is identical)."""
    messages = []
    for kind, record in outputs:
        if kind == "Rejected" and entry is not None:
            offset, entry_ms, key, raw = entry
            detail = record.get("detail") or ""
            if len(raw) > CORE_REFUSAL_ORIGINAL:
                detail = f"original truncated from {len(raw)} bytes (whole entry at the offset); {detail}"
            messages.append((deadletter_topic.get_topic_name(), key or b"", codec.encode("DeadLetter", {
                "original_key": key, "original_value": raw[:CORE_REFUSAL_ORIGINAL],
                "topic": journal_topic.get_topic_name(), "partition": 0, "offset": offset,
                "reason": record["reason"], "detail": detail[:1000], "at_ms": entry_ms})))
        if kind == "RouteDecision":
            messages.append((reply_topics.topic_for(record), record["request_id"].encode(),
                             codec.encode(kind, record)))
        elif kind == "Reservation":
            messages.append((reservations_topic.get_topic_name(), record["provider_id"].encode(),
                             codec.encode(kind, record)))
    return messages


def encode_outputs_safely(outputs: list, entry: tuple) -> list[tuple[str, bytes, bytes]]:
    """encode_outputs, one output at a time: an output the codec refuses (a core bug, e.g. a value
    outside Avro's long) is counted and skipped instead of crashing the router agent after the
    entry was applied — which would lose every output of the entry, the decision included."""
    try:
        return encode_outputs(outputs, entry)
    except codec.CodecError:
        messages = []
        for output in outputs:
            try:
                messages += encode_outputs([output], entry)
            except codec.CodecError as exc:
                app.log.error("journal offset %s: cannot encode %s: %s", entry[0], output[0], exc)
                CORE_ERRORS.labels(f"encode_{output[0]}").inc()
        return messages


def observe(outputs: list, entry_time_ms: int, request: dict | None) -> None:
    """Metrics for what the core decided."""
    now = time.time()
    for kind, record in outputs:
        if kind == "RouteDecision":
            DECISIONS.labels(record["outcome"], record["reason"] or "").inc()
            DECISION_LATENCY.labels("journal_append").observe(max(0.0, now - entry_time_ms / 1000))
            if request is not None and request.get("request_id") == record["request_id"]:
                DECISION_LATENCY.labels("request_sent").observe(max(0.0, now - request["sent_at_ms"] / 1000))
            if record["selected_by"] == "band":
                BAND_SELECTIONS.inc()
        elif kind == "Tripwire":
            TRIPWIRES.labels(record["model"]).inc()
        elif kind == "PrefillShadow":
            PREFILL_SHADOW.labels(record["decision"], record["gate"]).inc()
        elif kind == "Rejected":
            DEAD_LETTERED.labels(journal_topic.get_topic_name(), record["reason"]).inc()


def reply_changes() -> dict:
    """The reply topics changed since the last call, as core-table keys (None = delete)."""
    changes = {pkey("reply", *k): reply_topics.by_request.get(k) for k in reply_topics.dirty}
    reply_topics.dirty.clear()
    return changes


store = CoreStore(core_table, encode=json_bytes, decode=json.loads)


async def catch_up(router: Router, until: int) -> None:
    """Fold the journal entries the core has not seen, up to (excluding) `until`, discarding their
    outputs (they were published when first applied): the in-memory state is a pure function of
    the journal (architecture, invariant 1). A fresh worker rebuilds this way."""
    consumer = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False,
                                **SECURITY.aiokafka_kwargs())
    await consumer.start()
    try:
        tp = TopicPartition(journal_topic.get_topic_name(), 0)
        consumer.assign([tp])
        consumer.seek(tp, router.offset + 1)
        while router.offset + 1 < until:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
            for record in batch.get(tp, []):
                if record.offset >= until:
                    break
                try:
                    name, value = codec.decode(record.value)
                except codec.CodecError:
                    router.offset = record.offset
                    continue
                apply_entry(record.offset, record.timestamp, name, value)
                REPLAYED.inc()
    finally:
        await consumer.stop()


async def append_to_journal(name: str, record: dict) -> None:
    await sequencer.append(codec.encode(name, record), name, record)


@app.task
async def declare_output_topics() -> None:
    """Output topics exist before the first decision: no wait on broker auto-creation (which most
    production clusters turn off)."""
    for topic in (decisions_topic, reservations_topic, capacity_topic, deadletter_topic):
        await topic.maybe_declare()


@app.task(on_leader=True)
async def record_worker_config() -> None:
    """A worker whose settings differ from the last recorded ones appends a ConfigChange (rules §3):
    a full patch, so the recorded config becomes exactly this worker's."""
    await app.tables.recovery.completed.wait()
    recorded = store.current().get("meta")
    if recorded is not None and recorded.get("settings") == dict(worker_config.raw):
        return
    patch = {name: "" for name in (recorded or {}).get("settings", {})}
    patch.update(worker_config.raw)
    if recorded is None and not patch:
        patch = {}  # nothing recorded and all defaults: still record the starting config
    await append_to_journal("ConfigChange", {
        "config_id": worker_config.config_id, "settings": patch, "changed_at_ms": wall_ms(),
        "author": f"worker {app.conf.id} at start"})


@app.timer(interval=worker_config.tick_interval_ms / 1000.0, on_leader=True)
async def tick() -> None:
    """Ticks put time-driven work (queue timeouts, staleness) at recorded journal positions."""
    await append_to_journal("Tick", {"at_ms": wall_ms()})


last_capacity: dict[str, dict] = {}


@app.timer(interval=1.0)
async def publish_capacity() -> None:
    """The per-model capacity feed (domain §2.10.7): at most once a second per model, when it changed."""
    if router.offset < 0:
        return
    for model in router.models():
        await asyncio.sleep(0)  # one model at a time: a big fleet's feed takes tens of ms
        feed = router.capacity(model)
        same = {k: v for k, v in feed.items() if k not in ("at_ms", "journal_offset")}
        if last_capacity.get(model) != same:
            last_capacity[model] = same
            await send_raw(capacity_topic.get_topic_name(), model.encode(), codec.encode("ModelCapacity", feed))


# Both paths below apply journal entries; one lock keeps their applies (and the table writes and
# outputs of each entry) in journal order.
apply_lock = asyncio.Lock()
loaded = False  # the state was loaded from the tables (by the router agent's first entry)


async def apply_and_publish(offset: int, entry_ms: int, name: str | None, record, key: bytes | None,
                            raw: bytes) -> None:
    """Apply the journal entry at `offset` (the next one), publish its outputs, save the state."""
    if name is None:  # undecodable or null; only this app writes the journal
        JOURNAL_APPLIED.labels("undecodable").inc()
        router.offset = offset
        return
    try:
        outputs = apply_entry(offset, entry_ms, name, record)
    except Exception as exc:  # a core bug must not stop the domain: count it, keep going
        app.log.exception("core failed on journal offset %s", offset)
        CORE_ERRORS.labels(type(exc).__name__).inc()
        router.offset = offset
        return
    messages = encode_outputs_safely(outputs, (offset, entry_ms, key, raw))
    for topic, k, data in messages:
        await send_raw(topic, k, data)
    store.save(router, offset, messages, reply_changes())
    observe(outputs, entry_ms, record if name == "RouteRequest" else None)
    JOURNAL_APPLIED.labels(name).inc()
    JOURNAL_LAG.set(max(0.0, time.time() - entry_ms / 1000))


class Sequencer:
    """The router as the journal's sequencer (architecture, "Latency"): an event this worker appends
    is applied as soon as the broker acknowledges its journal offset, not after a fetch of the
    journal, which takes a hop off every reply. The journal stays the authority: an acknowledged
    entry is applied here only if this worker owns the journal, the state is loaded and the entry
    is the next one (offset == router.offset + 1). Anything else — an entry another worker
    appended (a standby leader's Tick), a failed send, a gap — is left to the router agent, which
    follows the journal and skips what is already applied."""

    def __init__(self):
        self.acks: asyncio.Queue = asyncio.Queue()  # binds to the running loop at first use

    async def append(self, raw: bytes, name: str, record: dict) -> None:
        time_ms = wall_ms()
        ack = await app.producer.send(journal_topic.get_topic_name(), key=DOMAIN_KEY, value=raw,
                                      partition=0, timestamp=ms_to_kafka_seconds(time_ms), headers=None)
        self.acks.put_nowait((ack, time_ms, name, record, raw))  # in send order = journal order

    async def run(self) -> None:
        journal = journal_topic.get_topic_name()
        while True:
            ack, time_ms, name, record, raw = await self.acks.get()
            try:
                offset = (await ack).offset
            except Exception as exc:  # not known to be in the journal: the router agent decides
                app.log.warning("journal append not acknowledged (%s); left to the router agent", exc)
                continue
            async with apply_lock:
                if not loaded or offset != router.offset + 1 or \
                        TopicPartition(journal, 0) not in app.consumer.assignment():
                    continue
                try:
                    await apply_and_publish(offset, time_ms, name, record, DOMAIN_KEY, raw)
                except Exception as exc:  # must not stop the worker (a task's error would)
                    app.log.exception("sequencer failed on journal offset %s", offset)
                    CORE_ERRORS.labels(f"sequencer_{type(exc).__name__}").inc()
                    continue
                APPLIED_ON_ACK.inc()


sequencer = Sequencer()


@app.task
async def run_sequencer() -> None:
    await sequencer.run()


@app.agent(journal_topic, name="router")
async def route(stream) -> None:
    global router, loaded
    async for event in stream.events():
        message, value = event.message, event.value
        offset = message.offset
        async with apply_lock:
            if not loaded:  # first entry after (re)start: state from the tables, lost outputs re-sent
                loaded = True
                if router.offset < 0:
                    router, outbox, replies = store.load()
                    for k, v in replies.items():
                        _, rid, attempt = k.split(SEP)
                        reply_topics.by_request[(rid, int(attempt))] = v
                    app.log.info("router: state loaded at journal offset %s; first entry %s", router.offset, offset)
                    for o, messages in outbox:
                        if offset <= o <= router.offset:
                            for topic, key, data in messages:
                                await send_raw(topic, key, data)
                            RESENT.inc()
            if offset <= router.offset:  # redelivered, or applied on its acknowledgement
                continue
            if offset > router.offset + 1:
                app.log.info("router: catching up journal offsets %s..%s", router.offset + 1, offset - 1)
                await catch_up(router, offset)
                app.log.info("router: caught up")
            raw = bytes(value or b"")
            try:
                name, record = codec.decode(raw)
            except codec.CodecError:
                name, record = None, None
            await apply_and_publish(offset, round(message.timestamp * 1000), name, record, message.key, raw)
