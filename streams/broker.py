"""A real single-node Apache Kafka broker on loopback, without Docker.

This module owns the local broker used by tests and development:

* resolving Kafka's jars from Maven Central (``broker/pom.xml``) into a cache
  directory, once (``$SWITCHYARD_KAFKA_HOME`` or ``~/.cache/switchyard/kafka-4.0.0``);
* ``LocalKafka``: writes a KRaft ``server.properties`` (combined broker+controller,
  node 1, replication factor 1) into a data dir, formats storage, runs
  ``kafka.Kafka`` as a child process and waits until a metadata request
  returns the broker; ``stop()`` and ``restart()`` (same ports, same data);
* the CLI::

    python -m streams.broker run [--data-dir D] [--port P]   # prints KAFKA_BOOTSTRAP_SERVERS=...
    python -m streams.broker fetch                           # only resolve/cache the jars

Needs Java 17+ on PATH (or ``$JAVA_HOME``) and Maven for the first fetch.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import concurrent.futures
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

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


class LocalKafka:
    """A single-node KRaft Kafka broker in a child JVM, bound to 127.0.0.1.

    ``with LocalKafka() as kafka: ... kafka.bootstrap ...``. A temporary data dir is
    removed on ``stop()``; a given ``data_dir`` is kept (and reused if already formatted).
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, port: int | None = None,
                 *, heap: str = "512m", ready_timeout: float = READY_TIMEOUT_S,
                 home: str | os.PathLike | None = None):
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._port = port
        self._heap = heap
        self._ready_timeout = ready_timeout
        self._home = Path(home) if home is not None else None
        self.data_dir: Path | None = None
        self.port: int | None = None
        self.controller_port: int | None = None
        self.start_seconds: float | None = None  # last start: format (if any) + launch + ready
        self._proc: subprocess.Popen | None = None

    # -- public API -----------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalKafka not started")
        return f"127.0.0.1:{self.port}"

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
        self._write_config()
        t1 = time.monotonic()
        formatted = self._format(libs)
        t2 = time.monotonic()
        self._launch(libs)
        atexit.register(self._kill_at_exit)
        self._wait_ready()
        t3 = time.monotonic()
        self.start_seconds = t3 - t0
        log.info("Kafka %s ready at %s in %.1fs (jars+config %.1fs, format %s, launch+ready %.1fs), data %s",
                 KAFKA_VERSION, self.bootstrap, self.start_seconds, t1 - t0,
                 f"{t2 - t1:.1f}s" if formatted else "skipped", t3 - t2, self.data_dir)
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
            "auto.create.topics.enable": "true",
            "num.partitions": "1",
            # A restarted broker is refused (DUPLICATE_BROKER_REGISTRATION) until its previous
            # incarnation's session expires: 9 s by default, which made restart() take ~14 s.
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
        }
        (d / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (d / "log4j2.properties").write_text(LOG4J2)

    def _java_cmd(self, libs: Path, *args: str, heap: str | None = None) -> list[str]:
        mem = [f"-Xmx{heap}", "-Xms256m"] if heap else []
        return [_java(), *mem, "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp", f"{libs}/*", *args]

    def _format(self, libs: Path) -> bool:
        if (self.data_dir / "logs" / "meta.properties").exists():
            return False
        cmd = self._java_cmd(libs, "kafka.tools.StorageTool", "format", "-t", _cluster_id(),
                             "-c", str(self.data_dir / "server.properties"))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KafkaStartError(f"kafka storage format failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
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
                admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000)
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
        with LocalKafka(args.data_dir, args.port) as kafka:
            print(f"KAFKA_BOOTSTRAP_SERVERS={kafka.bootstrap}", flush=True)
            code = kafka._proc.wait()
            log.error("Kafka exited unexpectedly with code %s\n%s", code, kafka._tail())
            return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
