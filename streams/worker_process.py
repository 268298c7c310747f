"""A Switchyard worker (`faust -A app worker`) run as a child process, for tests and the demo.

Owns starting one worker with its adapter environment (broker, data dir, app id, topic prefix, web
port), waiting until it is ready (log says so and `/metrics` answers), reading its `/metrics`, and
stopping it (SIGTERM to its process group, SIGKILL after a timeout). The worker's output goes to a
log file next to its data dir (`<datadir>.log`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`Worker(bootstrap, datadir, app_id, prefix, env).start()`; `.metrics()`, `.metric(name)`,
    `.stop()`. `env` adds to (and overrides) the parent's environment, e.g. EIGENINFERENCE_*."""

    def __init__(self, bootstrap: str, datadir: Path, app_id: str, prefix: str, env: dict | None = None):
        self.bootstrap, self.datadir, self.app_id, self.prefix = bootstrap, Path(datadir), app_id, prefix
        self.web_port = free_port()
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log = self.datadir.parent / f"{self.datadir.name}.log"

    def start(self, timeout: float = 90.0) -> "Worker":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        since = self.log.stat().st_size if self.log.exists() else 0  # the log is appended across runs
        env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, SWITCHYARD_DATADIR=str(self.datadir),
                   SWITCHYARD_APP_ID=self.app_id, SWITCHYARD_TOPIC_PREFIX=self.prefix,
                   SWITCHYARD_WEB_PORT=str(self.web_port), PYTHONPATH=str(ROOT))
        env.update(self.extra_env)
        with open(self.log, "ab") as log:
            command = [sys.executable, "-m", "faust", "-A", "app", "worker", "-l", "info", "--web-port",
                       str(self.web_port)]
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # own process group: a terminal's Ctrl-C does not reach it
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
            if b"ready" in self._log_from(since).lower():
                try:
                    self.metrics()
                    return self
                except OSError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"worker not ready in {timeout}s:\n{self.tail()}")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def _log_from(self, offset: int) -> bytes:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        prefix = f"{name}{{{labels}}}" if labels else name
        for line in self.metrics().splitlines():
            if line.startswith(prefix + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
