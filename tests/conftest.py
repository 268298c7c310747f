"""Shared pytest fixtures. The Kafka ones use $KAFKA_BOOTSTRAP_SERVERS if set, else a LocalKafka."""

import os
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # import `streams` also under plain `pytest`
    sys.path.insert(0, ROOT)

from streams.broker import LocalKafka  # noqa: E402

EXTERNAL_KAFKA = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kafka: needs a real Kafka broker ($KAFKA_BOOTSTRAP_SERVERS, else a LocalKafka JVM)")


@pytest.fixture(scope="session")
def _local_kafka():
    if EXTERNAL_KAFKA:
        yield None
        return
    with LocalKafka() as kafka:
        yield kafka


@pytest.fixture(scope="session")
def kafka_bootstrap(_local_kafka) -> str:
    """Bootstrap servers of the session's broker, e.g. "127.0.0.1:40123"."""
    return EXTERNAL_KAFKA or _local_kafka.bootstrap


@pytest.fixture(scope="session")
def kafka_broker(_local_kafka) -> LocalKafka:
    """The session's own LocalKafka (for restart/fault tests); skipped with an external broker."""
    if _local_kafka is None:
        pytest.skip("KAFKA_BOOTSTRAP_SERVERS is set: external broker, no own process to restart")
    return _local_kafka
