"""Hostile and malformed input through a real worker's ingest: at least 100,000 generated messages
produced as raw bytes to the four input topics — clean fleet traffic, hostile-but-decodable events
(NaN and Inf, negative and huge numbers, absurd KV rates, thousands of slots, unknown models, empty
versions, replayed old sequence numbers, exact duplicates), keys that do not match the provider id,
record types a topic does not carry, requests naming reply topics the worker may not write (its own
topics, other deployments' topics, illegal names), and undecodable bytes (bad magic, unknown schema ids,
truncated frames, trailing bytes, garbage bodies, empty values and null tombstones).

One worker ingests them all (a module fixture); the tests then check that the worker is alive and
still routes, every refused message is in the dead-letter topic with its reason (counts by topic and
reason equal what was generated, original bytes included), every accepted message is in the journal
byte for byte, the /metrics counters agree, the core state the worker saved is within its bounds and
equals a replay of the journal, every decision replays, and every event the core itself refuses is
dead-lettered too. The ingest throughput is measured and reported.

    pytest -m slow tests/faults/test_ingest_fuzz.py -s      # SWITCHYARD_FUZZ_MESSAGES=100000 (default)
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import pytest
from aiokafka import AIOKafkaProducer

from replay.run import replay
from streams import codec
from streams.client import ensure_topics
from streams.worker_process import Worker
from tests.faults.support import (agent_crashes, audit, live_router, metric_by_labels, metric_sum, replayed_router,
                                  restart, same_state, wall_ms, write_report)
from tests.fuzz.test_core_fuzz import check_bounds, random_event
from tests.integration.kafka_io import read_topic, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(1200)]

MESSAGES = int(os.environ.get("SWITCHYARD_FUZZ_MESSAGES", "100000"))
SEED = 2026
TOPIC_OF = {"ProviderRegistered": "providers", "Heartbeat": "providers", "ProviderDisconnected": "providers",
            "RouteRequest": "requests", "Completion": "completions", "ConfigChange": "config"}
CARRIES = {"providers": set(codec.PROVIDER_TYPES), "requests": {"RouteRequest"},
           "completions": {"Completion"}, "config": {"ConfigChange"}}
INPUTS = tuple(CARRIES)
GOOD_PIDS = [f"good-{i}" for i in range(8)]
UNUSED_IDS = [0, 12, 999, 2**31, 2**32 - 1, 12345]  # schemas/ids.json uses 1..11


@dataclass
class Msg:
    topic: str              # short name: providers | requests | completions | config
    key: bytes | None
    value: bytes | None
    kind: str               # what the generator meant to make
    expect: str             # "accept", or the dead-letter reason


WORKER_OWNED = ("providers", "requests", "completions", "config", "journal", "lease", "reservations", "capacity",
                "deadletter")


def expected(topic: str, key: bytes | None, value: bytes | None, prefix: str) -> str:
    """What ingest must do with a message (streams/service.py `checked`, stated independently)."""
    if value is None or value == b"":
        return "empty"
    try:
        name, record = codec.decode(value)
    except codec.CodecError as e:
        return e.reason
    if name not in CARRIES[topic]:
        return "unexpected_type"
    if topic == "providers" and (key is None or key.decode("utf-8", "replace") != (record.get("provider_id") or "")):
        return "key_mismatch"
    reply_to = record.get("reply_to") if name == "RouteRequest" else None
    if reply_to:  # a legal name under the deployment's topics, not the worker's own (this broker creates it)
        legal = re.fullmatch(r"[A-Za-z0-9._-]{1,249}", reply_to) and reply_to not in (".", "..")
        if not legal or not reply_to.startswith(prefix + "switchyard.") or \
                reply_to in {prefix + "switchyard." + t for t in WORKER_OWNED}:
            return "bad_reply_to"
    return "accept"


# Which reasons each deliberate corruption may produce (the generator's intent, checked against
# `expected` for every message, so the oracle cannot drift from what was generated).
INTENT = {
    "good": {"accept"}, "hostile": {"accept"}, "stale_seq": {"accept"}, "duplicate": {"accept"},
    "key_mismatch": {"key_mismatch"}, "wrong_type": {"unexpected_type"}, "bad_magic": {"bad_magic"},
    "unknown_schema_id": {"unknown_schema_id"}, "truncated": {"truncated", "malformed_avro"},
    "trailing": {"trailing_bytes"}, "empty": {"empty"}, "tombstone": {"empty"},
    "garbage_body": {"accept", "truncated", "malformed_avro", "trailing_bytes", "unexpected_type",
                     "key_mismatch"},
    "reply_to": {"accept", "bad_reply_to"},
}
WEIGHTS = {"good": 15, "hostile": 35, "stale_seq": 3, "duplicate": 3, "key_mismatch": 5, "wrong_type": 5,
           "bad_magic": 7, "unknown_schema_id": 6, "truncated": 7, "trailing": 5, "garbage_body": 6,
           "empty": 1.5, "tombstone": 1.5, "reply_to": 3}


def good_event(rng: random.Random, seqs: dict, n: int) -> tuple[str, str, dict]:
    pid = rng.choice(GOOD_PIDS)
    roll = rng.random()
    if pid not in seqs or roll < 0.01:
        seqs[pid] = 0
        return "providers", "ProviderRegistered", {
            "event_id": f"reg-{pid}-{n}", "provider_id": pid, "registered_at_ms": wall_ms(), "version": "0.7.5",
            "trust_level": "hardware", "hardware": {"chip_name": "Apple M3 Max", "chip_family": "M3",
            "chip_tier": "Max", "memory_gb": 64.0, "memory_bandwidth_gbs": 400.0, "gpu_cores": 40},
            "decode_tps": 50.0, "models": [{"id": "gpt-oss-20b", "size_bytes": 12_000_000_000}]}
    if roll < 0.6:
        seqs[pid] += 1
        return "providers", "Heartbeat", {
            "event_id": f"hb-{pid}-{n}", "provider_id": pid, "seq": seqs[pid], "sent_at_ms": wall_ms(),
            "status": "idle", "warm_models": ["gpt-oss-20b"],
            "system_metrics": {"memory_pressure": 0.2, "cpu_usage": 0.1, "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 13.0, "slots": [
                {"model": "gpt-oss-20b", "state": "running", "num_running": rng.randrange(3),
                 "observed_decode_tps": rng.uniform(20, 60), "kv_bytes_per_token": 49152}]}}
    if roll < 0.9:
        return "requests", "RouteRequest", {
            "request_id": f"g{n}", "attempt": 0, "model": "gpt-oss-20b", "prompt_tokens": rng.randrange(50, 4000),
            "max_tokens": 256, "sent_at_ms": wall_ms()}
    return "completions", "Completion", {
        "event_id": f"c{n}", "request_id": f"g{rng.randrange(max(1, n))}", "attempt": 0, "provider_id": pid,
        "model": "gpt-oss-20b", "status": "ok", "ttft_ms": rng.uniform(100, 3000), "completed_at_ms": wall_ms()}


def hostile_event(rng: random.Random) -> tuple[str, dict]:
    """The core fuzz's hostile shapes; a heartbeat keeps its thousands of slots only rarely (each
    such message is ~100 KB)."""
    while True:
        kind, record = random_event(rng)
        if kind in TOPIC_OF:
            break
    if kind == "Heartbeat" and record.get("backend_capacity") and len(record["backend_capacity"]["slots"]) > 3:
        if rng.random() < 0.97:
            record["backend_capacity"]["slots"] = record["backend_capacity"]["slots"][:3]
        elif rng.random() < 0.5:  # for a provider the good traffic registered: the core sees the slots
            record["provider_id"] = rng.choice(GOOD_PIDS)
    if kind == "ProviderRegistered" and rng.random() < 0.2:
        record["version"] = ""
    return kind, record


def generate(n: int, seed: int, prefix: str) -> list[Msg]:
    rng = random.Random(seed)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    seqs: dict[str, int] = {}
    accepted: list[Msg] = []
    out: list[Msg] = []
    while len(out) < n:
        kind = rng.choices(kinds, weights)[0]
        i = len(out)
        topic = rng.choice(INPUTS)
        if kind == "good":
            topic, name, record = good_event(rng, seqs, i)
            key = record.get("provider_id") or record.get("request_id") or ""
            value = codec.encode(name, record)
            key = key.encode()
        elif kind == "hostile":
            name, record = hostile_event(rng)
            topic = TOPIC_OF[name]
            key = (record.get("provider_id") or record.get("request_id") or "x").encode()
            value = codec.encode(name, record)
        elif kind == "stale_seq":
            pid = rng.choice([p for p in GOOD_PIDS if seqs.get(p, 0) > 2] or ["good-0"])
            topic, key = "providers", pid.encode()
            value = codec.encode("Heartbeat", {"event_id": f"old-{i}", "provider_id": pid,
                                               "seq": rng.randrange(1, max(2, seqs.get(pid, 1))),
                                               "sent_at_ms": wall_ms(), "status": "idle"})
        elif kind == "duplicate":
            if not accepted:
                continue
            old = rng.choice(accepted)
            topic, key, value = old.topic, old.key, old.value
        elif kind == "key_mismatch":
            name, record = hostile_event(rng)
            while TOPIC_OF[name] != "providers":
                name, record = hostile_event(rng)
            topic, value = "providers", codec.encode(name, record)
            key = rng.choice([None, b"", b"someone-else", (record["provider_id"] + "x").encode(), b"\xff\xfe"])
        elif kind == "wrong_type":
            name, record = rng.choice([("Tick", {"at_ms": rng.randrange(10**9)}),
                                       ("Reservation", {"request_id": "q", "provider_id": "a"}),
                                       ("DeadLetter", {"reason": "x", "original_value": b"\x00", "topic": "t",
                                                       "partition": 0, "offset": 1, "at_ms": 1}),
                                       ("RouteDecision", {"request_id": "q"}),
                                       ("ModelCapacity", {"model": "m"}),
                                       *[(k, r) for k, r in [hostile_event(rng)]]])
            topic = rng.choice([t for t in INPUTS if name not in CARRIES[t]])
            key = b"a"
            value = codec.encode(name, record)
        elif kind == "bad_magic":
            key = b"a"
            value = bytes([rng.randrange(1, 256)]) + rng.randbytes(rng.randrange(0, 200))
        elif kind == "unknown_schema_id":
            key = b"a"
            value = b"\x00" + struct.pack(">I", rng.choice(UNUSED_IDS)) + rng.randbytes(rng.randrange(0, 100))
        elif kind in ("truncated", "trailing", "garbage_body"):
            name, record = hostile_event(rng)
            topic = TOPIC_OF[name]
            key = (record.get("provider_id") or "x").encode()
            full = codec.encode(name, record)
            if kind == "truncated":
                value = full[:rng.randrange(1, len(full))]
            elif kind == "trailing":
                value = full + rng.randbytes(rng.randrange(1, 40))
            else:
                value = full[:5] + rng.randbytes(rng.randrange(0, 120))
        elif kind == "reply_to":
            topic, name, record = "requests", "RouteRequest", {
                "request_id": f"rt{i}", "model": "gpt-oss-20b", "prompt_tokens": 100, "sent_at_ms": wall_ms(),
                "reply_to": rng.choice([prefix + "switchyard.journal", prefix + "switchyard.lease",
                                        prefix + "switchyard.providers", "switchyard.decisions",
                                        "switchyard-fz-core-changelog", prefix + "switchyard.replies/x",
                                        prefix + "switchyard." + "r" * 300,
                                        prefix + "switchyard.decisions"])}  # (the audit reads that one)
            key, value = record["request_id"].encode(), codec.encode(name, record)
        elif kind == "empty":
            key, value = b"a", b""
        else:  # tombstone: a null value
            key, value = b"a", None
        msg = Msg(topic, key, value, kind, expected(topic, key, value, prefix))
        assert msg.expect in INTENT[kind], (kind, msg.expect, value[:40] if value else value)
        if msg.expect == "accept":
            accepted.append(msg)
        out.append(msg)
    return out


async def produce_all(bootstrap: str, prefix: str, messages: list[Msg]) -> None:
    # idempotent: a batch retried after a slow acknowledgement must not land twice (the test
    # counts every message)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, enable_idempotence=True,
                                max_batch_size=1 << 20, max_request_size=4 << 20)
    await producer.start()
    try:
        pending = []
        for m in messages:
            pending.append(await producer.send(prefix + "switchyard." + m.topic, key=m.key, value=m.value))
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def through_ingest(worker: Worker, inputs: list[str]) -> float:
    """Input messages the worker appended to the journal or dead-lettered. Only the input topics'
    dead letters count: the core's refusals are dead-lettered too (topic = the journal), and with
    them the sum reached the total while ingest still had a tail to do (three CI failures on
    2026-12-03). A graceful stop then flushes the producer, so every message is in the journal or
    the dead-letter topic when the tests read them."""
    total = 0.0
    for line in worker.metrics().splitlines():
        if line.startswith("switchyard_events_ingested_total{") or (
                line.startswith("switchyard_events_dead_lettered_total{")
                and any(f'topic="{t}"' in line for t in inputs)):
            total += float(line.split()[-1])
    return total


@pytest.fixture(scope="module")
def fuzzed(kafka_bootstrap, tmp_path_factory):
    """One worker, MESSAGES generated messages through its ingest; the measured figures."""
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"fz{tag}.", f"switchyard-fz{tag}"
    t_gen = time.monotonic()
    messages = generate(MESSAGES, SEED, prefix)
    gen_s = time.monotonic() - t_gen
    worker = Worker(kafka_bootstrap, tmp_path_factory.mktemp("fuzz") / "worker", app_id, prefix)
    worker.start()
    try:
        asyncio.run(ensure_topics(kafka_bootstrap, [prefix + "switchyard." + t for t in INPUTS]))
        t0 = time.monotonic()
        asyncio.run(produce_all(kafka_bootstrap, prefix, messages))
        produced_s = time.monotonic() - t0
        inputs = [prefix + "switchyard." + t for t in INPUTS]
        wait_for(lambda: not worker.running() or agent_crashes(worker) or through_ingest(worker, inputs) >= len(messages),
                 timeout=900, interval=1.0, what=f"{len(messages)} messages through ingest")
        assert worker.running(), f"the worker died under fuzz:\n{worker.tail()}"
        assert not agent_crashes(worker), f"an agent crashed under fuzz: {agent_crashes(worker)[:3]}"
        ingest_s = time.monotonic() - t0
        # The router applies the whole journal (the journal holds ingest's entries plus ticks and
        # the worker's recorded config, so wait until the applied count stops behind the end).
        accepted_n = sum(m.expect == "accept" for m in messages)
        wait_for(lambda: agent_crashes(worker) or metric_sum(worker, "switchyard_journal_entries_applied_total")
                 + metric_sum(worker, "switchyard_core_errors_total") >= accepted_n,
                 timeout=900, interval=0.5, what="the router to apply every accepted entry")
        assert not agent_crashes(worker), f"an agent crashed under fuzz: {agent_crashes(worker)[:3]}"
        applied_s = time.monotonic() - t0
        # Freeze the picture: the /metrics counters as they stand, then a graceful stop (no more
        # ticks, queue timeouts or changelog writes while the tests read the topics). The last test
        # starts the worker again.
        metrics_text = worker.metrics()
        worker.stop()
        state = {"bootstrap": kafka_bootstrap, "prefix": prefix, "app_id": app_id, "worker": worker,
                 "metrics": metrics_text, "messages": messages, "figures": {
                   "messages": len(messages), "generate_s": round(gen_s, 1), "produce_s": round(produced_s, 1),
                   "produce_msg_per_s": round(len(messages) / produced_s),
                   "ingest_s": round(ingest_s, 1), "ingest_msg_per_s": round(len(messages) / ingest_s),
                   "router_applied_s": round(applied_s, 1),
                   "router_entries_per_s": round(accepted_n / applied_s),
                   "kinds": dict(Counter(m.kind for m in messages)),
                   "expect": dict(Counter(m.expect for m in messages))}}
        yield state
        write_report("ingest_fuzz", state["figures"])
    finally:
        worker.stop()


def _labels(text: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in (part.split("=", 1) for part in text.strip("{}").split(","))}


def _dead_letters(bootstrap: str, prefix: str) -> list[dict]:
    return [codec.decode(r.value)[1] for r in read_topic(bootstrap, prefix + "switchyard.deadletter", 60_000)]


def test_every_refused_message_is_dead_lettered_with_its_reason(fuzzed):
    bootstrap, prefix, messages = fuzzed["bootstrap"], fuzzed["prefix"], fuzzed["messages"]
    letters = [x for x in _dead_letters(bootstrap, prefix) if x["topic"] != prefix + "switchyard.journal"]
    want = Counter((prefix + "switchyard." + m.topic, m.expect) for m in messages if m.expect != "accept")
    got = Counter((x["topic"], x["reason"]) for x in letters)
    assert got == want
    assert all(x["reason"] and x["detail"] is not None for x in letters)
    # the original bytes, message for message
    want_bytes = Counter((prefix + "switchyard." + m.topic, m.value or b"") for m in messages if m.expect != "accept")
    assert Counter((x["topic"], x["original_value"]) for x in letters) == want_bytes
    # and the worker's counters say the same
    by_labels = metric_by_labels(fuzzed["metrics"], "switchyard_events_dead_lettered_total")
    metrics = Counter()
    for labels, v in by_labels.items():
        fields = _labels(labels)
        metrics[(fields["topic"], fields["reason"])] += int(v)
    assert +Counter({k: v for k, v in metrics.items() if not k[0].endswith("switchyard.journal")}) == want
    fuzzed["figures"]["dead_letters_by_reason"] = dict(Counter(r for _, r in want.elements()))


def test_every_accepted_message_is_in_the_journal_byte_for_byte(fuzzed):
    bootstrap, prefix, messages = fuzzed["bootstrap"], fuzzed["prefix"], fuzzed["messages"]
    accepted = Counter(m.value for m in messages if m.expect == "accept")
    journal = Counter()
    own = 0
    for rec in read_topic(bootstrap, prefix + "switchyard.journal", 120_000):
        name, record = codec.decode(rec.value)
        if name == "Tick" or (name == "ConfigChange" and record.get("author", "").startswith("worker ")):
            own += 1
        else:
            journal[rec.value] += 1
    assert journal == accepted
    ingested = sum(metric_by_labels(fuzzed["metrics"], "switchyard_events_ingested_total").values())
    assert ingested == sum(accepted.values())
    fuzzed["figures"]["journal_entries"] = {"accepted": sum(accepted.values()), "worker_own": own}


def test_the_saved_core_state_is_in_bounds_and_equals_a_replay(fuzzed):
    bootstrap, prefix = fuzzed["bootstrap"], fuzzed["prefix"]
    from tests.faults.support import journal
    live = live_router(bootstrap, fuzzed["app_id"])   # first: the worker keeps appending ticks
    entries = journal(bootstrap, prefix)
    check_bounds(live)
    replayed = replayed_router(entries, upto=live.offset)
    check_bounds(replayed)
    assert replayed.offset == live.offset
    assert not same_state(live, replayed)
    report = audit(bootstrap, prefix, entries)
    assert report.ok, report.summary()
    # the hostile-but-accepted kinds reached the core and were handled there
    assert live.counters["heartbeats_stale_seq"] > 0 and live.counters["duplicate_events"] > 0
    assert live.counters["rejected_too_many_slots"] > 0 and live.counters["invalid_requests"] > 0, live.counters
    fuzzed["figures"]["core"] = {"counters": {k: v for k, v in live.counters.items() if k.startswith(
                                     ("rejected_", "invalid_", "duplicate_", "heartbeats_"))},
                                 "decisions_audited": report.compared}


def test_every_event_the_core_refuses_is_dead_lettered_too(fuzzed):
    """docs/decisions.md: an event the core refuses (unknown enum values, too many slots, malformed
    fields, a bad config) is "dead-lettered live, skipped and counted in replay"."""
    bootstrap, prefix = fuzzed["bootstrap"], fuzzed["prefix"]
    from tests.faults.support import journal
    entries = journal(bootstrap, prefix)
    raw = {r.offset: r.value for r in read_topic(bootstrap, prefix + "switchyard.journal", 120_000)}
    refused = {}
    for entry, outputs in replay(entries):
        for kind, record in outputs:
            if kind == "Rejected":
                refused[entry.journal_offset] = record["reason"]
    assert refused, "the fuzz produced no event the core refuses"
    letters = [x for x in _dead_letters(bootstrap, prefix) if x["topic"] == prefix + "switchyard.journal"]
    got = {x["offset"]: x["reason"] for x in letters}
    assert len(got) == len(letters), "a core refusal was dead-lettered twice"
    assert got == refused
    assert all(raw[x["offset"]].startswith(x["original_value"]) and x["original_value"] for x in letters)
    metrics = Counter()
    for labels, v in metric_by_labels(fuzzed["metrics"], "switchyard_events_dead_lettered_total").items():
        fields = _labels(labels)
        if fields["topic"] == prefix + "switchyard.journal":
            metrics[fields["reason"]] += int(v)
    assert metrics == Counter(refused.values())
    fuzzed["figures"]["core_refusals"] = dict(Counter(refused.values()))


def test_the_worker_survives_and_still_routes(fuzzed):
    """Last: the worker that took the fuzz starts again from its tables and routes a request."""
    worker, bootstrap, prefix = fuzzed["worker"], fuzzed["bootstrap"], fuzzed["prefix"]
    assert not metric_by_labels(fuzzed["metrics"], "switchyard_core_errors_total"), fuzzed["metrics"]
    restart(worker)
    from tests.integration.kafka_io import produce_events
    from tests.faults.support import heartbeat, registration
    produce_events(bootstrap, prefix + "switchyard.providers", [
        ("alive-1", "ProviderRegistered", registration("alive-1")), ("alive-1", "Heartbeat", heartbeat("alive-1", 1))])
    produce_events(bootstrap, prefix + "switchyard.requests", [("after-fuzz", "RouteRequest", {
        "request_id": "after-fuzz", "attempt": 0, "model": "gpt-oss-20b", "prompt_tokens": 100,
        "max_tokens": 64, "sent_at_ms": wall_ms()})])
    from replay.sources import kafka_decisions
    got = wait_for(lambda: [d for d in kafka_decisions(bootstrap, prefix + "switchyard.decisions")
                            if d["request_id"] == "after-fuzz"], timeout=60, what="a decision after the fuzz")
    assert got[0]["outcome"] in ("routed", "queued", "rejected")
    assert worker.running() and not agent_crashes(worker)
