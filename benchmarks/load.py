"""The load of `benchmarks.pipeline_latency`: the request driver and the fleet child, each on one
of two Kafka clients (``--load-client``).

* ``librdkafka`` (confluent-kafka; the default): one thread producing, consuming and polling, the
  protocol in C. The load generators share the two cores with the system under test, and on
  aiokafka they took 0.6-0.9 of them at 1000 requests/s (docs/benchmarks.md, "ninth"): the
  measurement itself was a good part of the machine's saturation. A real fleet's gateways and
  providers are other machines.
* ``aiokafka``: asyncio + aiokafka, as every run before "ninth".

Both speak the same settings as the baselines (acks=all, linger 0, Nagle off, fetch wait 100 ms)
and do the same work per message (Avro encode of each request, heartbeat and completion; decode of
each reply). The systems under test (the echo and pipeline baselines, the worker) are aiokafka
whatever the load's client.

`Phase` is one open-loop phase of the driver: which request goes when, when each reply came back,
and the figures. `Fleet` is the fleet child's schedule: heartbeats of every provider, spread evenly
over the interval, and a Completion ``hold_ms`` after each routed reply.
"""
from __future__ import annotations

import asyncio
import gc
import json
import random
import signal
import time
import uuid
import zlib
from collections import Counter, deque

from benchmarks.echo_baselines import (CONSUMER_SETTINGS, PRODUCER_SETTINGS, rdkafka_consumer, rdkafka_producer,
                                       rdkafka_take, run_until_stopped)
from benchmarks.fleet import heartbeat, model_names, request
from streams import codec

CLIENTS = ("librdkafka", "aiokafka")


def wall_ms() -> int:
    return int(time.time() * 1000)


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a non-empty list; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def r3(v):
    return None if v is None else round(v, 3)


def _rdkafka_consumer_at_end(bootstrap: str, client_id: str, topic: str):
    """A consumer of partition 0 of `topic` from its current end (resolved now, not lazily, so
    nothing produced after this returns is skipped)."""
    from confluent_kafka import TopicPartition

    consumer = rdkafka_consumer(bootstrap, client_id)
    _, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
    consumer.assign([TopicPartition(topic, 0, end)])
    return consumer


async def _aiokafka_started(bootstrap: str, client_id: str, topic: str):
    """A started producer, and a started consumer of partition 0 of `topic` from its current end."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, **PRODUCER_SETTINGS)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id=client_id + "-replies", **CONSUMER_SETTINGS)
    await producer.start()
    await consumer.start()
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    return producer, consumer


# === the driver ====================================================================================
class Phase:
    """One open-loop phase: `rate` requests/s for warmup + seconds, each a RouteRequest (a random
    model, key = request_id, reply_to = the reply topic)."""

    def __init__(self, system: str, rate: float, warmup: float, seconds: float, models: list[str],
                 seed: int, reply_topic: str):
        self.system, self.rate, self.models, self.reply_topic = system, rate, models, reply_topic
        self.rng = random.Random(seed)
        self.period = 1.0 / rate
        self.n_warm = int(round(rate * warmup))
        self.n_total = n = self.n_warm + int(round(rate * seconds))
        tag = f"{system}-{int(rate)}-{uuid.uuid4().hex[:6]}"
        self.rids = [f"{tag}-{i}" for i in range(n)]
        self.keys = [rid.encode() for rid in self.rids]
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.send_perf, self.send_wall, self.lag = [0.0] * n, [0.0] * n, [0.0] * n
        self.recv_perf: list = [None] * n
        self.recv_wall: list = [None] * n
        self.reply_ts: list = [None] * n
        self.outcome: list = [None] * n
        self.extra_replies = 0
        self.received = 0

    def value(self, i: int, t0: float) -> bytes:
        """Request i, encoded; its send is timestamped (call it just before sending)."""
        req = request(self.rids[i], self.models[self.rng.randrange(len(self.models))], wall_ms())
        req["max_tokens"] = 256
        req["reply_to"] = self.reply_topic
        value = codec.encode("RouteRequest", req)
        self.send_wall[i] = time.time()
        self.send_perf[i] = ts = time.perf_counter()
        self.lag[i] = ts - (t0 + i * self.period)
        return value

    def due(self, t0: float, now: float) -> int:
        """How many requests should have been sent by `now`."""
        return min(self.n_total, int((now - t0) / self.period) + 1) if now >= t0 else 0

    def reply(self, key: bytes | None, value: bytes | None, timestamp: int, t: float, tw: float) -> None:
        i = self.index.pop(key, None)
        if i is None:  # a queue follow-up (second decision) or a stranger
            self.extra_replies += 1
            return
        self.recv_perf[i], self.recv_wall[i], self.reply_ts[i] = t, tw, timestamp
        try:
            name, rec = codec.decode(value)
            self.outcome[i] = rec.get("outcome") if name == "RouteDecision" else name
        except codec.CodecError as e:
            self.outcome[i] = "undecodable:" + e.reason
        self.received += 1

    def result(self) -> tuple[dict, dict]:
        n_warm, n_total = self.n_warm, self.n_total
        send_perf, recv_perf = self.send_perf, self.recv_perf
        measured = range(n_warm, n_total)
        lat = [(recv_perf[j] - send_perf[j]) * 1000 for j in measured if recv_perf[j] is not None]
        span = send_perf[n_total - 1] - send_perf[n_warm] if n_total - n_warm > 1 else 0.0
        out_counts = Counter(self.outcome[j] for j in measured if self.outcome[j] is not None)
        result = {
            "system": self.system, "rate": self.rate, "requests": len(measured), "replies": len(lat),
            "lost": len(measured) - len(lat),
            "achieved_rate": round((len(measured) - 1) / span, 1) if span else None,
            "p50_ms": r3(pct(lat, 50)), "p90_ms": r3(pct(lat, 90)), "p99_ms": r3(pct(lat, 99)),
            "max_ms": r3(max(lat) if lat else None), "mean_ms": r3(mean(lat)),
            "send_lag_p99_ms": r3(pct([self.lag[j] * 1000 for j in measured], 99)),
            "send_lag_max_ms": r3(max(self.lag[j] * 1000 for j in measured)),
            "outcomes": dict(out_counts), "extra_replies": self.extra_replies,
            "timeline_p50_ms": timeline(send_perf, recv_perf, n_warm, n_total),
        }
        arrays = {"rids": self.rids, "n_warm": n_warm, "send_wall": self.send_wall,
                  "recv_wall": self.recv_wall, "reply_ts": self.reply_ts}
        return result, arrays


def timeline(send_perf: list, recv_perf: list, n_warm: int, n_total: int) -> list:
    """p50 latency (ms) of the requests sent in each second of the measurement (None: no reply)."""
    if n_total <= n_warm:
        return []
    t0 = send_perf[n_warm]
    buckets: dict[int, list] = {}
    for j in range(n_warm, n_total):
        b = buckets.setdefault(int(send_perf[j] - t0), [])
        if recv_perf[j] is not None:
            b.append((recv_perf[j] - send_perf[j]) * 1000)
    return [round(pct(buckets[k], 50), 1) if buckets[k] else None for k in sorted(buckets)]


def drive(client: str, bootstrap: str, system: str, requests_topic: str, reply_topic: str, rate: float,
          warmup: float, seconds: float, models: list[str], seed: int, drain: float) -> tuple[dict, dict]:
    """One open-loop phase on `client`; returns the measured figures and per-request arrays (for the
    journal breakdown). Latency = receipt − send, both in the driver: the send is timestamped just
    before the client's send call, the receipt once per fetched batch, before decoding."""
    phase = Phase(system, rate, warmup, seconds, models, seed, reply_topic)
    if client == "librdkafka":
        _drive_librdkafka(phase, bootstrap, requests_topic, drain)
    else:
        asyncio.run(_drive_aiokafka(phase, bootstrap, requests_topic, drain))
    return phase.result()


def _drive_librdkafka(phase: Phase, bootstrap: str, requests_topic: str, drain: float) -> None:
    producer = rdkafka_producer(bootstrap, "bench-driver")
    consumer = _rdkafka_consumer_at_end(bootstrap, "bench-driver-replies", phase.reply_topic)

    def receive(timeout: float) -> None:
        messages = rdkafka_take(consumer, timeout)
        if messages:
            t, tw = time.perf_counter(), time.time()
            for m in messages:
                if m.error() is None:
                    phase.reply(m.key(), m.value(), m.timestamp()[1], t, tw)

    try:
        gc.collect()
        t0 = time.perf_counter() + 0.05
        i = 0
        while i < phase.n_total:
            due = phase.due(t0, time.perf_counter())
            while i < due:
                producer.produce(requests_topic, phase.value(i, t0), phase.keys[i])
                i += 1
            producer.poll(0)  # delivery reports
            # until the next send: replies (librdkafka's timeouts are whole ms; never a busy loop)
            receive(max(0.001, t0 + i * phase.period - time.perf_counter()))
        producer.flush(10)
        deadline = time.perf_counter() + drain
        while phase.received < phase.n_total and time.perf_counter() < deadline:
            receive(0.1)
    finally:
        consumer.close()


async def _drive_aiokafka(phase: Phase, bootstrap: str, requests_topic: str, drain: float) -> None:
    producer, consumer = await _aiokafka_started(bootstrap, "bench-driver", phase.reply_topic)
    all_in = asyncio.Event()

    async def receive() -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=5000)
            t, tw = time.perf_counter(), time.time()
            for records in batches.values():
                for r in records:
                    phase.reply(r.key, r.value, r.timestamp, t, tw)
            if phase.received == phase.n_total:
                all_in.set()

    receiver = asyncio.create_task(receive())
    gc.collect()
    t0 = time.perf_counter() + 0.05
    i = 0
    try:
        while i < phase.n_total:
            due = phase.due(t0, time.perf_counter())
            while i < due:
                await producer.send(requests_topic, value=phase.value(i, t0), key=phase.keys[i])
                i += 1
            await asyncio.sleep(max(0.0, t0 + i * phase.period - time.perf_counter()))
        await producer.flush()
        try:
            await asyncio.wait_for(all_in.wait(), drain)
        except asyncio.TimeoutError:
            pass
    finally:
        receiver.cancel()
        try:
            await receiver
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        await consumer.stop()
        await producer.stop()


# === the fleet child ===============================================================================
class Fleet:
    """Heartbeat every provider every `interval` s, evenly spread; a Completion `hold_ms` after each
    routed decision on the reply topic (for a baseline, after each reply: the echoed request; a
    provider of its model completes it)."""

    def __init__(self, args):
        names = model_names(args.models)
        self.providers = [(f"p{i:05d}", i, [names[(i + j) % args.models] for j in range(args.per_box)])
                          for i in range(args.providers)]
        self.by_model: dict[str, list[str]] = {}
        for pid, _, mine in self.providers:
            for m in mine:
                self.by_model.setdefault(m, []).append(pid)
        self.providers_topic = args.prefix + "switchyard.providers"
        self.completions_topic = args.prefix + "switchyard.completions"
        self.period = args.interval / len(self.providers)
        self.hold_s = args.hold_ms / 1000
        self.k = 0                                     # heartbeats sent
        self.pending: deque = deque()                  # (due perf time, Completion), in due order
        self.stats = Counter()

    def heartbeat(self) -> tuple[bytes, bytes]:
        """The next heartbeat: (key, value)."""
        pid, i, mine = self.providers[self.k % len(self.providers)]
        cycle = self.k // len(self.providers)
        # seq from the wall clock: increasing across pauses and child restarts
        hb = heartbeat(pid, i, mine, wall_ms(), wall_ms(), shift=cycle + 1)
        hb["event_id"] = uuid.uuid4().hex
        self.k += 1
        self.stats["heartbeats"] += 1
        return pid.encode(), codec.encode("Heartbeat", hb)

    def reply(self, key: bytes | None, value: bytes | None, due: float) -> None:
        try:
            name, d = codec.decode(value)
        except codec.CodecError:
            return
        if name == "RouteRequest":  # a baseline's reply (the request, echoed)
            self.stats["decision_echoed"] += 1
            serving = self.by_model[d["model"]]
            d["provider_id"] = serving[zlib.crc32(key or b"") % len(serving)]
        elif name == "RouteDecision":
            self.stats["decision_" + d["outcome"]] += 1
            if d["outcome"] != "routed":
                return
        else:
            return
        self.pending.append((due, {
            "event_id": uuid.uuid4().hex, "request_id": d["request_id"], "attempt": d["attempt"],
            "provider_id": d["provider_id"], "model": d["model"], "status": "ok", "prompt_tokens": 1200,
            "completion_tokens": 64, "ttft_ms": 0.0, "completed_at_ms": 0}))

    def completions_due(self, now: float):
        """(key, value) of each Completion due by `now`."""
        while self.pending and self.pending[0][0] <= now:
            _, c = self.pending.popleft()
            c["completed_at_ms"] = wall_ms()
            self.stats["completions"] += 1
            yield c["provider_id"].encode(), codec.encode("Completion", c)


def fleet_main(args) -> None:
    """The fleet child: SIGUSR1 pauses the heartbeats, SIGUSR2 resumes them; SIGTERM stops it, and it
    prints its counters as a JSON line."""
    fleet = Fleet(args)
    if args.client == "librdkafka":
        _fleet_librdkafka(fleet, args)
    else:
        asyncio.run(_fleet_aiokafka(fleet, args))


def _fleet_librdkafka(fleet: Fleet, args) -> None:
    producer = rdkafka_producer(args.bootstrap, "bench-fleet")
    consumer = _rdkafka_consumer_at_end(args.bootstrap, "bench-fleet-replies", args.replies)
    state = {"active": not args.paused, "stop": False, "t0": 0.0, "k0": 0}

    def resume(*_):
        if not state["active"]:
            state["active"], state["t0"], state["k0"] = True, time.perf_counter(), fleet.k

    def pause(*_):
        state["active"] = False

    signal.signal(signal.SIGUSR1, pause)
    signal.signal(signal.SIGUSR2, resume)
    signal.signal(signal.SIGTERM, lambda *_: state.update(stop=True))
    signal.signal(signal.SIGINT, lambda *_: state.update(stop=True))
    if state["active"]:
        state["t0"] = time.perf_counter()
    print("READY", flush=True)
    try:
        while not state["stop"]:
            now = time.perf_counter()
            wait = 0.005
            if state["active"]:
                t0, k0 = state["t0"], state["k0"]
                due = k0 + int((now - t0) / fleet.period) + 1
                while fleet.k < due:
                    key, value = fleet.heartbeat()
                    producer.produce(fleet.providers_topic, value, key)
                wait = min(wait, t0 + (fleet.k - k0) * fleet.period - now)
            for key, value in fleet.completions_due(now):
                producer.produce(fleet.completions_topic, value, key)
            if fleet.pending:
                wait = min(wait, fleet.pending[0][0] - now)
            producer.poll(0)  # delivery reports
            messages = rdkafka_take(consumer, max(0.001, wait))
            if messages:
                due_at = time.perf_counter() + fleet.hold_s
                for m in messages:
                    if m.error() is None:
                        fleet.reply(m.key(), m.value(), due_at)
        producer.flush(5)
    finally:
        consumer.close()
        print(json.dumps(dict(fleet.stats)), flush=True)


async def _fleet_aiokafka(fleet: Fleet, args) -> None:
    producer, consumer = await _aiokafka_started(args.bootstrap, "bench-fleet", args.replies)
    active = asyncio.Event()
    if not args.paused:
        active.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, active.clear)
    loop.add_signal_handler(signal.SIGUSR2, active.set)

    async def heartbeats() -> None:
        while True:
            await active.wait()
            t0, k0 = time.perf_counter(), fleet.k
            while active.is_set():
                due = k0 + int((time.perf_counter() - t0) / fleet.period) + 1
                while fleet.k < due:
                    key, value = fleet.heartbeat()
                    await producer.send(fleet.providers_topic, value=value, key=key)
                await asyncio.sleep(max(0.0, t0 + (fleet.k - k0) * fleet.period - time.perf_counter()))

    async def decisions() -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=2000)
            due = time.perf_counter() + fleet.hold_s
            for records in batches.values():
                for r in records:
                    fleet.reply(r.key, r.value, due)

    async def completions() -> None:
        while True:
            for key, value in fleet.completions_due(time.perf_counter()):
                await producer.send(fleet.completions_topic, value=value, key=key)
            await asyncio.sleep(0.005)

    try:
        await run_until_stopped([heartbeats(), decisions(), completions()])
    finally:
        await consumer.stop()
        await producer.stop()
        print(json.dumps(dict(fleet.stats)), flush=True)
