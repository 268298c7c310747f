"""The latency benchmark's load (benchmarks/load.py) on each of its two Kafka clients, through a real
broker: the driver's requests come back through an echo child, every one is matched to its reply,
and the fleet child heartbeats on schedule and completes each echoed request with a provider of the
request's model."""
import asyncio
import time
import uuid
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.echo_baselines import Child
from benchmarks.fleet import model_names
from benchmarks.load import CLIENTS, drive
from streams import codec
from streams.client import ensure_topics

pytestmark = pytest.mark.kafka

MODELS = model_names(3)


def read_all(bootstrap: str, topic: str) -> list:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def run():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            end = (await consumer.end_offsets([tp]))[tp]
            out = []
            while len(out) < end:
                batches = await consumer.getmany(tp, timeout_ms=1000)
                out += batches.get(tp, [])
            return out
        finally:
            await consumer.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("client", CLIENTS)
def test_driver_and_fleet_round_trip_through_an_echo(client, kafka_bootstrap, tmp_path: Path):
    base = f"load{uuid.uuid4().hex[:8]}."
    requests, replies = base + "requests", base + "replies"
    providers, completions = base + "switchyard.providers", base + "switchyard.completions"
    asyncio.run(ensure_topics(kafka_bootstrap, [requests, replies, providers, completions]))
    echo = Child("benchmarks.echo_baselines", ["echo", "--bootstrap", kafka_bootstrap, "--requests", requests,
                                               "--replies", replies], tmp_path / "echo.log").start()
    fleet_args = Namespace(providers=12, models=len(MODELS), per_box=2, interval=1.0, hold_ms=50.0)
    fleet = Child("benchmarks.pipeline_latency", [
        "fleet", "--bootstrap", kafka_bootstrap, "--prefix", base, "--replies", replies,
        "--providers", str(fleet_args.providers), "--models", str(fleet_args.models),
        "--per-box", str(fleet_args.per_box), "--interval", str(fleet_args.interval),
        "--hold-ms", str(fleet_args.hold_ms), "--client", client], tmp_path / "fleet.log").start()
    try:
        t0 = time.monotonic()
        result, arrays = drive(client, kafka_bootstrap, "echo", requests, replies, rate=100.0, warmup=0.5,
                               seconds=2.0, models=MODELS, seed=3, drain=10.0)
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # the last completions are due hold_ms after their replies
    finally:
        fleet_stats = fleet.stop()
        echo.stop()

    # every request (warm-up ones too) came back, matched to its own send
    assert result["requests"] == 200 and result["replies"] == 200 and result["lost"] == 0
    assert result["outcomes"] == {"RouteRequest": 200} and result["extra_replies"] == 0
    assert 1.5 <= (200 - 1) / result["achieved_rate"] <= 2.5  # open loop at 100/s: two seconds
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"] < 10_000
    assert all(r is not None and r >= s for r, s in zip(arrays["recv_wall"], arrays["send_wall"]))

    # the fleet: every provider heartbeats about once per interval, keyed by its id
    heartbeats = read_all(kafka_bootstrap, providers)
    assert fleet_stats["heartbeats"] == len(heartbeats)
    expected = fleet_args.providers * elapsed / fleet_args.interval
    assert 0.6 * expected <= len(heartbeats) <= 1.5 * expected + fleet_args.providers
    for r in heartbeats:
        name, hb = codec.decode(r.value)
        assert name == "Heartbeat" and r.key.decode() == hb["provider_id"]
    assert {codec.decode(r.value)[1]["provider_id"] for r in heartbeats} == \
        {f"p{i:05d}" for i in range(fleet_args.providers)}

    # ... and completes every echoed request (warm-up ones too), by a provider of its model
    done = read_all(kafka_bootstrap, completions)
    assert fleet_stats["decision_echoed"] == fleet_stats["completions"] == len(done) == 250
    serves = {f"p{i:05d}": {MODELS[(i + j) % len(MODELS)] for j in range(2)} for i in range(fleet_args.providers)}
    sent_ids = set(arrays["rids"])
    for r in done:
        name, c = codec.decode(r.value)
        assert name == "Completion" and r.key.decode() == c["provider_id"]
        assert c["request_id"] in sent_ids and c["model"] in serves[c["provider_id"]]
