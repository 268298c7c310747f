"""The Faust worker on a real broker: ingest → journal → provider table, dead-letters, restart."""
from __future__ import annotations

import asyncio
import signal
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streams import codec
from streams.journal_topic import topic_config
from tests.integration.kafka_io import journal_types, produce, produce_events, provider_rows, read_topic, wait_for
from tests.integration.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def registration(pid: str) -> dict:
    return {"event_id": f"reg-{pid}", "provider_id": pid, "registered_at_ms": 1000, "version": "0.7.5",
            "trust_level": "hardware", "hardware": {"chip_name": "Apple M3 Max", "chip_family": "M3",
            "chip_tier": "Max", "memory_gb": 64.0, "memory_bandwidth_gbs": 400.0, "gpu_cores": 40},
            "decode_tps": 40.0, "models": [{"id": "gpt-oss-20b", "size_bytes": 12_000_000_000}]}


def heartbeat(pid: str, seq: int) -> dict:
    return {"event_id": f"hb-{pid}-{seq}", "provider_id": pid, "seq": seq, "sent_at_ms": 2000 + seq,
            "status": "idle", "warm_models": ["gpt-oss-20b"],
            "system_metrics": {"memory_pressure": 0.1, "cpu_usage": 0.1, "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 0.0, "slots": [
                {"model": "gpt-oss-20b", "state": "running", "num_running": seq % 2}]}}


def table_rows(bootstrap: str, app_id: str) -> dict:
    """Provider sessions in the core table, as its changelog topic holds them."""
    return provider_rows(read_topic(bootstrap, f"{app_id}-core-changelog"))


@pytest.fixture
def world(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t{tag}.", f"switchyard-t{tag}"
    worker = Worker(kafka_bootstrap, tmp_path / "worker", app_id, prefix)
    yield kafka_bootstrap, prefix, app_id, worker
    worker.stop()


def test_provider_events_reach_the_table_and_survive_a_restart(world):
    bootstrap, prefix, app_id, worker = world
    worker.start()
    produce_events(bootstrap, prefix + "switchyard.providers", [
        ("box-a", "ProviderRegistered", registration("box-a")),
        ("box-b", "ProviderRegistered", registration("box-b")),
        ("box-a", "Heartbeat", heartbeat("box-a", 1)),
    ])
    rows = wait_for(lambda: (r := table_rows(bootstrap, app_id)).get("box-a", {}).get("last_seq") == 1 and r,
                    what="box-a heartbeat in the provider table")
    assert rows["box-a"]["backend"]["slots"][0][0] == "gpt-oss-20b"
    assert rows["box-b"]["last_seq"] == 0
    assert journal_types(bootstrap, prefix + "switchyard.journal") == ["ProviderRegistered"] * 2 + ["Heartbeat"]
    assert wait_for(lambda: worker.metric("switchyard_providers_online") == 2, what="gauge")

    worker.stop()
    worker.start()  # same datadir: RocksDB tables come back; the core catches up from the journal
    assert wait_for(lambda: worker.metric("switchyard_providers_online") == 2, what="restored gauge")
    produce_events(bootstrap, prefix + "switchyard.providers", [("box-a", "Heartbeat", heartbeat("box-a", 2))])
    rows = wait_for(lambda: (r := table_rows(bootstrap, app_id)).get("box-a", {}).get("last_seq") == 2 and r,
                    what="heartbeat after restart applied to a known provider")
    assert rows["box-a"] and rows["box-b"]
    assert journal_types(bootstrap, prefix + "switchyard.journal") == (
        ["ProviderRegistered"] * 2 + ["Heartbeat"] * 2)


def test_bad_input_is_dead_lettered_and_the_agent_keeps_running(world):
    bootstrap, prefix, app_id, worker = world
    worker.start()
    good = codec.encode("ProviderRegistered", registration("box-c"))
    asyncio.run(produce(bootstrap, prefix + "switchyard.providers", [
        (b"box-x", b"\x00\x00\x00\x00\x02garbage"),          # truncated / malformed body
        (b"box-x", b"\x07" + good[1:]),                      # wrong magic byte
        (b"box-x", b"\x00\x00\x00\x30\x39" + good[5:]),      # unknown schema id
        (b"not-box-c", good),                                # key differs from provider_id
        (b"box-c", codec.encode("Tick", {"at_ms": 5})),      # a type this topic does not carry
        (b"box-c", good),
    ]))
    asyncio.run(produce(bootstrap, prefix + "switchyard.requests", [(b"r1", b"\xff" * 40)]))
    rows = wait_for(lambda: (r := table_rows(bootstrap, app_id)).get("box-c") and r, what="good event applied")
    assert rows["box-c"]["session"] == "reg-box-c"
    dead = wait_for(lambda: (d := read_topic(bootstrap, prefix + "switchyard.deadletter")) and len(d) >= 6 and d,
                    what="6 dead letters")
    letters = [codec.decode(r.value)[1] for r in dead]
    assert sorted(x["reason"] for x in letters) == sorted(
        ["truncated", "bad_magic", "unknown_schema_id", "key_mismatch", "unexpected_type", "bad_magic"])
    assert all(x["original_value"] and x["topic"].startswith(prefix) for x in letters)
    assert worker.metric("switchyard_events_dead_lettered_total",
                         f'reason="key_mismatch",topic="{prefix}switchyard.providers"') == 1
    assert journal_types(bootstrap, prefix + "switchyard.journal") == ["ProviderRegistered"]


def test_the_journal_is_created_to_be_kept_forever(world):
    bootstrap, prefix, app_id, worker = world
    worker.start()
    produce_events(bootstrap, prefix + "switchyard.providers", [("box-d", "ProviderRegistered", registration("box-d"))])
    wait_for(lambda: journal_types(bootstrap, prefix + "switchyard.journal") == ["ProviderRegistered"], what="ingest")
    config = asyncio.run(topic_config(prefix + "switchyard.journal", bootstrap))
    assert (config["retention.ms"], config["retention.bytes"], config["cleanup.policy"]) == ("-1", "-1", "delete")
    assert "journal topic" not in worker.tail(400)


def test_an_existing_journal_that_would_lose_entries_is_reported_at_start(world):
    bootstrap, prefix, app_id, worker = world
    journal = prefix + "switchyard.journal"

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:  # as a broker's defaults, or an older worker, would have made it
            await admin.create_topics([NewTopic(journal, 1, 1, topic_configs={"retention.ms": "604800000"})])
        finally:
            await admin.close()

    asyncio.run(create())
    worker.start()
    wait_for(lambda: f"journal topic {journal}: retention.ms=604800000" in worker.tail(400), what="the warning")
    assert asyncio.run(topic_config(journal, bootstrap))["retention.ms"] == "604800000"  # left as it is
    produce_events(bootstrap, prefix + "switchyard.providers", [("box-d", "ProviderRegistered", registration("box-d"))])
    wait_for(lambda: journal_types(bootstrap, journal) == ["ProviderRegistered"], what="ingest still runs")


def test_the_replication_factor_of_the_topics_it_creates_is_a_setting(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]  # one broker here: a factor of 3 cannot be met, and the worker says so
    worker = Worker(kafka_bootstrap, tmp_path / "worker", f"switchyard-t{tag}", f"t{tag}.",
                    env={"SWITCHYARD_REPLICATION_FACTOR": "3"})
    try:
        with pytest.raises(RuntimeError, match="worker exited"):
            worker.start(timeout=60)
        assert "The target replication factor of 3 cannot be reached" in worker.tail(200)
    finally:
        worker.stop()


def test_a_request_naming_a_topic_it_may_not_reply_to_is_dead_lettered(world):
    bootstrap, prefix, app_id, worker = world
    worker.start()

    def request(rid: str, reply_to: str) -> tuple[str, str, dict]:
        return rid, "RouteRequest", {"request_id": rid, "model": "gpt-oss-20b", "prompt_tokens": 100,
                                     "reply_to": reply_to}

    private = prefix + "switchyard.replies.gw-1"
    produce_events(bootstrap, prefix + "switchyard.requests", [
        request("into-journal", prefix + "switchyard.journal"),
        request("into-changelog", f"{app_id}-core-changelog"),
        request("illegal-name", prefix + "switchyard.replies/../x"),
        request("fine", private),
    ])
    dead = wait_for(lambda: (d := read_topic(bootstrap, prefix + "switchyard.deadletter")) and len(d) >= 3 and d,
                    what="3 dead letters")
    letters = {(x := codec.decode(r.value)[1])["original_key"]: x for r in dead}
    assert {k: v["reason"] for k, v in letters.items()} == {
        b"into-journal": "bad_reply_to", b"into-changelog": "bad_reply_to", b"illegal-name": "bad_reply_to"}
    assert "one of the worker's own topics" in letters[b"into-journal"]["detail"]
    replies = wait_for(lambda: read_topic(bootstrap, private), what="the good request's decision")
    assert [codec.decode(r.value)[1]["request_id"] for r in replies] == ["fine"]
    assert journal_types(bootstrap, prefix + "switchyard.journal") == ["RouteRequest"]
    assert worker.metric("switchyard_events_dead_lettered_total",
                         f'reason="bad_reply_to",topic="{prefix}switchyard.requests"') == 3


def test_a_deployment_with_its_own_prefix_gets_its_own_state_and_a_shared_one_is_refused(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    first = Worker(kafka_bootstrap, tmp_path / "first", "", f"one{tag}.")  # no app id: derived from the prefix
    try:
        first.start()
        produce_events(kafka_bootstrap, f"one{tag}.switchyard.providers",
                       [(p, "ProviderRegistered", registration(p)) for p in ("box-a", "box-b")])
        rows = wait_for(lambda: (r := table_rows(kafka_bootstrap, f"switchyard-one{tag}")) and len(r) == 2 and r,
                        what="the state in switchyard-<prefix>-core-changelog")
        assert set(rows) == {"box-a", "box-b"}
    finally:
        first.stop()

    # Another deployment (prefix) given the first one's app id would load its state: it refuses.
    second = Worker(kafka_bootstrap, tmp_path / "second", f"switchyard-one{tag}", f"two{tag}.")
    try:
        second.start()
        wait_for(lambda: "router: not routing: the table" in second.tail(400), what="the refusal")
        assert f"one{tag}.switchyard.providers" in second.tail(400)
        assert second.metric("switchyard_core_errors_total", 'error="loop_ForeignState"') == 1
        assert second.metric("switchyard_providers_online") == 0
    finally:
        second.stop()


def test_a_restart_keeps_live_setting_changes_and_a_worker_with_new_settings_records_them(world, tmp_path):
    bootstrap, prefix, app_id, worker = world
    worker.extra_env = {"EIGENINFERENCE_QUEUE_MAX_DEPTH": "7"}
    journal = prefix + "switchyard.journal"

    def config_changes() -> list[dict]:
        return [r for n, r in (codec.decode(x.value) for x in read_topic(bootstrap, journal)) if n == "ConfigChange"]

    def decided(rid: str) -> dict:
        produce_events(bootstrap, prefix + "switchyard.requests", [(rid, "RouteRequest", {
            "request_id": rid, "model": "gpt-oss-20b", "prompt_tokens": 100})])
        return wait_for(lambda: next((d for d in (codec.decode(r.value)[1] for r in read_topic(
            bootstrap, prefix + "switchyard.decisions")) if d["request_id"] == rid), None), what=f"{rid} decided")

    worker.start()
    start = decided("r-start")
    (first,) = config_changes()
    assert first["author"].endswith(" at start") and first["settings"] == {"EIGENINFERENCE_QUEUE_MAX_DEPTH": "7"}
    produce_events(bootstrap, prefix + "switchyard.config", [("default", "ConfigChange", {
        "config_id": "", "settings": {"EIGENINFERENCE_SATISFICING_BAND": "true"}, "changed_at_ms": 1,
        "author": "operator"})])
    live = wait_for(lambda: (d := decided(f"r-live-{len(config_changes())}"))["config_id"] != start["config_id"] and d,
                    what="a decision under the live change")

    worker.stop(signal.SIGKILL)  # a crash: the same settings come back, the live change stays
    worker.start()
    assert decided("r-after-crash")["config_id"] == live["config_id"]
    assert [c["author"] for c in config_changes()] == [first["author"], "operator"]

    worker.stop()
    redeployed = Worker(bootstrap, worker.datadir, app_id, prefix, env={"EIGENINFERENCE_QUEUE_MAX_DEPTH": "8"})
    try:
        redeployed.start()  # new settings: recorded, as a full patch that ends the live change
        after = decided("r-redeployed")
        last = config_changes()[-1]
        assert last["author"].endswith(" at start") and last["settings"] == {
            "EIGENINFERENCE_QUEUE_MAX_DEPTH": "8", "EIGENINFERENCE_SATISFICING_BAND": ""}
        assert after["config_id"] not in (start["config_id"], live["config_id"])
        assert "EIGENINFERENCE_SATISFICING_BAND" in redeployed.tail(400)  # the warning names what it ends
    finally:
        redeployed.stop()


def test_a_request_with_an_unusable_sent_at_is_counted_not_timed(world):
    bootstrap, prefix, app_id, worker = world
    worker.start()
    produce_events(bootstrap, prefix + "switchyard.requests", [
        ("unset", "RouteRequest", {"request_id": "unset", "model": "gpt-oss-20b", "prompt_tokens": 100, "sent_at_ms": 0}),
        ("future", "RouteRequest", {"request_id": "future", "model": "gpt-oss-20b", "prompt_tokens": 100,
                                    "sent_at_ms": 4_000_000_000_000}),
        ("unset", "RouteRequest", {"request_id": "unset", "model": "gpt-oss-20b", "prompt_tokens": 100}),
    ])
    wait_for(lambda: worker.metric("switchyard_core_events_total", 'event="duplicate_requests"') == 1,
             what="the repeated request counted by the core, not decided again")
    assert worker.metric("switchyard_request_sent_at_unusable_total") == 2
    assert worker.metric("switchyard_decision_latency_seconds_count", 'since="request_sent"') == 0
    assert worker.metric("switchyard_decision_latency_seconds_count", 'since="journal_append"') == 2
    assert 0 < worker.metric("switchyard_journal_lag_seconds") < 30  # read at the scrape: Ticks keep it fresh
