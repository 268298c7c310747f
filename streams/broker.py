"""A real single-node Apache Kafka broker on loopback, without Docker.

This module owns the local broker used by tests and development:

* resolving Kafka's jars from Maven Central (``broker/pom.xml``) into a cache
  directory, once (``$SWITCHYARD_KAFKA_HOME`` or ``~/.cache/switchyard/kafka-4.0.0``);
* ``LocalKafka``: writes a KRaft ``server.properties`` (combined broker+controller,
  node 1, replication factor 1) into a data dir, formats storage, runs
  ``kafka.Kafka`` as a child process and waits until a metadata request
  returns the broker; ``stop()`` and ``restart()`` (same ports, same data);
* ``LocalKafka(security=BrokerSecurity(...))`` (or ``security=True``): the same broker with its
  client listener on SASL_SSL instead of PLAINTEXT — a self-signed CA and broker keystore made with
  ``keytool``, PLAIN and SCRAM-SHA-256/512 users, the StandardAuthorizer with deny-by-default and
  the ACLs of ``streams.kafka_security.switchyard_acls()`` (see ``docs/security.md``);
* the CLI::

    python -m streams.broker run [--data-dir D] [--port P] [--security]  # prints KAFKA_BOOTSTRAP_SERVERS=...
    python -m streams.broker fetch                                      # only resolve/cache the jars

Needs Java 17+ on PATH (or ``$JAVA_HOME``; ``keytool`` from the same JDK for ``security``) and
Maven for the first fetch.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import concurrent.futures
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.0.0"
POM = Path(__file__).resolve().parents[1] / "broker" / "pom.xml"
MARKER = ".switchyard-complete"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0

LOG4J2 = """\
status = warn
shutdownHook = disable
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
"""


class KafkaStartError(RuntimeError):
    """The broker (or storage format) failed or did not become ready in time."""


def kafka_home() -> Path:
    env = os.environ.get("SWITCHYARD_KAFKA_HOME")
    return Path(env) if env else Path.home() / ".cache" / "switchyard" / f"kafka-{KAFKA_VERSION}"


def ensure_jars(home: Path | None = None) -> Path:
    """Return the directory of Kafka's runtime jars, running Maven once if needed."""
    libs = (home or kafka_home()) / "libs"
    if (libs / MARKER).exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaStartError(f"Maven (mvn) not found on PATH; needed once to fetch Kafka jars into {libs}")
    libs.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="libs-", dir=libs.parent))  # rename into place: atomic, race-safe
    t0 = time.monotonic()
    cmd = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
           f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KafkaStartError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    (tmp / MARKER).write_text("\n".join(sorted(p.name for p in tmp.glob("*.jar"))) + "\n")
    try:
        tmp.rename(libs)
    except OSError:  # another process won the race (or a stale dir without marker is in the way)
        if not (libs / MARKER).exists():
            shutil.rmtree(libs, ignore_errors=True)
            tmp.rename(libs)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("fetched Kafka %s jars into %s in %.1fs", KAFKA_VERSION, libs, time.monotonic() - t0)
    return libs


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise KafkaStartError("java not found (install Java 17+ or set JAVA_HOME)")
    return java


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cluster_id() -> str:
    """Like Kafka's Uuid.randomUuid(): 16 random bytes, base64url, no padding, no leading '-'."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _run_sync(coro):
    """Run a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# --- security: SASL_SSL ----------------------------------------------------------------------------
DEFAULT_USERS = ("admin", "provider", "gateway", "operator", "worker")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SECURITY_DIR = "security"
ENV_MECHANISM = "SCRAM-SHA-512"  # what the <user>.env files say; every mechanism works for every user
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
# Kafka's wire codes (org.apache.kafka.common.acl / resource)
_RESOURCE_TYPES = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4, "TRANSACTIONAL_ID": 5}
_PATTERNS = {"LITERAL": 3, "PREFIXED": 4}
_OPERATIONS = {"ALL": 2, "READ": 3, "WRITE": 4, "CREATE": 5, "DELETE": 6, "ALTER": 7, "DESCRIBE": 8,
               "CLUSTER_ACTION": 9, "DESCRIBE_CONFIGS": 10, "ALTER_CONFIGS": 11, "IDEMPOTENT_WRITE": 12}
_ALLOW = 3
_ANY = 1


@dataclass
class BrokerSecurity:
    """SASL_SSL settings for a ``LocalKafka``.

    ``users`` maps SASL user names to passwords; each of DEFAULT_USERS (and ``admin``) missing from
    it gets a random password. Every user can log in with PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512.
    ``admin`` is the super user; the broker itself logs in as it on its inter-broker and controller
    listeners. ``acls`` are the ALLOW rules created after every start (idempotent); None means
    ``streams.kafka_security.switchyard_acls(topic_prefix, app_id)``. Names and passwords are
    limited to letters, digits, ``_ . -`` (they go into JAAS strings and StorageTool arguments).
    """

    users: dict[str, str] = field(default_factory=dict)
    admin: str = "admin"
    acls: Sequence | None = None
    topic_prefix: str = ""
    app_id: str = "switchyard"

    def rules(self) -> list:
        if self.acls is not None:
            return list(self.acls)
        from .kafka_security import switchyard_acls

        return switchyard_acls(self.topic_prefix, self.app_id)


def _keytool() -> str:
    java_home = os.environ.get("JAVA_HOME")
    tool = str(Path(java_home) / "bin" / "keytool") if java_home else shutil.which("keytool")
    if not tool or not Path(tool).exists():
        raise KafkaStartError("keytool not found (comes with the JDK; install Java 17+ or set JAVA_HOME)")
    return tool


def _run_all(*cmds: list[str]) -> None:
    """Run commands in parallel; raise if any fails."""
    procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in cmds]
    failed = []
    for cmd, proc in zip(cmds, procs):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{out}")
    if failed:
        raise KafkaStartError("\n".join(failed))


def make_certificates(directory: Path, store_password: str) -> None:
    """A self-signed CA and a broker key pair signed by it, with keytool (EC P-256, 10 years).

    Writes ``ca.p12`` (the CA's key; nothing else needs it), ``ca.pem`` (the CA certificate, for
    clients' ``KAFKA_SSL_CAFILE`` and the broker's PEM trust store) and ``broker.p12`` (PKCS12
    keystore: the broker key with the chain broker → CA; the certificate names IP 127.0.0.1 and
    DNS localhost, so clients verify the host name)."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    # C1 compilation only: keytool runs ~2x faster on start-up-bound work.
    kt = [_keytool(), "-J-XX:TieredStopAtLevel=1", "-storetype", "PKCS12", "-storepass", store_password,
          "-keypass", store_password]
    san = "SAN=IP:127.0.0.1,DNS:localhost"
    key = ["-keyalg", "EC", "-groupname", "secp256r1", "-validity", "3650"]
    _run_all([*kt, "-genkeypair", "-alias", "ca", *key, "-dname", "CN=Switchyard local CA",
              "-ext", "bc:c", "-keystore", str(d / "ca.p12")],
             [*kt, "-genkeypair", "-alias", "broker", *key, "-dname", "CN=127.0.0.1", "-ext", san,
              "-keystore", str(d / "broker.p12")])
    _run_all([*kt, "-exportcert", "-rfc", "-alias", "ca", "-keystore", str(d / "ca.p12"), "-file", str(d / "ca.pem")],
             [*kt, "-certreq", "-alias", "broker", "-keystore", str(d / "broker.p12"), "-file", str(d / "broker.csr")])
    _run_all([*kt, "-gencert", "-alias", "ca", "-keystore", str(d / "ca.p12"), "-infile", str(d / "broker.csr"),
              "-outfile", str(d / "broker.crt"), "-rfc", "-validity", "3650", "-ext", san,
              "-ext", "KU=digitalSignature,keyEncipherment,keyAgreement", "-ext", "EKU=serverAuth,clientAuth"])
    (d / "broker-chain.pem").write_text((d / "broker.crt").read_text() + (d / "ca.pem").read_text())
    _run_all([*kt, "-importcert", "-noprompt", "-alias", "broker", "-file", str(d / "broker-chain.pem"),
              "-keystore", str(d / "broker.p12")])
    for tmp in ("broker.csr", "broker-chain.pem"):
        (d / tmp).unlink()
    for private in ("ca.p12", "broker.p12"):
        os.chmod(d / private, 0o600)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # also when the file existed with wider permissions


def _check_name(kind: str, value: str) -> None:
    if not value or not set(value) <= _SAFE:
        raise ValueError(f"SASL {kind} {value!r}: use letters, digits, '_', '.', '-' only")


class LocalKafka:
    """A single-node KRaft Kafka broker in a child JVM, bound to 127.0.0.1.

    ``with LocalKafka() as kafka: ... kafka.bootstrap ...``. A temporary data dir is
    removed on ``stop()``; a given ``data_dir`` is kept (and reused if already formatted).

    ``security`` (a ``BrokerSecurity``, or True for the defaults) turns the client listener into
    SASL_SSL (no PLAINTEXT listener at all) with deny-by-default ACLs; ``client_security(user)``
    gives a client's settings, ``ca_file`` the CA certificate. Without it the broker is exactly
    the plain one: PLAINTEXT, no authorizer.
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, port: int | None = None,
                 *, heap: str = "512m", ready_timeout: float = READY_TIMEOUT_S,
                 home: str | os.PathLike | None = None, security: "BrokerSecurity | bool | None" = None,
                 auto_create_topics: bool = True):
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._auto_create = auto_create_topics  # off as on most production clusters
        self._port = port
        self._heap = heap
        self._ready_timeout = ready_timeout
        self._home = Path(home) if home is not None else None
        self.data_dir: Path | None = None
        self.port: int | None = None
        self.controller_port: int | None = None
        self.start_seconds: float | None = None  # last start: format (if any) + launch + ready
        self._proc: subprocess.Popen | None = None
        self.security: BrokerSecurity | None = (
            BrokerSecurity() if security is True else (security or None))
        if self.security is not None:
            for name, password in self.security.users.items():
                _check_name("user name", name)
                _check_name("password", password)
            _check_name("user name", self.security.admin)
        self.users: dict[str, str] = {}  # SASL user -> password, once started with security
        self._store_password: str | None = None

    # -- public API -----------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalKafka not started")
        return f"127.0.0.1:{self.port}"

    @property
    def protocol(self) -> str:
        """The client listener's security protocol: PLAINTEXT, or SASL_SSL with ``security``."""
        return "SASL_SSL" if self.security is not None else "PLAINTEXT"

    @property
    def security_dir(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / SECURITY_DIR

    @property
    def ca_file(self) -> Path:
        """PEM CA certificate that signed the broker's certificate (clients' KAFKA_SSL_CAFILE)."""
        if self.security is None:
            raise RuntimeError("LocalKafka runs without security: no CA")
        return self.security_dir / "ca.pem"

    def client_security(self, user: str | None = None, mechanism: str = "PLAIN", *,
                        password: str | None = None):
        """A ``streams.kafka_security.KafkaSecurity`` for ``user`` (default: the admin) on this
        broker: SASL_SSL with the CA file; ``password`` overrides the user's (to test refusals).
        Without ``security``: PLAINTEXT."""
        from .kafka_security import KafkaSecurity

        if self.security is None:
            return KafkaSecurity()
        if not self.users:
            raise RuntimeError("LocalKafka not started")
        user = user or self.security.admin
        if password is None:
            if user not in self.users:
                raise KeyError(f"no SASL user {user!r} on this broker (users: {', '.join(sorted(self.users))})")
            password = self.users[user]
        return KafkaSecurity("SASL_SSL", mechanism, user, password, str(self.ca_file))

    def client_env(self, user: str | None = None, mechanism: str = "PLAIN") -> dict[str, str]:
        """KAFKA_BOOTSTRAP_SERVERS plus the KAFKA_* security variables for ``user``."""
        return {"KAFKA_BOOTSTRAP_SERVERS": self.bootstrap, **self.client_security(user, mechanism).env()}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_file(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "broker.log"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "LocalKafka":
        if self.running():
            raise RuntimeError("LocalKafka already running")
        t0 = time.monotonic()
        libs = ensure_jars(self._home)
        if self.data_dir is None:
            self.data_dir = self._given_dir or Path(tempfile.mkdtemp(prefix="switchyard-kafka-"))
            self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port, self.controller_port = (
                [self._port, _free_ports(1)[0]] if self._port else _free_ports(2))
        if self.security is not None:
            self._prepare_security()
        self._write_config()
        t1 = time.monotonic()
        formatted = self._format(libs)
        t2 = time.monotonic()
        self._launch(libs)
        atexit.register(self._kill_at_exit)
        self._wait_ready()
        t3 = time.monotonic()
        if self.security is not None:
            try:
                _run_sync(self._create_acls(self.security.rules()))
            except BaseException:
                self._stop_process()
                raise
        t4 = time.monotonic()
        self.start_seconds = t4 - t0
        log.info("Kafka %s ready at %s (%s) in %.1fs (jars+config%s %.1fs, format %s, launch+ready %.1fs%s), "
                 "data %s", KAFKA_VERSION, self.bootstrap, self.protocol, self.start_seconds,
                 "+certificates" if self.security is not None else "", t1 - t0,
                 f"{t2 - t1:.1f}s" if formatted else "skipped", t3 - t2,
                 f", ACLs {t4 - t3:.1f}s" if self.security is not None else "", self.data_dir)
        return self

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        self._stop_process()
        if self.data_dir is not None and self._given_dir is None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None
            self.port = self.controller_port = None

    def restart(self) -> None:
        """Stop the process and start it again with the same data dir and ports."""
        self._stop_process()
        self.start()

    def __enter__(self) -> "LocalKafka":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------
    def _write_config(self) -> None:
        d = self.data_dir
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(d / "logs"),
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true" if self._auto_create else "false",
            "num.partitions": "1",
            # A restarted broker is refused (DUPLICATE_BROKER_REGISTRATION) until its previous
            # incarnation's session expires: 9 s by default, which made restart() take ~14 s.
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
            # This broker shares a small machine with its clients (tests, the demo, benchmarks): 2
            # network and 2 request-handler threads, not 3 and 8 (with the parallel collector, see
            # `_java_cmd`: 12-15 % less broker CPU and shorter hops; docs/benchmarks.md, "seventh").
            "num.network.threads": "2",
            "num.io.threads": "2",
        }
        if self.security is None:
            (d / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        else:  # holds passwords: owner-only
            props.update(self._security_props())
            _write_private(d / "server.properties", "".join(f"{k}={v}\n" for k, v in props.items()))
        (d / "log4j2.properties").write_text(LOG4J2)

    def _security_props(self) -> dict[str, str]:
        """One SASL_SSL listener for clients and the broker itself (inter-broker, as the admin with
        PLAIN); the controller listener on SASL_PLAINTEXT (loopback only, admin with PLAIN);
        StandardAuthorizer, deny unless an ACL allows, the admin a super user."""
        sec, admin = self.security_dir, self.security.admin
        admin_login = f'username="{admin}" password="{self.users[admin]}"'
        plain = "org.apache.kafka.common.security.plain.PlainLoginModule required"
        scram = f"org.apache.kafka.common.security.scram.ScramLoginModule required {admin_login};"
        all_users = " ".join(f'user_{name}="{pw}"' for name, pw in sorted(self.users.items()))
        return {
            "listeners": f"SASL_SSL://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{self.port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": ",".join(SASL_MECHANISMS),
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            # PLAIN users live in the JAAS config (this file: mode 0600); SCRAM users in the
            # cluster metadata, added when the storage is formatted (KRaft).
            "listener.name.sasl_ssl.plain.sasl.jaas.config": f"{plain} {admin_login} {all_users};",
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config": scram,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": scram,
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                f'{plain} {admin_login} user_{admin}="{self.users[admin]}";',
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(sec / "broker.p12"),
            "ssl.keystore.password": self._store_password,
            "ssl.key.password": self._store_password,
            "ssl.truststore.type": "PEM",  # the broker's own client side (inter-broker) trusts our CA
            "ssl.truststore.location": str(sec / "ca.pem"),
            "ssl.client.auth": "none",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{admin}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _prepare_security(self) -> None:
        """Certificates and passwords: made once per data dir, reused (and checked) afterwards."""
        sec, wanted = self.security_dir, self.security
        stored_file = sec / "secrets.json"
        if stored_file.exists():
            stored = json.loads(stored_file.read_text())
            users = stored["users"]
            for name, password in wanted.users.items():
                if users.get(name) != password:
                    raise KafkaStartError(
                        f"SASL user {name!r} is not in {stored_file} with that password; SCRAM users are "
                        "fixed when the storage is formatted: use a new data dir")
            if wanted.admin not in users:
                raise KafkaStartError(f"admin user {wanted.admin!r} is not in {stored_file}")
            self._store_password = stored["store_password"]
        else:
            if (self.data_dir / "logs" / "meta.properties").exists():
                raise KafkaStartError(f"{self.data_dir} was formatted without security (no SCRAM users): "
                                      "use a new data dir")
            shutil.rmtree(sec, ignore_errors=True)  # a half-made one from an interrupted start
            users = {name: secrets.token_hex(16) for name in (*DEFAULT_USERS, wanted.admin)}
            users.update(wanted.users)
            self._store_password = secrets.token_hex(16)
            make_certificates(sec, self._store_password)
            os.chmod(sec, 0o700)
            _write_private(stored_file, json.dumps(
                {"store_password": self._store_password, "users": users}, indent=2, sort_keys=True) + "\n")
        self.users = dict(users)
        for name in users:  # `set -a; . security/worker.env; set +a` gives a shell these settings
            env = self.client_env(name, ENV_MECHANISM)
            _write_private(sec / f"{name}.env", "".join(f"{k}={v}\n" for k, v in env.items()))

    def _client_kwargs(self) -> dict:
        """aiokafka keyword arguments for the broker's own checks: the admin, or nothing."""
        return self.client_security().aiokafka_kwargs() if self.security is not None else {}

    async def _create_acls(self, acls: list) -> None:
        """Create the ALLOW rules (CreateAcls v1, one request; existing ones are left as they are)
        and wait until the broker's authorizer lists them all."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.protocol.admin import CreateAclsRequest_v1, DescribeAclsRequest
        from aiokafka.protocol.api import Request

        class CreateAcls(Request[CreateAclsRequest_v1]):
            API_KEY = 30

            def __init__(self, creations):
                self.creations = creations

            def build(self, request_struct_class):
                return request_struct_class(self.creations)

        acls = list(dict.fromkeys(acls))
        if not acls:
            return
        creations = [(_RESOURCE_TYPES[a.resource_type], a.resource_name, _PATTERNS[a.pattern], a.principal,
                      "*", _OPERATIONS[a.operation], _ALLOW) for a in acls]
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10000,
                                    **self._client_kwargs())
        await admin.start()
        try:
            response = await admin._send_request(CreateAcls(creations))
            errors = [f"{acl}: error {code} {msg}" for acl, (code, msg) in zip(acls, response.creation_responses)
                      if code]
            if errors:
                raise KafkaStartError("creating ACLs failed:\n" + "\n".join(errors))
            deadline = time.monotonic() + 30
            while True:
                listed = await admin._send_request(DescribeAclsRequest(_ANY, None, _ANY, None, None, _ANY, _ANY))
                count = sum(len(resource[3]) for resource in listed.resources)
                if count >= len(acls):
                    return
                if time.monotonic() > deadline:
                    raise KafkaStartError(f"the broker lists {count} ACLs, expected at least {len(acls)}")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()

    def _java_cmd(self, libs: Path, *args: str, heap: str | None = None) -> list[str]:
        # The broker itself (given a heap): the parallel collector, not G1 and its concurrent threads.
        mem = [f"-Xmx{heap}", "-Xms256m", "-XX:+UseParallelGC"] if heap else []
        return [_java(), *mem, "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp", f"{libs}/*", *args]

    def _format(self, libs: Path) -> bool:
        if (self.data_dir / "logs" / "meta.properties").exists():
            return False
        cmd = self._java_cmd(libs, "kafka.tools.StorageTool", "format", "-t", _cluster_id(),
                             "-c", str(self.data_dir / "server.properties"))
        if self.security is not None:  # KRaft: SCRAM credentials go into the initial metadata
            for name, password in sorted(self.users.items()):
                for mechanism in SCRAM_MECHANISMS:
                    cmd += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            out = f"{proc.stdout}{proc.stderr}"
            for password in self.users.values():  # the command line held them; the error need not
                out = out.replace(password, "***")
            raise KafkaStartError(f"kafka storage format failed ({proc.returncode}):\n{out}")
        return True

    def _launch(self, libs: Path) -> None:
        cmd = self._java_cmd(libs, "kafka.Kafka", str(self.data_dir / "server.properties"), heap=self._heap)
        with open(self.log_file, "ab") as out:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          cwd=self.data_dir, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout
        try:
            _run_sync(self._poll_ready(deadline))
        except BaseException:
            self._stop_process()
            raise

    async def _poll_ready(self, deadline: float) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        while True:
            if self._proc.poll() is not None:
                raise KafkaStartError(f"Kafka exited with code {self._proc.returncode} during start-up\n{self._tail()}")
            if time.monotonic() > deadline:
                raise KafkaStartError(f"Kafka not ready after {self._ready_timeout:.0f}s\n{self._tail()}")
            if _port_open(self.port):  # avoid aiokafka's error logs while nothing listens yet
                admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000,
                                            **self._client_kwargs())
                try:
                    await admin.start()
                    if (await admin.describe_cluster())["brokers"]:  # empty until the broker is unfenced
                        return
                except Exception as err:  # noqa: BLE001 - not ready yet
                    log.debug("Kafka not ready yet: %r", err)
                finally:
                    await admin.close()
            await asyncio.sleep(0.2)

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        atexit.unregister(self._kill_at_exit)
        if proc is None or proc.poll() is not None:
            return
        t0 = time.monotonic()
        self._signal(proc, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("Kafka (pid %d) ignored SIGTERM for %.0fs; killing it", proc.pid, STOP_TIMEOUT_S)
            self._signal(proc, signal.SIGKILL)
            proc.wait()
        log.info("Kafka stopped in %.1fs (exit %s)", time.monotonic() - t0, proc.returncode)

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # own session: pgid == pid
        except ProcessLookupError:
            pass

    def _kill_at_exit(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal(self._proc, signal.SIGKILL)

    def _tail(self, lines: int = 40) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no broker log)"
        return f"--- last {len(text)} lines of {self.log_file} ---\n" + "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.broker", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="start a broker, print KAFKA_BOOTSTRAP_SERVERS=..., block until Ctrl-C/SIGTERM")
    run.add_argument("--data-dir", help="keep data here (default: a temp dir removed on exit)")
    run.add_argument("--port", type=int, help="broker port on 127.0.0.1 (default: a free one)")
    run.add_argument("--security", action="store_true",
                     help="SASL_SSL listener with TLS, SASL users and deny-by-default ACLs (docs/security.md)")
    run.add_argument("--topic-prefix", default="", help="with --security: the workers' SWITCHYARD_TOPIC_PREFIX")
    run.add_argument("--app-id", default="switchyard", help="with --security: the workers' SWITCHYARD_APP_ID")
    sub.add_parser("fetch", help="only resolve and cache the Kafka jars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.cmd == "fetch":
        print(ensure_jars())
        return 0

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        security = BrokerSecurity(topic_prefix=args.topic_prefix, app_id=args.app_id) if args.security else None
        with LocalKafka(args.data_dir, args.port, security=security) as kafka:
            print(f"KAFKA_BOOTSTRAP_SERVERS={kafka.bootstrap}", flush=True)
            if security is not None:
                print(f"KAFKA_SECURITY_PROTOCOL={kafka.protocol}\nKAFKA_SSL_CAFILE={kafka.ca_file}\n"
                      f"# users {', '.join(sorted(kafka.users))}: passwords in {kafka.security_dir / 'secrets.json'}; "
                      f"per user: set -a; . {kafka.security_dir}/<user>.env; set +a", flush=True)
            code = kafka._proc.wait()
            log.error("Kafka exited unexpectedly with code %s\n%s", code, kafka._tail())
            return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
