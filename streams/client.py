"""Kafka clients of the wire contract (events.md) for the parties around the router.

This module owns the outside view of Switchyard, over plain aiokafka with Avro values framed by
`streams.codec` (never Faust's `agent.ask`):

* `GatewayClient` — a gateway: publishes RouteRequests and awaits their RouteDecisions on its reply
  topic (request/reply over topics, correlated by (request_id, attempt)), awaits the second decision
  of a queued request, publishes Completions;
* `ProviderPublisher` — a provider agent: registration, sequenced heartbeats, disconnect;
* `ConfigPublisher` / `publish_config` — an operator: ConfigChange patches;
* `read_decisions` — decisions as they appear on a topic (for `streams.cli tail`).

Every topic name takes the deployment's prefix (`SWITCHYARD_TOPIC_PREFIX` of the worker).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import AsyncIterator, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from . import codec
from .config import PREFIX as SETTING_PREFIX, Config
from .kafka_security import KafkaSecurity
from .reply_to import reply_to_problem

log = logging.getLogger(__name__)

REQUESTS = "switchyard.requests"
DECISIONS = "switchyard.decisions"
COMPLETIONS = "switchyard.completions"
PROVIDERS = "switchyard.providers"
CONFIG = "switchyard.config"
DOMAIN_KEY = b"default"  # the one routing domain's key on the config topic

Key = tuple[str, int]


def wall_ms() -> int:
    return int(time.time() * 1000)


def auth(security: KafkaSecurity | None) -> dict:
    """aiokafka's keyword arguments for `security` (docs/security.md); none: PLAINTEXT. Every
    client here takes ``security=``; the command lines pass `KafkaSecurity.from_env()`."""
    return security.aiokafka_kwargs() if security is not None else {}


def make_producer(bootstrap: str, security: KafkaSecurity | None = None) -> AIOKafkaProducer:
    """An unstarted producer as every client here uses it (share one among many ProviderPublishers)."""
    # acks=all: a request the gateway believes sent is on every in-sync replica. linger 0: no
    # batching delay in front of a waiting caller.
    return AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0,
                            client_id="switchyard-client", **auth(security))


async def ensure_topics(bootstrap: str, topics: Iterable[str], *, partitions: int = 1,
                        replication_factor: int = 1, security: KafkaSecurity | None = None) -> None:
    """Create the topics that do not exist yet (an existing one is left as it is)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **auth(security))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in dict.fromkeys(topics) if t not in existing]
        if missing:
            await admin.create_topics([NewTopic(t, partitions, replication_factor) for t in missing])
            log.info("created topics %s", missing)
    finally:
        await admin.close()


async def _partitions(consumer: AIOKafkaConsumer, topic: str, timeout: float = 15.0) -> list[TopicPartition]:
    deadline = time.monotonic() + timeout
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic!r} has no partitions after {timeout:.0f}s")
        await consumer._client.force_metadata_update()  # no public call refreshes one topic
        await asyncio.sleep(0.1)


# === gateway ======================================================================================
class GatewayClient:
    """A gateway's request/reply client.

    ``async with GatewayClient(bootstrap, topic_prefix=p) as gw: decision = await gw.route({...}, 5)``

    Replies are read from the END of the reply topic (default ``<prefix>switchyard.decisions``; pass
    a private one such as ``<prefix>switchyard.replies.<uuid>`` and it is created if missing) with no
    consumer group: partitions are assigned and positioned before the first request goes out, so no
    reply to this client can be missed and none from before it started is read. One background task
    consumes and completes a future per (request_id, attempt).

    A queued request (outcome ``queued``, 202) gets a second decision later; ``follow_up`` awaits it.
    A follow-up that arrives before anyone awaits it is kept (the oldest dropped beyond
    ``max_unclaimed``). Every decision of a request, its queue follow-up included, goes to the
    request's own reply topic; ``listen_default`` also reads the default topic (for a gateway
    watching decisions it did not request itself).
    """

    def __init__(self, bootstrap: str, *, topic_prefix: str = "", reply_topic: str | None = None,
                 max_unclaimed: int = 10_000, max_tracked: int = 200_000, listen_default: bool = False,
                 create_replication_factor: int = 1, security: KafkaSecurity | None = None):
        self.bootstrap = bootstrap
        self.security = security
        self.prefix = topic_prefix
        self.requests_topic = topic_prefix + REQUESTS
        self.completions_topic = topic_prefix + COMPLETIONS
        self.default_reply_topic = topic_prefix + DECISIONS
        self.reply_topic = reply_topic or self.default_reply_topic
        problem = reply_to_problem(self.reply_topic, topic_prefix)
        if problem:  # the worker would dead-letter every request naming it
            raise ValueError(f"reply_topic: {problem}")
        self._listen = [self.reply_topic]
        if listen_default and self.reply_topic != self.default_reply_topic:
            self._listen.append(self.default_reply_topic)
        self._replication = create_replication_factor
        self._max_unclaimed = max_unclaimed
        self._max_tracked = max_tracked
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self._first: dict[Key, asyncio.Future] = {}    # awaiting the first decision
        self._follow: dict[Key, asyncio.Future] = {}   # awaiting a queued request's second decision
        self._unclaimed: OrderedDict[Key, dict] = OrderedDict()  # decisions nobody awaits yet
        self._sent: OrderedDict[Key, None] = OrderedDict()       # identities this client sent
        self._abandoned: OrderedDict[Key, None] = OrderedDict()  # timed out or cancelled, then cancelled
        self._cancels: set[asyncio.Task] = set()                 # those cancels, being sent
        self._failure: BaseException | None = None
        self.stats = {"decisions_received": 0, "decisions_ignored": 0, "unclaimed_dropped": 0,
                      "undecodable": 0, "late_after_cancel": 0}

    # --- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> "GatewayClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        self._failure = None  # a failed reply consumer is replaced by this start's
        await ensure_topics(self.bootstrap, self._listen, replication_factor=self._replication,
                            security=self.security)
        self._producer = make_producer(self.bootstrap, self.security)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
            auto_offset_reset="latest", fetch_max_wait_ms=100, client_id="switchyard-gateway",
            **auth(self.security))
        try:
            await self._producer.start()
            await self._consumer.start()
            tps = []
            for topic in self._listen:
                tps += await _partitions(self._consumer, topic)
            self._consumer.assign(tps)
            await self._consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the end offsets now, before any request is sent
                await self._consumer.position(tp)
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._consume(), name="gateway-replies")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
            self._task = None
        for fut in (*self._first.values(), *self._follow.values()):
            if not fut.done():  # an error, not a cancellation: nobody cancelled the callers
                fut.set_exception(ConnectionError("GatewayClient stopped"))
        if self._cancels:
            await asyncio.wait(list(self._cancels), timeout=5)
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    # --- requests ------------------------------------------------------------------------------------
    def fill_request(self, request: Mapping) -> dict:
        """The request with this client's defaults: request_id (uuid4), attempt 0, sent_at_ms now,
        reply_to this client's reply topic."""
        req = dict(request)
        if not req.get("request_id"):
            req["request_id"] = uuid.uuid4().hex
        req.setdefault("attempt", 0)
        if not req.get("sent_at_ms"):
            req["sent_at_ms"] = wall_ms()
        if not req.get("reply_to"):
            req["reply_to"] = self.reply_topic
        return req

    async def route(self, request: Mapping, timeout: float = 10.0, *, cancel_abandoned: bool = True) -> dict:
        """Publish a RouteRequest and return its RouteDecision (a ``queued`` one as is).
        Raises ``asyncio.TimeoutError`` when no decision comes within ``timeout`` seconds.

        A request given up on (the timeout, or the caller cancelled) may still be decided later,
        and a routed decision holds a reservation until a Completion releases it. So the client
        then publishes a ``cancel`` for it (best effort; ``cancel_abandoned=False`` leaves that to
        the caller) and drops its late decision. A new try is a new attempt: the same
        (request_id, attempt) again raises ValueError."""
        self._check()
        req = self.fill_request(request)
        key = (req["request_id"], req["attempt"])
        if key in self._first:
            raise ValueError(f"request {key} is already awaiting its decision")
        if key in self._abandoned:
            raise ValueError(f"request {key} was given up on and cancelled: try again as attempt {key[1] + 1}")
        problem = req["reply_to"] != self.reply_topic and reply_to_problem(req["reply_to"], self.prefix)
        if problem:  # fails before anything is sent, as the worker would refuse it (this client's
            raise ValueError(f"reply_to: {problem}")  # own reply topic was checked when it was built)
        value = codec.encode("RouteRequest", req)  # fails before anything is sent
        fut = asyncio.get_running_loop().create_future()
        self._first[key] = fut  # registered before sending: a fast reply cannot slip past
        self._track(key)
        try:
            async with asyncio.timeout(timeout):
                await self._producer.send_and_wait(self.requests_topic, key=key[0].encode(), value=value)
                return await fut
        except (TimeoutError, asyncio.CancelledError):
            if cancel_abandoned and (fut.cancelled() or not fut.done()):  # no decision (the wait is
                self._abandon(key)                                           # cancelled with its task)
            raise
        finally:
            if self._first.get(key) is fut:
                del self._first[key]

    def _abandon(self, key: Key) -> None:
        """Cancel a request nobody waits for any more, in the background (its caller may be
        being cancelled itself); `stop` waits for these sends."""
        self._track(key, self._abandoned)
        self._unclaimed.pop(key, None)
        task = asyncio.ensure_future(self.cancel(*key))
        self._cancels.add(task)
        task.add_done_callback(self._cancel_sent)

    def _cancel_sent(self, task: asyncio.Task) -> None:
        self._cancels.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not cancel an abandoned request: %r", task.exception())

    async def follow_up(self, request_id: str, attempt: int = 0, timeout: float = 60.0) -> dict:
        """The second decision of a queued request: routed from the queue, or rejected
        (queue_timeout). Raises ``asyncio.TimeoutError`` when it does not come in time."""
        self._check()
        key = (request_id, attempt)
        early = self._unclaimed.get(key)
        if early is not None and early["outcome"] != "queued":
            del self._unclaimed[key]
            return early
        if key in self._follow:
            raise ValueError(f"request {key} already has a follow-up waiter")
        fut = asyncio.get_running_loop().create_future()
        self._follow[key] = fut
        self._track(key)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            if self._follow.get(key) is fut:
                del self._follow[key]

    async def complete(self, completion: Mapping) -> dict:
        """Publish a Completion (keyed by provider_id). Fills event_id, attempt 0, status "ok",
        completed_at_ms now. Returns the record sent."""
        self._check()
        rec = dict(completion)
        rec.setdefault("event_id", uuid.uuid4().hex)
        rec.setdefault("attempt", 0)
        rec.setdefault("status", "ok")
        if not rec.get("completed_at_ms"):
            rec["completed_at_ms"] = wall_ms()
        key = (rec.get("provider_id") or rec.get("request_id") or "").encode()
        await self._producer.send_and_wait(self.completions_topic, key=key,
                                           value=codec.encode("Completion", rec))
        return rec

    async def cancel(self, request_id: str, attempt: int = 0, provider_id: str = "") -> dict:
        """A Completion with status ``cancelled``: releases a reservation, or takes a queued
        request out of the queue without a second decision."""
        return await self.complete({"request_id": request_id, "attempt": attempt,
                                    "provider_id": provider_id, "status": "cancelled"})

    @property
    def pending(self) -> int:
        return len(self._first) + len(self._follow)

    # --- the reply loop ------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._producer is None:
            raise RuntimeError("GatewayClient not started (use `async with`)")
        if self._failure is not None:
            raise RuntimeError("the reply consumer failed") from self._failure

    def _track(self, key: Key, keys: OrderedDict | None = None) -> None:
        """Remember `key` in `keys` (default: the identities sent), the newest `max_tracked`."""
        keys = self._sent if keys is None else keys
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self._max_tracked:
            keys.popitem(last=False)

    async def _consume(self) -> None:
        try:
            while True:
                batches = await self._consumer.getmany(timeout_ms=500, max_records=1000)
                for records in batches.values():
                    for record in records:
                        self._on_record(record.value)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - fail every waiter rather than hang them
            log.exception("gateway reply consumer failed")
            self._failure = e
            for fut in (*self._first.values(), *self._follow.values()):
                if not fut.done():
                    fut.set_exception(RuntimeError(f"reply consumer failed: {e!r}"))

    def _on_record(self, value: bytes) -> None:
        try:
            name, decision = codec.decode_as(value, "RouteDecision")
        except codec.CodecError:
            self.stats["undecodable"] += 1
            return
        key = (decision["request_id"], decision["attempt"])
        queued = decision["outcome"] == "queued"
        fut = None if queued else self._follow.get(key)  # a (re-sent) queued one is no follow-up
        if fut is None or fut.done():
            fut = self._first.get(key)
        if fut is not None and not fut.done():
            self.stats["decisions_received"] += 1
            fut.set_result(decision)
            return
        if key not in self._sent:  # another gateway's request on a shared topic
            self.stats["decisions_ignored"] += 1
            return
        if key in self._abandoned:
            self.stats["late_after_cancel"] += 1
            return
        # Ours, but nobody waits: a queue follow-up before `follow_up` is called, or a late reply.
        self.stats["decisions_received"] += 1
        if queued and key in self._unclaimed:  # keep the final decision, not a re-sent queued one
            return
        self._unclaimed[key] = decision
        self._unclaimed.move_to_end(key)
        while len(self._unclaimed) > self._max_unclaimed:
            self._unclaimed.popitem(last=False)
            self.stats["unclaimed_dropped"] += 1


# === provider agent ===============================================================================
class ProviderPublisher:
    """One provider session's events on ``<prefix>switchyard.providers``, keyed by provider_id.

    ``register`` starts a session (heartbeat seq restarts at 1); ``heartbeat`` fills seq, sent_at_ms
    and a unique event_id; ``disconnect`` ends the session. Pass ``producer`` to share one producer
    among many providers (it is then neither started nor stopped here).
    """

    def __init__(self, bootstrap: str, provider_id: str, *, topic_prefix: str = "",
                 producer: AIOKafkaProducer | None = None, security: KafkaSecurity | None = None):
        self.bootstrap = bootstrap
        self.security = security
        self.provider_id = provider_id
        self.topic = topic_prefix + PROVIDERS
        self._producer = producer
        self._own = producer is None
        self.seq = 0

    async def __aenter__(self) -> "ProviderPublisher":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._own and self._producer is None:
            self._producer = make_producer(self.bootstrap, self.security)
            await self._producer.start()

    async def stop(self) -> None:
        if self._own and self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _send(self, name: str, record: dict) -> dict:
        if self._producer is None:
            raise RuntimeError("ProviderPublisher not started (use `async with`)")
        await self._producer.send_and_wait(self.topic, key=self.provider_id.encode(),
                                           value=codec.encode(name, record))
        return record

    async def register(self, record: Mapping) -> dict:
        rec = dict(record, provider_id=self.provider_id)
        rec.setdefault("event_id", uuid.uuid4().hex)
        if not rec.get("registered_at_ms"):
            rec["registered_at_ms"] = wall_ms()
        self.seq = 0
        return await self._send("ProviderRegistered", rec)

    async def heartbeat(self, record: Mapping) -> dict:
        self.seq += 1
        rec = dict(record, provider_id=self.provider_id, seq=self.seq, sent_at_ms=wall_ms())
        rec.setdefault("event_id", uuid.uuid4().hex)
        return await self._send("Heartbeat", rec)

    async def disconnect(self, reason: str = "shutdown") -> dict:
        return await self._send("ProviderDisconnected", {
            "event_id": uuid.uuid4().hex, "provider_id": self.provider_id, "at_ms": wall_ms(),
            "reason": reason})


# === operator =====================================================================================
def normalise_settings(settings: Mapping[str, str]) -> dict[str, str]:
    """Settings with the ``EIGENINFERENCE_`` prefix added where missing, checked by the same parser
    the router uses (unknown names and unparsable values raise ``ConfigError``)."""
    out = {}
    for name, value in settings.items():
        full = name if name.startswith(SETTING_PREFIX) else SETTING_PREFIX + name
        out[full] = str(value)
    Config().patched(out)  # raises ConfigError, as the router would refuse the whole change
    return out


class ConfigPublisher:
    """ConfigChange patches on ``<prefix>switchyard.config`` (key "default", the one routing domain).
    A patch replaces the settings it names, "" resets one to its default, others stay (rules §3)."""

    def __init__(self, bootstrap: str, *, topic_prefix: str = "", security: KafkaSecurity | None = None):
        self.bootstrap = bootstrap
        self.security = security
        self.topic = topic_prefix + CONFIG
        self._producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> "ConfigPublisher":
        self._producer = make_producer(self.bootstrap, self.security)
        await self._producer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def publish(self, settings: Mapping[str, str], *, author: str = "") -> dict:
        if self._producer is None:
            raise RuntimeError("ConfigPublisher not started (use `async with`)")
        patch = normalise_settings(settings)
        # config_id names a full configuration; a patch's result depends on what was recorded
        # before it, which only the router knows, so the router's decisions carry the real id.
        record = {"config_id": "", "settings": patch, "changed_at_ms": wall_ms(), "author": author}
        await self._producer.send_and_wait(self.topic, key=DOMAIN_KEY,
                                           value=codec.encode("ConfigChange", record))
        return record


async def publish_config(bootstrap: str, settings: Mapping[str, str], *, topic_prefix: str = "",
                         author: str = "", security: KafkaSecurity | None = None) -> dict:
    """Publish one ConfigChange patch; returns the record sent."""
    async with ConfigPublisher(bootstrap, topic_prefix=topic_prefix, security=security) as pub:
        return await pub.publish(settings, author=author)


# === reading decisions ============================================================================
async def read_decisions(bootstrap: str, topic: str, *, from_beginning: bool = False,
                         limit: int | None = None, idle_timeout: float | None = None,
                         security: KafkaSecurity | None = None) -> AsyncIterator[dict]:
    """Yield the RouteDecisions appearing on ``topic`` (from its start, or only new ones), until
    ``limit`` were yielded or nothing arrived for ``idle_timeout`` seconds (None: forever)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=200, client_id="switchyard-tail", **auth(security))
    await consumer.start()
    try:
        tps = await _partitions(consumer, topic)
        consumer.assign(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
        count, idle_since = 0, time.monotonic()
        while limit is None or count < limit:
            batches = await consumer.getmany(timeout_ms=250, max_records=500)
            if not batches:
                if idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                    return
                continue
            idle_since = time.monotonic()
            for records in batches.values():
                for record in records:
                    try:
                        _, decision = codec.decode_as(record.value, "RouteDecision")
                    except codec.CodecError as e:
                        decision = {"undecodable": e.reason, "offset": record.offset}
                    yield decision
                    count += 1
                    if limit is not None and count >= limit:
                        return
    finally:
        await consumer.stop()
