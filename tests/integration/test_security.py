"""Access control on a real broker: SASL (PLAIN, SCRAM) over TLS, the ACLs of each principal, a
worker with credentials, and a web server that is loopback-only and serves no table contents.

Most tests use this module's own `LocalKafka(security=True)` (SASL_SSL only, deny by default, the
ACLs of `streams.kafka_security.switchyard_acls()`); the web-server test uses the session broker."""
from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from streams import codec
from streams.broker import LocalKafka
from streams.client import GatewayClient
from streams.kafka_security import KafkaSecurity, KafkaSecurityError, switchyard_acls
from tests.integration.kafka_io import produce_events, provider_rows, read_topic, wait_for
from tests.integration.test_worker import registration
from tests.integration.worker import ROOT, Worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

INPUTS = ("switchyard.providers", "switchyard.requests", "switchyard.completions", "switchyard.config")
OUTPUTS = ("switchyard.journal", "switchyard.decisions", "switchyard.reservations", "switchyard.capacity",
           "switchyard.deadletter")
# Who may write which input topic (the issue's ACL table); everything else must be refused.
WRITERS = {"switchyard.providers": {"provider"}, "switchyard.requests": {"gateway"},
           "switchyard.completions": {"gateway"}, "switchyard.config": {"operator"}}
SERVICE_USES_SECURITY = "kafka_security" in (ROOT / "streams" / "service.py").read_text()


# --- helpers ----------------------------------------------------------------------------------------
async def _produce(bootstrap: str, security: KafkaSecurity, topic: str,
                   messages: list[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000,
                                **security.aiokafka_kwargs())
    await producer.start()
    try:
        for key, value in messages:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def produce(kafka: LocalKafka, security: KafkaSecurity, topic: str, messages=((b"k", b"v"),)) -> None:
    asyncio.run(_produce(kafka.bootstrap, security, topic, list(messages)))


async def _read_all(bootstrap: str, security: KafkaSecurity, topic: str) -> list:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                **security.aiokafka_kwargs())
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        end = (await consumer.end_offsets([tp]))[tp]
        out = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            out.extend(r for r in batch.get(tp, []) if r.offset < end)
        return out
    finally:
        await consumer.stop()


def read_all(kafka: LocalKafka, security: KafkaSecurity, topic: str) -> list:
    return asyncio.run(_read_all(kafka.bootstrap, security, topic))


def heartbeat(pid: str, seq: int) -> dict:
    return {"event_id": f"hb-{pid}-{seq}", "provider_id": pid, "seq": seq, "sent_at_ms": 2000 + seq,
            "status": "idle", "warm_models": ["gpt-oss-20b"],
            "system_metrics": {"memory_pressure": 0.1, "cpu_usage": 0.1, "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 0.0, "slots": [
                {"model": "gpt-oss-20b", "state": "running", "num_running": 0}]}}


# --- the secured broker -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secure_kafka():
    with LocalKafka(security=True) as kafka:
        logging.getLogger(__name__).info("secured broker started in %.1fs", kafka.start_seconds)

        async def create_topics():  # as an operator would, with the admin (super user)
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap, **kafka.client_security().aiokafka_kwargs())
            await admin.start()
            try:
                await admin.create_topics([NewTopic(name, 1, 1) for name in INPUTS + OUTPUTS])
            finally:
                await admin.close()

        asyncio.run(create_topics())
        yield kafka


def test_the_broker_offers_only_sasl_ssl_and_a_private_configuration(secure_kafka):
    kafka = secure_kafka
    props = dict(line.split("=", 1) for line in (kafka.data_dir / "server.properties").read_text().splitlines())
    assert props["listeners"] == (f"SASL_SSL://127.0.0.1:{kafka.port},"
                                  f"CONTROLLER://127.0.0.1:{kafka.controller_port}")
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT"
    assert props["allow.everyone.if.no.acl.found"] == "false" and props["super.users"] == "User:admin"
    for private in ("server.properties", "security/secrets.json", "security/worker.env", "security/ca.p12"):
        assert (kafka.data_dir / private).stat().st_mode & 0o077 == 0, private
    assert kafka.ca_file.read_text().startswith("-----BEGIN CERTIFICATE-----")
    env = dict(line.split("=", 1) for line in (kafka.security_dir / "worker.env").read_text().splitlines())
    assert KafkaSecurity.from_env(env).username == "worker" and env["KAFKA_BOOTSTRAP_SERVERS"] == kafka.bootstrap


@pytest.mark.parametrize("topic", INPUTS)
@pytest.mark.parametrize("user", ["provider", "gateway", "operator"])
def test_each_principal_writes_only_its_own_input_topics(secure_kafka, user, topic):
    security = secure_kafka.client_security(user)
    if user in WRITERS[topic]:
        produce(secure_kafka, security, topic)
    else:
        with pytest.raises(TopicAuthorizationFailedError):
            produce(secure_kafka, security, topic)


@pytest.mark.parametrize("user", ["provider", "gateway", "operator"])
def test_clients_cannot_write_the_journal_or_decisions(secure_kafka, user):
    for topic in ("switchyard.journal", "switchyard.decisions", "switchyard-core-changelog"):
        with pytest.raises(TopicAuthorizationFailedError):
            produce(secure_kafka, secure_kafka.client_security(user), topic)


async def _try_fetch(bootstrap: str, security: KafkaSecurity, topic: str) -> list:
    """Fetch from offset 0 of partition 0 without asking for offsets first (that needs DESCRIBE)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                **security.aiokafka_kwargs())
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        batch = await consumer.getmany(tp, timeout_ms=2500)
        return batch.get(tp, [])
    finally:
        await consumer.stop()


def test_gateway_reads_decisions_and_nobody_else_reads_anything(secure_kafka):
    kafka = secure_kafka
    for topic in ("switchyard.decisions", "switchyard.journal", "switchyard.reservations", "switchyard.config",
                  "switchyard.providers"):
        produce(kafka, kafka.client_security(), topic, [(b"k", f"in {topic}".encode())])
    got = asyncio.run(_try_fetch(kafka.bootstrap, kafka.client_security("gateway"), "switchyard.decisions"))
    assert b"in switchyard.decisions" in [r.value for r in got]
    for user, topic in (("provider", "switchyard.providers"), ("provider", "switchyard.journal"),
                        ("gateway", "switchyard.journal"), ("gateway", "switchyard.reservations"),
                        ("gateway", "switchyard.requests"), ("operator", "switchyard.config")):
        # Denied: the fetch fails (READ missing, DESCRIBE implied by WRITE), or, without even
        # DESCRIBE, the client never learns the partition's leader and fetches nothing.
        try:
            got = asyncio.run(_try_fetch(kafka.bootstrap, kafka.client_security(user), topic))
        except TopicAuthorizationFailedError:
            got = []
        assert got == [], (user, topic)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_every_mechanism_authenticates_and_acls_apply_the_same(secure_kafka, mechanism):
    security = secure_kafka.client_security("provider", mechanism)
    produce(secure_kafka, security, "switchyard.providers", [(b"box-m", f"via {mechanism}".encode())])
    assert f"via {mechanism}".encode() in [
        r.value for r in read_all(secure_kafka, secure_kafka.client_security(), "switchyard.providers")]
    with pytest.raises(TopicAuthorizationFailedError):
        produce(secure_kafka, security, "switchyard.config")


def _refusals(kafka: LocalKafka) -> dict[str, tuple[KafkaSecurity, str | None]]:
    """Ways to come without (valid) credentials, and the reason aiokafka logs for each (None: it
    logs none beyond "Unable to bootstrap")."""
    good = kafka.users["provider"]
    return {
        "plaintext, no credentials": (KafkaSecurity(), "closed"),
        "tls without sasl": (KafkaSecurity("SSL", cafile=str(kafka.ca_file)), None),
        "sasl_plaintext (no tls)": (KafkaSecurity("SASL_PLAINTEXT", "PLAIN", "provider", good), "closed"),
        "wrong password, PLAIN": (kafka.client_security("provider", "PLAIN", password="wrong"),
                                  "Invalid username or password"),
        "wrong password, SCRAM-SHA-256": (kafka.client_security("provider", "SCRAM-SHA-256", password="wrong"),
                                          "invalid credentials with SASL mechanism SCRAM-SHA-256"),
        "unknown user, SCRAM-SHA-512": (kafka.client_security("mallory", "SCRAM-SHA-512", password="x"),
                                        "invalid credentials with SASL mechanism SCRAM-SHA-512"),
        "right password, CA not trusted": (KafkaSecurity("SASL_SSL", "PLAIN", "provider", good),
                                           "CERTIFICATE_VERIFY_FAILED"),
    }


REFUSAL_CASES = ["plaintext, no credentials", "tls without sasl", "sasl_plaintext (no tls)", "wrong password, PLAIN",
                 "wrong password, SCRAM-SHA-256", "unknown user, SCRAM-SHA-512", "right password, CA not trusted"]


@pytest.mark.parametrize("case", REFUSAL_CASES)
def test_a_producer_without_valid_credentials_cannot_connect_or_write(secure_kafka, case, caplog):
    security, why = _refusals(secure_kafka)[case]
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        produce(secure_kafka, security, "switchyard.providers", [(b"intruder", b"should not land")])
    assert why is None or why in caplog.text, caplog.text
    values = [r.value for r in read_all(secure_kafka, secure_kafka.client_security(), "switchyard.providers")]
    assert b"should not land" not in values


def test_the_controller_port_refuses_clients_without_the_admin_password(secure_kafka, caplog):
    security = KafkaSecurity("SASL_PLAINTEXT", "PLAIN", "provider", secure_kafka.users["provider"])
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(_produce(f"127.0.0.1:{secure_kafka.controller_port}", security, "switchyard.providers",
                             [(b"k", b"v")]))
    assert "Invalid username or password" in caplog.text


# --- the worker with credentials ------------------------------------------------------------------
def table_rows(kafka: LocalKafka, app_id: str) -> dict:
    return provider_rows(read_all(kafka, kafka.client_security(), f"{app_id}-core-changelog"))


@pytest.mark.skipif(not SERVICE_USES_SECURITY,
                    reason="streams/service.py does not use streams.kafka_security yet (pending patch)")
def test_worker_with_credentials_processes_provider_events_end_to_end(secure_kafka, tmp_path):
    kafka, app_id = secure_kafka, "switchyard"  # the ACLs are for the default app id and no topic prefix
    pid = f"box-{uuid.uuid4().hex[:6]}"
    env = kafka.client_security("worker", "SCRAM-SHA-256").env()
    worker = Worker(kafka.bootstrap, tmp_path / "worker", app_id, "", env=env)
    try:
        worker.start()
        produce(kafka, kafka.client_security("provider", "SCRAM-SHA-512"), "switchyard.providers",
                [(pid.encode(), codec.encode("ProviderRegistered", registration(pid)))])
        rows = wait_for(lambda: (r := table_rows(kafka, app_id)).get(pid) and r, what=f"{pid} in the provider table")
        assert list(rows[pid]["models"]) == ["gpt-oss-20b"]
        journal = [codec.decode(r.value)[0] for r in read_all(kafka, kafka.client_security(), "switchyard.journal")
                   if r.value.startswith(b"\x00")]  # other tests put a raw probe value there
        assert "ProviderRegistered" in journal and "ConfigChange" in journal
        assert "Authenticated as worker via SCRAM-SHA-256" in worker.tail(10_000)
        assert "could not read the journal topic's configuration" not in worker.tail(10_000)
        worker.stop()

        # A fresh data dir, same group: the router restores its state from the table changelog
        # (credentialed) before it applies the next heartbeat of a provider it must know.
        worker = Worker(kafka.bootstrap, tmp_path / "worker2", app_id, "", env=env)
        worker.start()
        produce(kafka, kafka.client_security("provider"), "switchyard.providers",
                [(pid.encode(), codec.encode("Heartbeat", heartbeat(pid, 1)))])
        rows = wait_for(lambda: (r := table_rows(kafka, app_id)).get(pid, {}).get("last_seq") == 1 and r,
                        what=f"{pid} heartbeat applied after catch-up")
        assert rows[pid]["session"]
        assert "TopicAuthorizationFailed" not in worker.tail(10_000)

        # The gateway's client, with the gateway's credentials and ACLs (write requests, read decisions).
        async def route() -> dict:
            async with GatewayClient(kafka.bootstrap, security=kafka.client_security("gateway", "SCRAM-SHA-512")) as gw:
                return await gw.route({"model": "gpt-oss-20b", "prompt_tokens": 100}, timeout=30)
        decision = asyncio.run(route())
        assert decision["outcome"] == "routed" and decision["provider_id"] == pid, decision
    finally:
        worker.stop()


# --- the web server -------------------------------------------------------------------------------
def _listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                if len(addr) == 8:
                    found.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
                else:
                    found.add(f"ipv6:{addr}")
    return found


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def test_web_server_listens_on_loopback_and_serves_no_table_contents(kafka_bootstrap, tmp_path, monkeypatch):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to see the bound address")
    monkeypatch.delenv("SWITCHYARD_WEB_BIND", raising=False)  # the default is what is tested
    tag = uuid.uuid4().hex[:8]
    prefix, app_id, pid = f"w{tag}.", f"switchyard-w{tag}", f"box-{tag}"
    worker = Worker(kafka_bootstrap, tmp_path / "worker", app_id, prefix)
    try:
        worker.start()
        assert _listening_addresses(worker.web_port) == {"127.0.0.1"}
        produce_events(kafka_bootstrap, prefix + "switchyard.providers",
                       [(pid, "ProviderRegistered", registration(pid))])
        wait_for(lambda: pid in provider_rows(read_topic(kafka_bootstrap, f"{app_id}-core-changelog")),
                 what="the provider in the table")
        base = f"http://127.0.0.1:{worker.web_port}"
        assert _get(base + "/metrics")[0] == 200
        for path in ("/table/", "/table/core/", f"/table/core/p%1F{pid}/", "/table/core/meta/",
                     "/graph/", "/stats/", "/assignment/", "/performance/"):
            assert _get(base + path)[0] == 404, path
        # What is served (/, /metrics, Faust's /router/ pages: which worker owns which partition)
        # carries no table value: nothing of the provider's session.
        for path in ("/", "/metrics", "/router/", "/router/topics", "/router/providers/", f"/router/providers/{pid}/"):
            status, body = _get(base + path)
            assert "gpt-oss-20b" not in body and "last_seq" not in body and "slots" not in body, (path, status, body)
    finally:
        worker.stop()


# --- settings (no broker) -------------------------------------------------------------------------
def test_settings_from_the_environment():
    assert KafkaSecurity.from_env({}).aiokafka_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert KafkaSecurity.from_env({}).faust_credentials() is None
    sec = KafkaSecurity.from_env({"KAFKA_SECURITY_PROTOCOL": "sasl_plaintext", "KAFKA_SASL_MECHANISM": "scram-sha-512",
                                  "KAFKA_SASL_USERNAME": "worker", "KAFKA_SASL_PASSWORD": "pw"})
    assert sec.aiokafka_kwargs() == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                                     "sasl_plain_username": "worker", "sasl_plain_password": "pw"}
    creds = sec.faust_credentials()
    assert (creds.protocol.value, creds.mechanism.value, creds.username) == ("SASL_PLAINTEXT", "SCRAM-SHA-512", "worker")
    assert "pw" not in repr(sec)
    for bad in ({"KAFKA_SECURITY_PROTOCOL": "TLS"},
                {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_USERNAME": "u"},
                {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "GSSAPI",
                 "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"},
                {"KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"},          # credentials, PLAINTEXT
                {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"}):
        with pytest.raises(KafkaSecurityError):
            KafkaSecurity.from_env(bad)


def test_settings_build_faust_and_aiokafka_tls_from_a_ca_file(tmp_path):
    ca = tmp_path / "ca.pem"
    import ssl

    # Any valid PEM certificate will do to load a context; take the system's first CA if present.
    paths = ssl.get_default_verify_paths()
    source = Path(paths.cafile) if paths.cafile and Path(paths.cafile).exists() else None
    if source is None:
        pytest.skip("no system CA bundle to borrow a certificate from")
    ca.write_text(source.read_text().split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n")
    sec = KafkaSecurity.from_env({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
                                  "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p", "KAFKA_SSL_CAFILE": str(ca)})
    kw = sec.aiokafka_kwargs()
    assert kw["security_protocol"] == "SASL_SSL" and kw["ssl_context"].check_hostname
    assert kw["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    creds = sec.faust_credentials()
    assert creds.protocol.value == "SASL_SSL" and creds.ssl_context is kw["ssl_context"]
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    assert credentials_to_aiokafka_auth(creds) == kw  # what faust-streaming hands to aiokafka
    ssl_only = KafkaSecurity("SSL", cafile=str(ca))
    assert credentials_to_aiokafka_auth(ssl_only.faust_credentials()) == ssl_only.aiokafka_kwargs()


def test_acl_table_matches_the_issue():
    acls = switchyard_acls()
    writes = {(a.principal, a.resource_name) for a in acls if a.operation == "WRITE" and a.pattern == "LITERAL"}
    assert writes == {("User:provider", "switchyard.providers"), ("User:gateway", "switchyard.requests"),
                      ("User:gateway", "switchyard.completions"), ("User:operator", "switchyard.config")}
    assert {str(a) for a in acls if a.principal != "User:worker" and a.operation != "WRITE"} == {
        "User:gateway READ topic switchyard.decisions"}
    prefixed = {a.resource_name for a in switchyard_acls("t1.", "sy-t1") if a.pattern == "PREFIXED"}
    assert prefixed == {"t1.switchyard.", "sy-t1-"}
