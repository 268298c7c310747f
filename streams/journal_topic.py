"""The journal topic's settings: what the worker creates it with, and what it warns about when an
existing journal has others.

The journal is a routing domain's source of truth (architecture): kept forever and never
compacted, so that a replay or an audit can start from its first entry. A broker's defaults would
delete entries after a week (`log.retention.hours=168`). The worker does not change the settings of
a journal that already exists (the cluster is its operator's): it says what is wrong at start.
"""
from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

JOURNAL_CONFIG = {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"}


def journal_config_problem(config: dict[str, str | None]) -> str | None:
    """What is wrong with a journal topic's settings (DescribeConfigs names and values), or None."""
    problems = []
    policy = config.get("cleanup.policy") or "delete"
    if "compact" in policy:
        problems.append(f"cleanup.policy={policy} (compaction deletes entries)")
    for name in ("retention.ms", "retention.bytes"):
        if int(config.get(name) or "-1") >= 0:
            problems.append(f"{name}={config[name]} (entries older or beyond it are deleted)")
    if not problems:
        return None
    wanted = ",".join(f"{k}={v}" for k, v in JOURNAL_CONFIG.items())
    return ("; ".join(problems) + ". A replay or an audit needs the journal from its first entry. "
            f"Fix: kafka-configs.sh --alter --entity-type topics --entity-name <journal> --add-config {wanted}")


async def topic_config(topic: str, bootstrap: str, kafka_kwargs: dict | None = None) -> dict[str, str | None]:
    """A topic's effective settings, by name."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(kafka_kwargs or {}))
    await admin.start()
    try:
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        ((error_code, error_message, _type, _name, entries),) = response.resources
        if error_code:
            raise RuntimeError(f"DescribeConfigs {topic}: error {error_code} {error_message or ''}".strip())
        return {entry[0]: entry[1] for entry in entries}  # (name, value, read_only, ...)
    finally:
        await admin.close()
