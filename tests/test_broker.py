"""The real Kafka broker (LocalKafka or $KAFKA_BOOTSTRAP_SERVERS) works with aiokafka 0.14."""

import asyncio
import os
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from streams.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def topic_name(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:8]}"


async def produce(bootstrap: str, topic: str, values: list[bytes], **producer_kw) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **producer_kw)
    await producer.start()
    try:
        for i, value in enumerate(values):
            await producer.send_and_wait(topic, value, key=str(i).encode())
    finally:
        await producer.stop()


async def consume(bootstrap: str, topic: str, count: int, timeout: float = 20.0) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"g-{uuid.uuid4().hex[:8]}", enable_auto_commit=False)
    await consumer.start()
    try:
        got: list[bytes] = []
        async with asyncio.timeout(timeout):
            async for msg in consumer:
                got.append(msg.value)
                if len(got) == count:
                    return got
    finally:
        await consumer.stop()


def test_produce_and_consume(kafka_bootstrap):
    topic = topic_name("roundtrip")  # auto-created by the first produce
    asyncio.run(produce(kafka_bootstrap, topic, [b"hello"]))
    assert asyncio.run(consume(kafka_bootstrap, topic, 1)) == [b"hello"]


def test_create_topic_with_three_partitions(kafka_bootstrap):
    topic = topic_name("admin")

    async def main():
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
            # CreateTopics returns once the controller committed the topic; the broker's metadata
            # cache, which list_topics reads, can lag behind it by a moment
            for _ in range(50):
                if topic in await admin.list_topics():
                    break
                await asyncio.sleep(0.1)
            assert topic in await admin.list_topics()
            [meta] = await admin.describe_topics([topic])
            assert meta["error_code"] == 0
            assert sorted(p["partition"] for p in meta["partitions"]) == [0, 1, 2]
        finally:
            await admin.close()

    asyncio.run(main())


def test_idempotent_producer(kafka_bootstrap):
    topic = topic_name("idem")
    values = [f"v{i}".encode() for i in range(20)]
    asyncio.run(produce(kafka_bootstrap, topic, values, enable_idempotence=True))
    assert asyncio.run(consume(kafka_bootstrap, topic, len(values))) == values


@pytest.mark.skipif(bool(os.environ.get("KAFKA_BOOTSTRAP_SERVERS")),
                    reason="external broker in use; this test starts its own LocalKafka")
def test_restart_keeps_data_and_port():
    topic = topic_name("restart")
    with LocalKafka() as kafka:
        bootstrap = kafka.bootstrap
        asyncio.run(produce(bootstrap, topic, [b"before-restart"]))
        kafka.restart()
        assert kafka.bootstrap == bootstrap
        assert asyncio.run(consume(bootstrap, topic, 1)) == [b"before-restart"]


def test_the_local_broker_is_sized_for_a_small_machine(kafka_broker):
    """It shares two cores with its clients: 2 network and 2 request-handler threads (not Kafka's
    3 and 8) and the parallel collector (not G1), which cut its CPU by 12-15 % (docs/benchmarks.md)."""
    async def broker_config() -> dict[str, str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        await admin.start()
        try:
            (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "1")])
        finally:
            await admin.close()
        (resource,) = response.resources
        return {entry[0]: entry[1] for entry in resource[4]}  # (name, value, ...) per config entry

    config = asyncio.run(broker_config())
    assert (config["num.network.threads"], config["num.io.threads"]) == ("2", "2")
    with open(f"/proc/{kafka_broker.pid}/cmdline", "rb") as f:
        assert b"-XX:+UseParallelGC" in f.read().split(b"\0")
