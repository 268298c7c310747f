"""The Faust application: topics of the wire contract, the lease, the lease holder's loop (ingest,
journal, apply, outputs: `Active`), the table on RocksDB (rocksdict), the dead-letter path and
`/metrics`.

A thin adapter around the pure core (`streams.router`): this module reads the environment, the
clock and Kafka; the core reads none of them. Start a worker with `faust -A app worker`.

Environment (adapter settings, not routing settings):
  KAFKA_BOOTSTRAP_SERVERS  broker list (default 127.0.0.1:9092)
  SWITCHYARD_DATADIR       worker data dir with the RocksDB tables (default ./var/worker)
  SWITCHYARD_WEB_PORT      web port for /metrics (default 6066)
  SWITCHYARD_WEB_BIND      interface the web server listens on (default 127.0.0.1: not exposed)
  SWITCHYARD_APP_ID        consumer group / app id, names the table's changelog (default switchyard,
                           or switchyard-<prefix> with a topic prefix)
  SWITCHYARD_TOPIC_PREFIX  prefix for every topic name (default none; tests isolate with it)
  SWITCHYARD_REPLICATION_FACTOR  replicas of the topics the worker creates (default 1)
  EIGENINFERENCE_*         routing settings; recorded in the journal before the first decision
  KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD,
  KAFKA_SSL_CAFILE         broker connection security (streams/kafka_security.py, docs/security.md)
"""
from __future__ import annotations

import asyncio
import functools
import gc
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

import faust
from faust.web import Request as WebRequest, Response, View
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import codec, faust_consumer, faust_table
from .config import Config
from .journal_topic import JOURNAL_CONFIG, journal_config_problem, topic_config
from .kafka_security import KafkaSecurity
from .core_store import INPUTS as INPUTS_KEY, WORKER_SETTINGS, CoreStore
from .persistence import SEP
from .persistence import key as pkey
from .reply_to import reply_to_problem
from .router import Router
from .scan_kernel import warm_up as warm_up_scan_kernel

DOMAIN_KEY = b"default"  # one routing domain: the journal's (and config topic's) constant key
MAX_DEAD_LETTER_ORIGINAL = codec.MAX_MESSAGE_BYTES - 64 * 1024


# --- app ------------------------------------------------------------------------------------------
def _rocksdb_options() -> dict:
    # Faust's defaults give every table partition a 2 GiB block cache; keep it small.
    return {"driver": "rocksdict", "block_cache_size": 64 * 2**20, "write_buffer_size": 8 * 2**20,
            "max_open_files": 256}


SECURITY = KafkaSecurity.from_env()  # PLAINTEXT unless KAFKA_SECURITY_PROTOCOL says otherwise

class App(faust.App):
    async def on_stop(self) -> None:
        # Before Faust stops its consumer and tables: the loop applies what it appended, saves it
        # and flushes, so a graceful stop leaves nothing to re-send.
        shutting_down.set()
        await active.stop()
        await super().on_stop()


shutting_down = asyncio.Event()
_murmur2_partitioner = DefaultPartitioner()


def partitioner(key, all_partitions, available):
    """Kafka's default placement (murmur2 of the key, as Java clients place keys), computed only
    when there is a choice: most topics here have one partition, and aiokafka's murmur2 is pure
    Python (1.4 % of the worker's CPU at 1000 requests/s)."""
    if len(all_partitions) == 1:
        return all_partitions[0]
    return _murmur2_partitioner(key, all_partitions, available)


TOPIC_PREFIX = os.environ.get("SWITCHYARD_TOPIC_PREFIX", "")
# The group and the table's changelog are named after the app id, not the prefix: a deployment
# with its own prefix gets its own app id unless one is given, or it would load another's state.
APP_ID = os.environ.get("SWITCHYARD_APP_ID") or ("switchyard-" + TOPIC_PREFIX.rstrip(".") if TOPIC_PREFIX else "switchyard")

app = App(
    APP_ID,
    broker="kafka://" + os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    broker_credentials=SECURITY.faust_credentials(),
    # RocksDB (rocksdict); the table and store are writable from the lease holder's loop
    store=f"{faust_table.SCHEME}://",
    Table=faust_table.Table,
    datadir=os.environ.get("SWITCHYARD_DATADIR", "var/worker"),
    web_bind=os.environ.get("SWITCHYARD_WEB_BIND", "127.0.0.1"),
    web_host="127.0.0.1",
    web_port=int(os.environ.get("SWITCHYARD_WEB_PORT", "6066")),
    web_tables_enabled=False,
    web_router_enabled=False,
    topic_partitions=1,
    # 1 for a one-broker cluster (the local broker); a production cluster wants 3, with the
    # brokers' min.insync.replicas = 2, since the journal is written with acks=all.
    topic_replication_factor=int(os.environ.get("SWITCHYARD_REPLICATION_FACTOR", "1")),
    broker_session_timeout=10.0,
    broker_heartbeat_interval=1.0,
    stream_wait_empty=False,
    consumer_auto_offset_reset="earliest",
    producer_acks=-1,
    producer_partitioner=partitioner,
)


BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


def _topic(name: str, **kw):
    # Faust only declares these (created at start if missing, one partition unless told otherwise);
    # the lease holder's loop reads and writes them with aiokafka.
    return app.topic(TOPIC_PREFIX + name, key_type=bytes, value_serializer="raw", key_serializer="raw",
                     internal=True, **kw)


providers_topic = _topic("switchyard.providers")
requests_topic = _topic("switchyard.requests")
completions_topic = _topic("switchyard.completions")
config_topic = _topic("switchyard.config")
journal_topic = _topic("switchyard.journal", partitions=1, config=JOURNAL_CONFIG)
decisions_topic = _topic("switchyard.decisions")
reservations_topic = _topic("switchyard.reservations")
capacity_topic = _topic("switchyard.capacity")
deadletter_topic = _topic("switchyard.deadletter")
# Nothing is ever sent here: the group's assignment of its one partition names the active worker.
lease_topic = _topic("switchyard.lease", partitions=1)
LEASE = TopicPartition(lease_topic.get_topic_name(), 0)
JOURNAL = TopicPartition(journal_topic.get_topic_name(), 0)
# Names the hot path uses, resolved once (Faust's get_topic_name derives it again at every call).
PROVIDERS_TOPIC, DECISIONS_TOPIC, RESERVATIONS_TOPIC = (
    t.get_topic_name() for t in (providers_topic, decisions_topic, reservations_topic))
# The outputs' topics the worker declares itself; any other is a request's reply topic.
OWN_OUTPUTS = frozenset(t.get_topic_name() for t in (decisions_topic, reservations_topic, capacity_topic,
                                                     deadletter_topic))

INPUTS = {
    providers_topic.get_topic_name(): codec.PROVIDER_TYPES,
    requests_topic.get_topic_name(): ("RouteRequest",),
    completions_topic.get_topic_name(): ("Completion",),
    config_topic.get_topic_name(): ("ConfigChange",),
}
# The order in which one fetch's records of the inputs are appended: a request before a completion
# or cancel fetched with it (a gateway that gives up on a request cancels it at once), a
# registration before the requests it can serve.
INPUT_ORDER = {topic: i for i, topic in enumerate(INPUTS)}
faust_consumer.install(rewind=lambda tp: tp == LEASE)

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
# The children the hot path uses, by label values: `labels()` checks and locks on every call.
ingested = functools.cache(EVENTS_INGESTED.labels)
applied = functools.cache(JOURNAL_APPLIED.labels)


@app.page("/metrics")
class Metrics(View):
    async def get(self, request: WebRequest) -> Response:
        return self.bytes(generate_latest(registry), content_type="text/plain; version=0.0.4")


# --- ingest ---------------------------------------------------------------------------------------
def wall_ms() -> int:
    return int(time.time() * 1000)


async def dead_letter(message, reason: str, detail: str = "") -> None:
    DEAD_LETTERED.labels(message.topic, reason).inc()
    original = bytes(message.value or b"")
    if len(original) > MAX_DEAD_LETTER_ORIGINAL:  # the dead letter itself must fit a message
        detail = f"original truncated from {len(original)} bytes; {detail}"
        original = original[:MAX_DEAD_LETTER_ORIGINAL]
    await send_raw(
        deadletter_topic.get_topic_name(), message.key, codec.encode("DeadLetter", {
            "original_key": message.key, "original_value": original, "topic": message.topic,
            "partition": message.partition, "offset": message.offset, "reason": reason,
            "detail": detail[:1000], "at_ms": wall_ms()}))


def checked(topic: str, key: bytes | None, raw: bytes | None) -> tuple[str, dict] | tuple[None, tuple[str, str]]:
    """(name, record) of an input event that may enter the journal, or (None, (reason, detail)).
    Stateless checks only: clamps and semantic checks that need state live in the core (rules §4)."""
    if not raw:
        return None, ("empty", "null value (tombstone)" if raw is None else "empty value")
    try:
        name, record = codec.decode(raw)
    except codec.CodecError as e:
        return None, (e.reason, e.detail)
    if name not in INPUTS[topic]:
        return None, ("unexpected_type", name)
    if topic == PROVIDERS_TOPIC:
        pid = record.get("provider_id") or ""
        if key is None or key.decode("utf-8", "replace") != pid:
            return None, ("key_mismatch", f"key {key!r} != provider_id {pid!r}")
    elif name == "RouteRequest" and record.get("reply_to"):
        problem = reply_to_problem(record["reply_to"], TOPIC_PREFIX)
        if problem:
            return None, ("bad_reply_to", problem)
    return name, record


REPLY_TOPIC_WAIT_S = 2.0     # how long ingest waits for a reply topic's metadata ...
REPLY_TOPIC_MISSING_S = 10.0  # ... and for how long it then refuses that name without asking
missing_reply_topics: dict[str, float] = {}


async def reply_topic_exists(topic: str) -> bool:
    """Whether the worker can send to a request's reply topic. Asked at ingest, not when the
    decision is sent: a send to a topic that is not there (a cluster without topic auto-creation)
    would wait for its metadata inside the apply loop, for every entry behind it, and fail."""
    client = app.producer._producer.client
    if client.cluster.partitions_for_topic(topic):
        return True
    if missing_reply_topics.get(topic, 0.0) > time.monotonic():
        return False
    try:
        await asyncio.wait_for(client._wait_on_metadata(topic), REPLY_TOPIC_WAIT_S)
        return True
    except (asyncio.TimeoutError, KafkaError):
        client._topics.discard(topic)  # not asked for again with every metadata refresh
        missing_reply_topics[topic] = time.monotonic() + REPLY_TOPIC_MISSING_S
        if len(missing_reply_topics) > 10_000:
            missing_reply_topics.clear()
        return False


async def reply_destination(topic: str) -> str:
    """Where a decision for `topic` (a request's reply topic) goes: there, or to the default topic
    if it is not there any more (deleted after its request was ingested: a gateway's private topic
    removed before a restart re-sends or re-applies its entries), or if it is not one the worker
    may write (an entry appended before ingest checked reply_to), so the apply loop never waits on
    a topic that will not come and never writes its own."""
    if not reply_to_problem(topic, TOPIC_PREFIX) and await reply_topic_exists(topic):
        return topic
    REDIRECTED.inc()
    return DECISIONS_TOPIC


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
decisions = functools.cache(DECISIONS.labels)
SINCE_APPEND, SINCE_SENT = DECISION_LATENCY.labels("journal_append"), DECISION_LATENCY.labels("request_sent")
TRIPWIRES = Counter("switchyard_v2_concurrency_tripwire_total",
                    "v2 boxes reporting max_concurrency above the ceiling", ["model"], registry=registry)
PREFILL_SHADOW = Counter("switchyard_prefill_fallback_shadow_total",
                         "Prefill-fallback shadow verdicts", ["decision", "gate"], registry=registry)
BAND_SELECTIONS = Counter("switchyard_band_selections_total", "Decisions picked by the satisficing band",
                          registry=registry)
JOURNAL_LAG = Gauge("switchyard_journal_lag_seconds", "Wall time minus the last applied entry's time, "
                    "at the scrape (Ticks keep it near the tick interval while the loop runs; it grows "
                    "when the loop is stuck)", registry=registry)
# A request's sent_at_ms is the gateway's clock: 0 (unset), skewed or replayed ones are counted, not
# observed, so one request cannot move the request_sent histogram's sum for the life of the process.
SENT_AT_SKEW_S, SENT_AT_MAX_AGE_S = 5.0, 3600.0
REDIRECTED = Counter("switchyard_decisions_redirected_total",
                     "Decisions sent to the default topic because their reply topic was not there any "
                     "more (deleted after the request was ingested) or not one the worker may write",
                     registry=registry)
SENT_AT_UNUSABLE = Counter("switchyard_request_sent_at_unusable_total",
                           "Decided requests whose sent_at_ms is unset, over 5 s ahead or over an hour "
                           "old: left out of the request_sent latency", registry=registry)
REPLAYED = Counter("switchyard_journal_entries_replayed_total",
                   "Entries applied as read from the journal (after the tables' state at start, or "
                   "appended by another worker), not on their append's acknowledgement",
                   registry=registry)
APPLIED_ON_ACK = Counter("switchyard_journal_entries_applied_on_ack_total",
                         "Entries applied when their journal append was acknowledged (the sequencer), "
                         "not when fetched from the journal", registry=registry)
RESENT = Counter("switchyard_outputs_resent_total",
                 "Entries whose outputs were re-sent from the outbox after a restart", registry=registry)
HELD_BACK = Counter("switchyard_ingest_held_back_seconds_total",
                    "Time ingest waited for the apply loop (APPEND_AHEAD_MAX entries ahead): the router "
                    "is saturated; its inputs wait in their topics", registry=registry)
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


class CoreEvents:
    """switchyard_core_events_total{event}: the core's own counts (duplicate requests and events,
    stale heartbeats, unmatched completions, ...), read from its state when /metrics is scraped.
    They are part of the state, so they carry on across restarts and failovers."""

    def collect(self):
        family = CounterMetricFamily("switchyard_core_events", "What the core counted, by event", labels=["event"])
        for event, count in sorted(router.counters.items()):
            family.add_metric([event], count)
        yield family


registry.register(CoreEvents())


async def send_raw(topic: str, key: bytes, value: bytes, partition: int | None = None,
                   timestamp_ms: int | None = None, headers: list | None = None) -> asyncio.Future:
    """Send (buffered by the producer); the future resolves when the broker acknowledges. On
    Faust's aiokafka producer itself: Faust's wrapper adds nothing the worker uses. A message for a
    topic whose metadata the producer has, and whose partition is given or the only one (the
    journal, the one-partition outputs), goes straight to the producer's accumulator: what
    `send` does before that (metadata wait, serializers, partitioner) is about a third of its cost
    and does nothing here (nor does its transaction check: this producer is not transactional)."""
    producer = app.producer._producer
    known = producer.client.cluster.partitions_for_topic(topic)
    if known is None or (partition is None and len(known) != 1) or producer._txn_manager is not None:
        return await producer.send(topic, value, key=key, partition=partition, timestamp_ms=timestamp_ms,
                                   headers=headers)
    if partition is None:
        (partition,) = known
    elif partition not in known:
        raise ValueError(f"{topic} has no partition {partition}")
    return await producer._message_accumulator.add_message(
        TopicPartition(topic, partition), key, value, producer._request_timeout_ms / 1000,
        timestamp_ms=timestamp_ms, headers=headers or [])


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
        return topic or DECISIONS_TOPIC


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
            messages.append((RESERVATIONS_TOPIC, record["provider_id"].encode(),
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
            decisions(record["outcome"], record["reason"] or "").inc()
            SINCE_APPEND.observe(max(0.0, now - entry_time_ms / 1000))
            if request is not None and request.get("request_id") == record["request_id"]:
                since_sent = now - request["sent_at_ms"] / 1000  # the gateway's clock: may be anything
                if request["sent_at_ms"] > 0 and -SENT_AT_SKEW_S < since_sent < SENT_AT_MAX_AGE_S:
                    SINCE_SENT.observe(max(0.0, since_sent))
                else:
                    SENT_AT_UNUSABLE.inc()
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


store = CoreStore.of_json(core_table)


# --- the lease holder's loop ----------------------------------------------------------------------
SOURCE_HEADER = "src"  # a journal entry's input position: b"<topic><SEP><partition><SEP><offset>"


def source_of(headers) -> tuple[str, int, int] | None:
    for name, value in headers or ():
        if name == SOURCE_HEADER:
            topic, partition, offset = value.decode().split(SEP)
            return topic, int(partition), int(offset)
    return None


APPLY_SLICE_S = 0.002  # the apply loop yields after this much work
CHECKPOINT_SLICE = 64  # ... and between this many checkpoint writes (~1-2 ms)
# Entries applied within SAVE_EVERY_S of a batch's first share one delta (at most SAVE_MAX_ENTRIES):
# a key changed many times in that window (meta, a model's serve counter and queue, a provider's
# reservations) is exported and written once. The journal holds every entry meanwhile: after a
# crash the entries after the last delta are applied again from it and their outputs re-sent.
# While ingest is held back (APPEND_AHEAD_MAX) and more entries wait, the batch stays open up to
# SAVE_MAX_ENTRIES: a backlog is saved in big deltas (a provider's row once for several heartbeats).
SAVE_EVERY_S = 0.025
SAVE_MAX_ENTRIES = 2000
SAVE_DUE = None  # the apply queue's item that says the open batch's time is up
# Ingest stays at most this many entries ahead of the apply loop. Past it, inputs wait in their
# topics, so a request's journal time is close to when the router reaches it and an overloaded
# router answers `expired` (now − sent_at_ms > the wait budget) instead of queueing without bound
# between journal and apply, where no recorded time shows the wait (256: ~40–80 ms of work at full
# speed). Ingest resumes below half of it.
APPEND_AHEAD_MAX = 256


@dataclass
class Batch:
    """Entries applied since the last save: their outputs, and the sends' futures."""
    first: int | None = None
    outputs: list = field(default_factory=list)      # [(offset, [(topic, key, value)])]
    futures: list = field(default_factory=list)


START_AUTHOR = "worker {} at start"  # the author of the ConfigChange a worker appends at its start


def is_start_record(record: dict) -> bool:
    author = record.get("author") or ""
    return author.startswith("worker ") and author.endswith(" at start")


class ForeignState(RuntimeError):
    """The table holds state this journal cannot have produced: applying on top of it would skip
    or misapply entries. The loop is not restarted (supervise)."""


class Active:
    """What the worker holding the lease does (the partition of `switchyard.lease`, granted by the
    Faust group): ingest, append to the journal, apply, publish, save. On bare aiokafka consumers
    and Faust's producer, not Faust streams: Faust's per-message path cost ten times the core
    (docs/benchmarks.md). Faust keeps the membership, the table and `/metrics`.

    Start: load the state from the table, re-send the outputs not known to be acknowledged, apply
    the journal entries after the state (a previous owner's, a zombie's) with their outputs, record
    this worker's settings if they differ, then resume each input after the last position the
    journal holds (each entry carries its input position in a header: the journal, not a
    committed offset, says what was ingested). Live: an input is appended to the journal and applied
    when the broker acknowledges its offset (the sequencer: architecture, "Latency"); an entry that
    is not the next one means someone else appended (a zombie), and the entries between are read
    from the journal and applied first. The entries applied within SAVE_EVERY_S are saved in one delta.
    Stop (the lease revoked, the worker stopping): stop ingesting, apply what was appended, flush.
    An error restarts the loop from the table (the supervisor)."""

    def __init__(self):
        self.task: asyncio.Task | None = None
        self.acks: asyncio.Queue | None = None
        self.applying = False
        self.ingesting: list[asyncio.Task] = []
        self.busy = False                                   # the apply loop is applying entries
        self.ahead = 0                                      # entries appended, not applied yet
        self.room: asyncio.Event | None = None              # set when ingest may append again
        self.batch = Batch()                                # applied, not saved yet
        self.save_due: asyncio.TimerHandle | None = None
        self.save_overdue = False                           # SAVE_DUE came while the loop was behind
        self.held_back = False                              # ingest waited for room since the last save
        self.inputs: dict[str, int] = {}                    # "topic<SEP>partition" -> last appended
        self.inputs_changed = False
        self.last_entry_ms: int | None = None               # the journal time of the last applied entry
        self.worker_settings: dict | None = None            # recorded by the last worker at its start
        self.worker_settings_changed = False
        self.unflushed: deque = deque()                     # (last offset, futures) per saved batch
        self.flushed = -1

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self, drain_s: float = 5.0) -> None:
        task, self.task = self.task, None
        if task is None:
            return
        for part in self.ingesting:  # nothing new is appended ...
            part.cancel()
        deadline = time.monotonic() + drain_s
        while not task.done() and (self.busy or (self.acks is not None and not self.acks.empty())) \
                and time.monotonic() < deadline:  # ... and what was appended is applied
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except BaseException:  # cancelled, or the error the supervisor would have logged
            pass
        self.applying = False
        try:
            if not self.busy and self.batch.first is not None:  # stopped between batches: save it
                await self._save(self.batch)
            await core_table.send_changes()
            await app.producer.flush()   # outputs, then the deltas that record them
            self._advance_flushed()
            if not self.unflushed:
                store.mark_flushed(router.offset)
                await core_table.send_changes()
                await app.producer.flush()
        except Exception as exc:
            app.log.warning("router: flush at stop failed (%r); the next owner re-sends", exc)
        app.log.info("router: stopped at journal offset %s", router.offset)

    # -- appending -------------------------------------------------------------------------------
    async def append(self, raw: bytes, name: str, record: dict, source: tuple | None = None) -> None:
        """Append an event to the journal; its acknowledgement joins the queue in journal order."""
        time_ms = wall_ms()
        headers = [(SOURCE_HEADER, SEP.join(map(str, source)).encode())] if source else None
        async with self.append_lock:
            ack = await send_raw(JOURNAL.topic, DOMAIN_KEY, raw, 0, time_ms, headers)
            self.acks.put_nowait((ack, time_ms, name, record, raw, source))
            self.ahead += 1

    async def _ingest(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=1000)
            for tp, records in sorted(batches.items(), key=lambda item: INPUT_ORDER[item[0].topic]):
                for r in records:
                    while self.ahead >= APPEND_AHEAD_MAX:  # backpressure: see APPEND_AHEAD_MAX
                        self.held_back = True
                        self.room.clear()
                        waited = time.perf_counter()
                        await self.room.wait()
                        HELD_BACK.inc(time.perf_counter() - waited)
                    name, record = checked(tp.topic, r.key, r.value)
                    if name == "RouteRequest" and record.get("reply_to") and \
                            not await reply_topic_exists(record["reply_to"]):
                        name, record = None, ("bad_reply_to", f"{record['reply_to']!r}: no such topic")
                    if name is None:
                        await dead_letter(r, *record)
                        continue
                    # The raw bytes are already framed with their schema id: appended unchanged.
                    await self.append(r.value, name, record, (tp.topic, tp.partition, r.offset))
                    ingested(tp.topic, name).inc()

    async def _tick(self) -> None:
        """Ticks put time-driven work (queue timeouts, staleness) at recorded journal positions."""
        while True:
            await asyncio.sleep(worker_config.tick_interval_ms / 1000.0)
            tick = {"at_ms": wall_ms()}
            await self.append(codec.encode("Tick", tick), "Tick", tick)

    # -- applying --------------------------------------------------------------------------------
    def _note_input(self, source: tuple | None) -> None:
        if source is not None:
            topic, partition, offset = source
            k = f"{topic}{SEP}{partition}"
            if offset > self.inputs.get(k, -1):
                self.inputs[k] = offset
                self.inputs_changed = True

    async def _apply_one(self, offset: int, entry_ms: int, name: str | None, record, key: bytes | None,
                         raw: bytes, batch: Batch) -> None:
        """Apply the journal entry at `offset` (the next one) and publish its outputs."""
        if batch.first is None:
            batch.first = offset
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
        if name == "ConfigChange" and is_start_record(record) and not any(k == "DeadLetter" for k, _ in outputs):
            self.worker_settings = {k: v for k, v in record["settings"].items() if v != ""}
            self.worker_settings_changed = True
        messages = encode_outputs_safely(outputs, (offset, entry_ms, key, raw))
        for n, (topic, k, data) in enumerate(messages):
            if topic not in OWN_OUTPUTS:  # a request's reply topic
                messages[n] = (topic := await reply_destination(topic), k, data)
            batch.futures.append(await send_raw(topic, k, data))
        batch.outputs.append((offset, messages))
        observe(outputs, entry_ms, record if name == "RouteRequest" else None)
        applied(name).inc()
        self.last_entry_ms = entry_ms

    async def _read_journal(self, until: int, batch: Batch) -> None:
        """Apply the journal entries from router.offset + 1 up to (excluding) `until`, read from the
        journal: entries this loop did not append (a previous owner's, a zombie's), whose outputs
        nobody is known to have published."""
        self.journal.seek(JOURNAL, router.offset + 1)
        while router.offset + 1 < until:
            records = (await self.journal.getmany(JOURNAL, timeout_ms=1000, max_records=2000)).get(JOURNAL, [])
            for r in records:
                if r.offset >= until:
                    break
                if r.offset <= router.offset:
                    continue
                try:
                    name, record = codec.decode(r.value)
                except codec.CodecError:
                    name, record = None, None
                self._note_input(source_of(r.headers))
                await self._apply_one(r.offset, r.timestamp, name, record, r.key, r.value or b"", batch)
                REPLAYED.inc()

    def _advance_flushed(self) -> None:
        while self.unflushed and all(f.done() for f in self.unflushed[0][1]):
            last, futures = self.unflushed.popleft()
            if any(f.cancelled() or f.exception() is not None for f in futures):
                raise RuntimeError(f"outputs of journal entries up to {last} not acknowledged")
            self.flushed = last

    async def _save(self, batch: Batch) -> None:
        if batch is self.batch:
            self.batch = Batch()
            if self.save_due is not None:
                self.save_due.cancel()
                self.save_due = None
            self.save_overdue = self.held_back = False
        if batch.first is None:
            return
        self._advance_flushed()
        extra = reply_changes()
        if self.inputs_changed:
            extra[INPUTS_KEY] = dict(self.inputs)
            self.inputs_changed = False
        if self.worker_settings_changed:
            extra[WORKER_SETTINGS] = dict(self.worker_settings)
            self.worker_settings_changed = False
        store.save_batch(router, batch.first, router.offset, batch.outputs, extra, self.flushed, defer=True)
        self.unflushed.append((router.offset, batch.futures))
        while store.write_owed(CHECKPOINT_SLICE):  # a big batch owes hundreds of checkpoint writes
            await asyncio.sleep(0)
        await core_table.send_changes()

    async def _apply(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.acks.get()]
            self.busy = True
            while not self.acks.empty():
                items.append(self.acks.get_nowait())
            batch = self.batch
            if batch.first is None and self.save_due is None:
                self.save_due = loop.call_later(SAVE_EVERY_S, self.acks.put_nowait, SAVE_DUE)
            slice_start = time.perf_counter()
            for item in items:
                if item is SAVE_DUE:
                    self.save_overdue = True
                    continue
                ack, time_ms, name, record, raw, source = item
                self.ahead -= 1
                if self.ahead < APPEND_AHEAD_MAX // 2:
                    self.room.set()
                if time.perf_counter() - slice_start > APPLY_SLICE_S:
                    # Let ingest and the producer's sender run: an entry's outputs are sent, and the
                    # next requests appended, while the rest of the batch is applied.
                    await asyncio.sleep(0)
                    slice_start = time.perf_counter()
                offset = (await ack).offset  # not acknowledged: the loop restarts from the table
                if offset <= router.offset:
                    continue
                if offset > router.offset + 1:
                    app.log.info("router: journal offsets %s..%s appended by another worker",
                                 router.offset + 1, offset - 1)
                    await self._read_journal(offset, batch)
                self._note_input(source)
                await self._apply_one(offset, time_ms, name, record, DOMAIN_KEY, raw, batch)
                APPLIED_ON_ACK.inc()
            behind = self.held_back and not self.acks.empty()
            if (self.save_overdue and not behind) or \
                    (batch.first is not None and router.offset - batch.first >= SAVE_MAX_ENTRIES):
                await self._save(batch)
            self.busy = False

    # -- the whole loop --------------------------------------------------------------------------
    async def _load(self) -> None:
        global router
        loaded, outbox, extra = store.load()
        inputs = dict(extra.get(INPUTS_KEY) or {})
        foreign = sorted({k.rsplit(SEP, 1)[0] for k in inputs} - set(INPUTS))
        if foreign:
            raise ForeignState(f"the table ({APP_ID}-core-changelog) holds the state of a deployment that read "
                               f"{foreign}, not this one's inputs: give each deployment its own "
                               f"SWITCHYARD_APP_ID (it names the group and the table's changelog)")
        router, self.inputs = loaded, inputs
        self.worker_settings, self.worker_settings_changed = extra.get(WORKER_SETTINGS), False
        reply_topics.by_request.clear()
        for k, v in extra.items():
            if k.startswith("reply" + SEP):
                _, rid, attempt = k.split(SEP)
                reply_topics.by_request[(rid, int(attempt))] = v
        self.unflushed.clear()
        app.log.info("router: state loaded at journal offset %s; %s entries' outputs to re-send",
                     router.offset, len(outbox))
        futures = []
        for _, messages in outbox:
            for topic, key, data in messages:
                if topic not in OWN_OUTPUTS:
                    topic = await reply_destination(topic)
                futures.append(await send_raw(topic, key, data))
            RESENT.inc()
        self.flushed = router.offset if not outbox else -1
        if outbox:
            self.unflushed.append((router.offset, futures))

    async def _record_config(self) -> None:
        """A worker whose settings (its environment) differ from the ones the last worker recorded
        at its start appends a ConfigChange (rules §3) before deciding anything: a full patch, so
        the recorded config becomes exactly this worker's. With the same settings it appends
        nothing, so what operators changed since, on the config topic, survives a restart or a
        failover. Before any worker recorded its settings (a journal from before this rule), the
        comparison is with the recorded config."""
        mine = dict(worker_config.raw)
        recorded = dict(router.config.raw) if router.counters.get("config_changes") else None
        last_start = self.worker_settings if self.worker_settings is not None else recorded
        if last_start == mine:
            if recorded != mine:
                app.log.info("router: settings as the last worker recorded them; kept the changes "
                             "made on the config topic since (config id %s)", router.config.config_id)
            return
        patch = {name: "" for name in recorded or {}}
        patch.update(mine)
        change = {"config_id": worker_config.config_id, "settings": patch, "changed_at_ms": wall_ms(),
                  "author": START_AUTHOR.format(app.conf.id)}
        if self.worker_settings is not None and recorded not in (None, self.worker_settings):
            app.log.warning("router: this worker's settings replace the recorded ones, changes made "
                            "on the config topic included: %s", sorted(set(recorded.items()) - set(mine.items())))
        await self.append(codec.encode("ConfigChange", change), "ConfigChange", change)

    async def _run(self) -> None:
        global router
        self.acks, self.append_lock, self.busy = asyncio.Queue(), asyncio.Lock(), False
        self.ahead, self.room = 0, asyncio.Event()
        if self.save_due is not None:  # a restart: what the last run applied and did not save is
            self.save_due.cancel()     # applied again from the journal, after the saved state
        self.batch, self.save_due, self.save_overdue, self.held_back = Batch(), None, False, False
        kafka = dict(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False, **SECURITY.aiokafka_kwargs())
        self.journal = AIOKafkaConsumer(**kafka)
        inputs = AIOKafkaConsumer(fetch_max_wait_ms=faust_consumer.FETCH_MAX_WAIT_MS, **kafka)
        try:
            await topics_declared.wait()
            gc.unfreeze()  # a previous run's state (frozen below) can be collected once replaced
            await self._load()
            await self.journal.start()
            self.journal.assign([JOURNAL])
            end = (await self.journal.end_offsets([JOURNAL]))[JOURNAL]
            if router.offset >= end:
                state_at, router = router.offset, Router()  # what /metrics shows is not another journal's
                raise ForeignState(f"the table's state is at journal offset {state_at}, but {JOURNAL.topic} "
                                   f"ends before {end}: it is another journal's state (a journal deleted and "
                                   f"made again?); give this one its own SWITCHYARD_APP_ID")
            batch = Batch()
            await self._read_journal(end, batch)
            await self._save(batch)
            await self._record_config()
            await inputs.start()
            tps = [TopicPartition(t, p) for t in INPUTS for p in sorted(inputs.partitions_for_topic(t) or {0})]
            inputs.assign(tps)
            for tp in tps:
                last = self.inputs.get(f"{tp.topic}{SEP}{tp.partition}")
                if last is None:
                    await inputs.seek_to_beginning(tp)
                else:
                    inputs.seek(tp, last + 1)
            self.applying = True
            app.log.info("router: active from journal offset %s", router.offset + 1)
            # What start-up built (modules, compiled kernels, the loaded state: ~175,000 objects)
            # lives on; frozen, it is not walked by every full collection (65 ms each at 1000/s).
            gc.freeze()
            self.ingesting = [asyncio.ensure_future(self._ingest(inputs)), asyncio.ensure_future(self._tick())]
            apply = asyncio.ensure_future(self._apply())
            try:
                done, _ = await asyncio.wait([apply, *self.ingesting], return_when=asyncio.FIRST_EXCEPTION)
                for part in done:
                    part.result()
            finally:
                for part in (apply, *self.ingesting):
                    part.cancel()
        finally:
            self.applying = False
            await inputs.stop()
            await self.journal.stop()


active = Active()
JOURNAL_LAG.set_function(lambda: max(0.0, time.time() - active.last_entry_ms / 1000)
                         if active.applying and active.last_entry_ms is not None else 0.0)


@app.agent(lease_topic, name="lease")
async def lease(stream) -> None:
    """Subscribes this worker to the lease topic, so the group assigns its partition."""
    async for _ in stream:
        pass


@app.on_partitions_revoked.connect
async def on_revoked(sender, revoked, **kwargs) -> None:
    # Inside the rebalance: the next owner is assigned the lease only after this returns.
    if active.task is not None:
        await active.stop()


@app.task
async def supervise() -> None:
    """Starts the loop while this worker holds the lease and its table is recovered; restarts it
    from the table after an error."""
    while not shutting_down.is_set():
        await asyncio.sleep(0.1)
        if active.task is not None and active.task.done():
            exc = active.task.exception() if not active.task.cancelled() else None
            CORE_ERRORS.labels(f"loop_{type(exc).__name__}").inc()
            if isinstance(exc, ForeignState):
                app.log.critical("router: not routing: %s", exc)
                return  # the task stays done: nothing restarts it
            app.log.error("router: loop stopped (%r); restarting from the table", exc)
            active.task = None
            await asyncio.sleep(1.0)
            continue
        holds = LEASE in app.assignor.assigned_actives() and not app.rebalancing and not app.in_recovery \
            and app.tables.recovery.completed.is_set()
        if holds and active.task is None and not shutting_down.is_set():
            active.start()
        elif not holds and active.task is not None:
            await active.stop()


@app.task
async def declare_topics() -> None:
    """Every topic exists before the loop starts: no wait on broker auto-creation (which most
    production clusters turn off)."""
    for topic in (providers_topic, requests_topic, completions_topic, config_topic, journal_topic,
                  decisions_topic, reservations_topic, capacity_topic, deadletter_topic):
        await topic.maybe_declare()
    topics_declared.set()
    try:
        problem = journal_config_problem(await topic_config(JOURNAL.topic, BOOTSTRAP, SECURITY.aiokafka_kwargs()))
    except Exception as exc:  # the check is advice: a cluster that refuses DescribeConfigs still routes
        app.log.warning("could not read the journal topic's configuration: %r", exc)
        return
    if problem:
        app.log.warning("journal topic %s: %s", JOURNAL.topic, problem)


topics_declared = asyncio.Event()


last_capacity: dict[str, dict] = {}


@app.timer(interval=1.0)
async def publish_capacity() -> None:
    """The per-model capacity feed (domain §2.10.7): at most once a second per model, when it changed."""
    if not active.applying:
        return
    for model in router.models():
        # one compiled pass over the model's candidate index, after rebuilding the rows that
        # heartbeats made stale since its last read (up to a second's worth): one model at a time
        await asyncio.sleep(0)
        feed = router.capacity(model)
        same = {k: v for k, v in feed.items() if k not in ("at_ms", "journal_offset")}
        if last_capacity.get(model) != same:
            last_capacity[model] = same
            await send_raw(capacity_topic.get_topic_name(), model.encode(), codec.encode("ModelCapacity", feed))
