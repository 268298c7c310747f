"""Shared machinery of the fault tests (tests/faults): a load generator with its own thread and event
loop, worker helpers, and the checks every fault test ends with.

* `Load` — a small fleet that heartbeats steadily (registration, then one sequenced Heartbeat per
  box every `heartbeat_s`), a gateway sending RouteRequests at `rate` per second (each send retried
  until the broker acknowledges it, as a gateway would), a reader of the decisions topic that
  records every decision with its Kafka timestamp, and Completions for routed requests after a
  random service time (releasing the reservation). Plain aiokafka, Avro framed by `streams.codec`.
* `cpu_share` — a worker held to a share of one core (SIGSTOP/SIGCONT on a fixed period, as a CFS
  quota would), so a driver on the same two cores can offer it more than it decides.
* `check_decisions` — exactly one distinct decision per (request_id, attempt), plus the queue
  follow-up of a queued one; identical re-sent copies counted, not failures.
* `check_reservations` — distinct reservations by identity equal the routed decisions.
* `audit` — the decisions topic against a replay of the Kafka journal (`replay.audit.compare`).
* `live_router` / `replayed_router` — the worker's core state as its table changelog holds it, and
  the state a replay of the journal reaches; equal key by key when nothing was lost or doubled.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from replay.audit import by_identity, compare
from replay.run import decisions as replay_decisions, replay
from replay.sources import kafka_decisions, kafka_journal
from streams import codec
from streams.client import ensure_topics
from streams.core_store import CoreStore
from streams.persistence import snapshot
from streams.router import Router
from streams.worker_process import Worker
from tests.integration.kafka_io import changelog_items, read_topic

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = ROOT / "out" / "faults"
MODEL = "gpt-oss-20b"

Key = tuple[str, int]


def wall_ms() -> int:
    return int(time.time() * 1000)


def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def write_report(name: str, figures: dict) -> Path:
    """Measured figures as JSON under out/faults/ (generated output, not checked in)."""
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2, sort_keys=True, default=str) + "\n")
    print(f"\n{name}: {json.dumps(figures, sort_keys=True, default=str)}")
    return path


# === the fleet's events ===========================================================================
def registration(pid: str, decode_tps: float = 60.0) -> dict:
    return {"event_id": f"reg-{pid}-{wall_ms()}", "provider_id": pid, "registered_at_ms": wall_ms(),
            "version": "0.7.5", "trust_level": "hardware",
            "hardware": {"chip_name": "Apple M3 Max", "chip_family": "M3", "chip_tier": "Max",
                         "memory_gb": 64.0, "memory_bandwidth_gbs": 400.0, "gpu_cores": 40},
            "decode_tps": decode_tps, "models": [{"id": MODEL, "size_bytes": 12_000_000_000}]}


def heartbeat(pid: str, seq: int, running: int = 0) -> dict:
    return {"event_id": f"hb-{pid}-{seq}-{wall_ms()}", "provider_id": pid, "seq": seq, "sent_at_ms": wall_ms(),
            "status": "serving" if running else "idle", "warm_models": [MODEL],
            "system_metrics": {"memory_pressure": 0.2, "cpu_usage": 0.2, "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 13.0, "slots": [
                {"model": MODEL, "state": "running", "num_running": running, "max_concurrency": 8}]}}


# === the load generator ===========================================================================
class Load:
    """Fleet + gateway + decision reader on a background thread (its own asyncio loop).

    ``load = Load(bootstrap, prefix, rate=10).start()`` ... ``load.stop()``. Everything it records
    is plain lists/dicts, appended from the loop thread and read (copied) from the test's thread.
    """

    def __init__(self, bootstrap: str, prefix: str, *, providers: int = 6, heartbeat_s: float = 1.0,
                 rate: float = 10.0, complete_after: tuple[float, float] | None = (0.3, 1.5),
                 prompt: tuple[int, int] = (200, 2000), seed: int = 1, id_prefix: str = "r",
                 decode_tps: float = 60.0, linger_ms: int = 0):
        self.bootstrap, self.prefix = bootstrap, prefix
        self.n_providers, self.heartbeat_s, self.rate = providers, heartbeat_s, rate
        self.complete_after, self.prompt, self.id_prefix = complete_after, prompt, id_prefix
        self.decode_tps, self.linger_ms = decode_tps, linger_ms
        self.rng = random.Random(seed)
        self.topics = {n: prefix + "switchyard." + n for n in ("requests", "providers", "completions", "decisions")}
        # what happened
        self.requests: dict[Key, dict] = {}          # identity -> the request as sent
        self.accepted: dict[Key, float] = {}         # identity -> wall time the broker acknowledged it
        self.send_errors: Counter = Counter()        # exception type -> count (each one retried)
        self.decisions: list[tuple[int, float, dict]] = []   # (Kafka timestamp ms, received wall s, decision)
        self.completions: dict[Key, str] = {}        # identity -> provider, once acknowledged
        self.heartbeats = 0
        self.heartbeat_errors = 0
        self.first_routed: dict[Key, dict] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._n = 0

    # --- control from the test's thread ------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "Load":
        self._thread = threading.Thread(target=self._run, name="fault-load", daemon=True)
        self._thread.start()
        if not self.ready.wait(timeout):
            raise TimeoutError(f"load generator not ready in {timeout}s ({self.error!r})")
        if self.error is not None:
            raise RuntimeError("load generator failed") from self.error
        return self

    def set_rate(self, rate: float) -> None:
        self.rate = rate

    def stop(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(60)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("load generator failed") from self.error

    @property
    def pending_sends(self) -> int:
        return len(self.requests) - len(self.accepted)

    def decision_list(self) -> list[dict]:
        return [d for _, _, d in list(self.decisions)]

    def decision_times(self) -> list[int]:
        """Kafka timestamps (the worker's send time, ms) of every decision record, sorted."""
        return sorted(ts for ts, _, _ in list(self.decisions))

    def answered(self) -> set[Key]:
        """Identities with a final decision (routed or rejected)."""
        return {(d["request_id"], d["attempt"]) for _, _, d in list(self.decisions) if d["outcome"] != "queued"}

    def explain_missing(self, missing: set[Key]) -> str:
        """Why these requests have no decision: never acknowledged by the broker (the driver or the
        broker could not carry them) or acknowledged and not decided (lost by the router)."""
        acked = sum(k in self.accepted for k in missing)
        return (f"{len(missing)} unanswered: {len(missing) - acked} never acknowledged by the broker, "
                f"{acked} acknowledged; send errors {dict(self.send_errors)}; e.g. {sorted(missing)[:3]}")

    def wait_answered(self, timeout: float = 120.0) -> set[Key]:
        """Wait until every request sent so far was accepted and has its final decision."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            missing = set(self.requests) - self.answered()
            if not missing:
                return set()
            time.sleep(0.5)
        return set(self.requests) - self.answered()

    # --- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        await ensure_topics(self.bootstrap, self.topics.values())
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all",
                                         linger_ms=self.linger_ms, client_id="fault-load")
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                         enable_auto_commit=False, fetch_max_wait_ms=100,
                                         client_id="fault-decisions")
        await self.producer.start()
        await self.consumer.start()
        tasks: list[asyncio.Task] = []
        try:
            tp = TopicPartition(self.topics["decisions"], 0)
            self.consumer.assign([tp])
            self.consumer.seek(tp, 0)
            tasks.append(asyncio.create_task(self._read_decisions(tp)))
            for i in range(self.n_providers):
                pid = f"box-{i}"
                await self._send(self.topics["providers"], pid, "ProviderRegistered",
                                 registration(pid, self.decode_tps))
            for i in range(self.n_providers):
                tasks.append(asyncio.create_task(self._heartbeats(f"box-{i}", i / self.n_providers)))
            tasks.append(asyncio.create_task(self._requests()))
            self.ready.set()
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.consumer.stop()
            await self.producer.stop()

    async def _send(self, topic: str, key: str, name: str, record: dict, retry: bool = True) -> None:
        """Send until the broker acknowledges it (a gateway retries; the router dedups by id)."""
        value = codec.encode(name, record)
        while True:
            try:
                await self.producer.send_and_wait(topic, key=key.encode(), value=value)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - broker away: count and try again
                self.send_errors[type(e).__name__] += 1
                if not retry:
                    raise
                await asyncio.sleep(0.5)

    async def _heartbeats(self, pid: str, phase: float) -> None:
        await asyncio.sleep(phase * self.heartbeat_s)
        seq = 0
        while True:
            seq += 1
            try:
                await asyncio.wait_for(self._send(self.topics["providers"], pid, "Heartbeat",
                                                  heartbeat(pid, seq), retry=False), self.heartbeat_s * 5)
                self.heartbeats += 1
            except (Exception, asyncio.TimeoutError):  # noqa: BLE001 - the next beat replaces it
                self.heartbeat_errors += 1
            await asyncio.sleep(self.heartbeat_s)

    async def _requests(self) -> None:
        next_t = time.monotonic()
        while True:
            rate = self.rate
            now = time.monotonic()
            if rate <= 0:
                next_t = now
                await asyncio.sleep(0.05)
                continue
            if now < next_t:
                await asyncio.sleep(min(next_t - now, 0.05))
                continue
            while next_t <= now:
                self._n += 1
                rid = f"{self.id_prefix}{self._n}"
                req = {"request_id": rid, "attempt": 0, "model": MODEL,
                       "prompt_tokens": self.rng.randint(*self.prompt), "max_tokens": 256,
                       "sent_at_ms": wall_ms()}
                self.requests[(rid, 0)] = req
                asyncio.create_task(self._submit(req))
                next_t += 1.0 / rate
            if now - next_t > 1.0:  # far behind schedule (loop stalled): do not burst to catch up
                next_t = now

    async def _submit(self, req: dict) -> None:
        await self._send(self.topics["requests"], req["request_id"], "RouteRequest", req)
        self.accepted[(req["request_id"], req["attempt"])] = time.time()

    async def _read_decisions(self, tp: TopicPartition) -> None:
        while True:
            batch = await self.consumer.getmany(tp, timeout_ms=200, max_records=5000)
            now = time.time()
            for rec in batch.get(tp, []):
                try:
                    _, d = codec.decode_as(rec.value, "RouteDecision")
                except codec.CodecError:
                    continue
                self.decisions.append((rec.timestamp, now, d))
                key = (d["request_id"], d["attempt"])
                if d["outcome"] == "routed" and key not in self.first_routed:
                    self.first_routed[key] = d
                    if self.complete_after is not None:
                        delay = self.rng.uniform(*self.complete_after)
                        self._loop.call_later(delay, lambda d=d: asyncio.create_task(self._complete(d)))

    async def _complete(self, d: dict) -> None:
        rec = {"event_id": f"done-{d['request_id']}-{d['attempt']}", "request_id": d["request_id"],
               "attempt": d["attempt"], "provider_id": d["provider_id"], "model": d["model"],
               "status": "ok", "prompt_tokens": 1, "completion_tokens": 1, "ttft_ms": 400.0,
               "completed_at_ms": wall_ms()}
        await self._send(self.topics["completions"], d["provider_id"], "Completion", rec)
        self.completions[(d["request_id"], d["attempt"])] = d["provider_id"]


# === workers ======================================================================================
@contextlib.contextmanager
def cpu_share(worker: Worker, share: float, period_s: float = 0.1):
    """Hold the worker to `share` of every `period_s`: its process group runs `share × period_s`,
    then is stopped (SIGSTOP) for the rest of the period — at most that share of one core, as a CFS
    quota (a container's `cpus: 0.25`) gives it. The router's code and timing are untouched; it
    simply decides fewer requests per second, so a driver on the same two cores can offer it twice
    its rate. Always resumed (SIGCONT) on exit."""
    done = threading.Event()

    def run() -> None:
        start = time.monotonic()
        k = 0
        with contextlib.suppress(ProcessLookupError):  # the worker ended: nothing left to hold
            while not done.is_set():
                os.killpg(worker.proc.pid, signal.SIGCONT)
                done.wait(max(0.0, start + (k + share) * period_s - time.monotonic()))
                os.killpg(worker.proc.pid, signal.SIGSTOP)
                k += 1
                done.wait(max(0.0, start + k * period_s - time.monotonic()))

    thread = threading.Thread(target=run, name="cpu-share", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGCONT)


def restart(worker: Worker, timeout: float = 90.0) -> None:
    """Start a stopped worker again and wait for ITS "ready" (the log is appended across runs, so
    `Worker.start` alone can see the previous run's line)."""
    size = worker.log.stat().st_size if worker.log.exists() else 0
    worker.start(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(worker.log, "rb") as f:
            f.seek(size)
            if b"ready" in f.read().lower():
                return
        if not worker.running():
            raise RuntimeError(f"worker exited {worker.proc.returncode}:\n{worker.tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"worker not ready after restart in {timeout}s:\n{worker.tail()}")


def agent_crashes(worker: Worker) -> list[str]:
    """Faust agent crashes in the worker's log (Faust restarts a crashed agent after a pause, and
    the entry it was on loses its outputs): none may happen."""
    try:
        text = worker.log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if "Crashed reason=" in line]


def metric_sum(worker: Worker, name: str) -> float:
    """Sum of a metric over all its label sets (0 when the worker does not answer)."""
    try:
        text = worker.metrics()
    except OSError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.split()[-1])
    return total


def metric_by_labels(worker_or_text, name: str) -> dict[str, float]:
    """{'{label="v",...}': value} of a metric, from a worker or from /metrics text captured earlier."""
    text = worker_or_text if isinstance(worker_or_text, str) else worker_or_text.metrics()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def active_worker(workers: list[Worker], window: float = 1.5, timeout: float = 60.0) -> Worker:
    """The worker whose router applies journal entries (ticks arrive every second, so the active
    one's applied counter moves within `window`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = [metric_sum(w, "switchyard_journal_entries_applied_total") if w.running() else 0 for w in workers]
        time.sleep(window)
        after = [metric_sum(w, "switchyard_journal_entries_applied_total") if w.running() else 0 for w in workers]
        moving = [w for w, a, b in zip(workers, before, after) if b > a]
        if len(moving) == 1:
            return moving[0]
    raise AssertionError("no single active router found")


# === checks =======================================================================================
@dataclass
class DecisionCheck:
    identities: int = 0
    decisions: int = 0                      # records read, copies included
    duplicates: int = 0                     # identical re-sent copies
    outcomes: Counter = field(default_factory=Counter)
    queued_then: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_decisions(sent: set[Key], decisions: list[dict]) -> DecisionCheck:
    """Every sent identity: exactly one distinct final decision (routed/rejected), or `queued`
    followed by exactly one final one. Nothing decided that was not sent."""
    by, dups = by_identity(decisions)
    c = DecisionCheck(identities=len(by), decisions=len(decisions), duplicates=dups)
    for key in sent:
        ds = by.get(key, [])
        shape = [d["outcome"] for d in ds]
        if len(ds) == 1 and shape[0] in ("routed", "rejected"):
            c.outcomes[(ds[0]["outcome"], ds[0]["reason"])] += 1
        elif len(ds) == 2 and shape[0] == "queued" and shape[1] in ("routed", "rejected"):
            c.outcomes[("queued", None)] += 1
            c.queued_then[(ds[1]["outcome"], ds[1]["reason"])] += 1
        else:
            c.problems.append((key, [(d["outcome"], d["reason"], d["provider_id"]) for d in ds]))
    for key in set(by) - sent:
        c.problems.append((key, "decided but never sent"))
    return c


def reservations(bootstrap: str, prefix: str) -> list[dict]:
    return [codec.decode(r.value)[1] for r in read_topic(bootstrap, prefix + "switchyard.reservations", 30_000)]


def check_reservations(records: list[dict], decisions: list[dict]) -> dict:
    """Distinct reservations by identity equal the routed decisions (same provider); copies counted."""
    by, dups = by_identity(records)
    doubled = {k: v for k, v in by.items() if len(v) > 1}
    routed = {(d["request_id"], d["attempt"]): d["provider_id"] for d in decisions if d["outcome"] == "routed"}
    got = {k: v[0]["provider_id"] for k, v in by.items()}
    return {"distinct": len(by), "copies": dups, "doubled": len(doubled), "routed": len(routed),
            "lost": sorted(set(routed) - set(got))[:20], "unexpected": sorted(set(got) - set(routed))[:20],
            "wrong_provider": sorted(k for k in set(routed) & set(got) if routed[k] != got[k])[:20],
            "ok": not doubled and routed == got}


def trace_missing(bootstrap: str, prefix: str, app_id: str, missing: set[Key]) -> str:
    """Where each unanswered request stopped, for the failure message: its offsets in the requests
    topic and the journal, any decision for it, and the input positions the table holds."""
    ids = {rid for rid, _ in missing}

    def offsets(topic: str, name: str) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for r in read_topic(bootstrap, prefix + topic, 30_000):
            try:
                n, rec = codec.decode(r.value)
            except codec.CodecError:
                continue
            if n == name and rec.get("request_id") in ids:
                found.setdefault(rec["request_id"], []).append(r.offset)
        return found

    positions = CoreStore(changelog_items(read_topic(bootstrap, f"{app_id}-core-changelog", 60_000))).current().get("inputs")
    return (f"requests topic offsets {offsets('switchyard.requests', 'RouteRequest')}; "
            f"journal offsets {offsets('switchyard.journal', 'RouteRequest')}; "
            f"decisions offsets {offsets('switchyard.decisions', 'RouteDecision')}; "
            f"input positions in the table {positions}")


def journal(bootstrap: str, prefix: str) -> list:
    return list(kafka_journal(bootstrap, prefix + "switchyard.journal"))


def audit(bootstrap: str, prefix: str, entries: list | None = None):
    entries = journal(bootstrap, prefix) if entries is None else entries
    recorded = kafka_decisions(bootstrap, prefix + "switchyard.decisions")
    return compare(recorded, list(replay_decisions(entries)))


def replayed_router(entries: list, upto: int | None = None) -> Router:
    """The state a replay of the journal reaches (entries at offsets ≤ upto)."""
    router = Router()
    for entry, _ in replay((e for e in entries if upto is None or e.journal_offset <= upto), router=router):
        pass
    return router


def live_router(bootstrap: str, app_id: str) -> Router:
    """The worker's core state as its table changelog holds it (the deltas after the checkpoint
    re-applied: what `CoreStore.load` does on a takeover)."""
    return CoreStore(changelog_items(read_topic(bootstrap, f"{app_id}-core-changelog", 60_000))).load()[0]


def same_state(a: Router, b: Router) -> list[str]:
    """The keys whose values differ between two routers' snapshots, each with both values (empty
    when equal)."""
    sa, sb = json.loads(json.dumps(snapshot(a))), json.loads(json.dumps(snapshot(b)))
    return [f"{k!r}: {sa.get(k)!r} != {sb.get(k)!r}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
