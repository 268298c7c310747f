"""The demo: a real broker, a real worker, and a scripted closed-loop fleet routed through them.

    python -m streams.demo [--duration 120] [--rate 20] [--providers 24] [--seed 7]
                           [--report out/demo-report.md]

This module owns the demo end to end:

* infrastructure — a `LocalKafka` (unless $KAFKA_BOOTSTRAP_SERVERS is set) and one Faust worker
  child process (`streams.worker_process`) with a fresh data dir under `var/demo/<run>/`, a unique
  topic prefix and app id per run;
* the fleet — simulated Apple-silicon providers drawn from the seed (chips, memory, models, versions,
  trust as in domain §6), each with a TRUE solo decode and prefill rate, the load slowdown
  `decode = solo / (1 + 0.27·(batch − 1))`, an engine batch limit and a KV token budget it really
  enforces (work beyond either waits in the engine), heartbeating its real state every 2 s through
  `ProviderPublisher`;
* the gateway — Poisson arrivals through `GatewayClient` (lognormal prompts, p50 ≈ 1k, p90 ≈ 10k,
  cap 32k; max_tokens 256–1024; 60 % gpt-oss-20b, 40 % gemma), dispatch of routed requests to the
  chosen provider, Completions with the measured TTFT, queued requests awaited to their second
  decision;
* the live summary (every 2 s) and the Markdown report (plus a JSON twin) at the end.

Provider time runs faster than wall time (`--time-scale`, default 20): a request that would decode
for 20 s on a real Mac takes 1 s here, so a demo minute carries real traffic. Rates, TTFTs and
observed EWMAs are reported in model time (what a real provider would measure); the router's own
clock (journal time: queue waits, staleness) is wall time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from .client import GatewayClient, ProviderPublisher, make_producer
from .versions import compare_versions

K_LOAD = 0.27              # per-request decode = solo / (1 + K·(batch − 1))
EWMA_ALPHA = 0.3           # providers' observed-rate EWMA weight (domain §6.2)
HEARTBEAT_S = 2.0          # wall seconds between heartbeats
SUMMARY_S = 2.0            # wall seconds between live summaries
SIM_TICK_S = 0.02          # wall seconds between simulation steps
OS_RESERVED_GB = 8.0       # memory a box keeps for macOS and the provider process
KV_SHARE = 0.5             # share of the remaining memory the engine gives the KV cache
GB = 1e9

# Production settings the demo starts the worker with (domain §2.6.3: the production seed).
WORKER_SETTINGS = {"EIGENINFERENCE_MODEL_SOLO_TPS_SEED": "gemma-4-26b-qat-4bit=14,gpt-oss-20b=30"}


# === the fleet's ingredients =======================================================================
@dataclass(frozen=True)
class Chip:
    name: str
    family: str
    tier: str
    bandwidth_gbs: float      # public Apple figures (domain §6.1)
    memory_options: tuple     # GB
    gpu_cores: int
    gpt_oss_decode: float     # solo decode of gpt-oss-20b, tok/s
    prefill: float            # prefill of gpt-oss-20b, tok/s
    weight: float             # share in the fleet


CHIPS = (
    Chip("Apple M1 Max", "M1", "Max", 400.0, (32, 64), 32, 58.0, 1500.0, 0.20),
    Chip("Apple M2 Ultra", "M2", "Ultra", 800.0, (64, 128, 192), 76, 85.0, 2800.0, 0.12),
    Chip("Apple M3 Max", "M3", "Max", 400.0, (36, 48, 64, 128), 40, 68.0, 2200.0, 0.25),
    Chip("Apple M4 Pro", "M4", "Pro", 273.0, (24, 48, 64), 20, 45.0, 1400.0, 0.23),
    Chip("Apple M4 Max", "M4", "Max", 546.0, (36, 64, 128), 40, 93.0, 3000.0, 0.20),
)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    size_gb: float
    min_ram_gb: float
    kv_bytes_per_token: int
    decode_factor: float      # solo decode relative to gpt-oss-20b on the same chip
    prefill_factor: float
    share: float              # share of requests


GPT_OSS = ModelSpec("gpt-oss-20b", 12.8, 24.0, 24_576, 1.0, 1.0, 0.6)
GEMMA = ModelSpec("gemma-4-26b-qat-4bit", 15.6, 36.0, 100_000, 0.45, 0.6, 0.4)
MODELS = {m.id: m for m in (GPT_OSS, GEMMA)}


# === one simulated provider ========================================================================
@dataclass(eq=False)
class Job:
    request_id: str
    attempt: int
    model: str
    prompt: int
    max_tokens: int
    out_tokens: int           # what the model really generates (≤ max_tokens)
    dispatched: float         # model time (s)
    future: asyncio.Future
    admitted: float | None = None
    prefill_left: float = 0.0
    decoded: float = 0.0
    first_token: float | None = None

    @property
    def tokens(self) -> int:  # what the engine reserves: prompt + max output
        return self.prompt + self.max_tokens


@dataclass
class Served:
    status: str               # ok | capacity_rejected
    ttft_ms: float = 0.0
    completion_tokens: int = 0
    decode_tps: float = 0.0


@dataclass(eq=False)
class SimSlot:
    spec: ModelSpec
    solo_decode: float
    prefill: float
    grant_bytes: float        # v0.7.5: this engine's private KV grant
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    decode_ewma: float = 0.0
    prefill_ewma: float = 0.0
    served: int = 0


class SimProvider:
    """A Mac running the provider: engines (one slot per model) with a batch limit and a KV budget
    (v0.7.4: one box-wide pool every slot reports as its headroom; v0.7.5: private per-engine
    grants), prefill shared among the requests in prefill, decode slowed by the batch size."""

    def __init__(self, pid: str, chip: Chip, memory_gb: float, models: list[ModelSpec], version: str,
                 trust: str, rng: random.Random, benchmark: bool):
        self.pid, self.chip, self.memory_gb, self.version, self.trust = pid, chip, memory_gb, version, trust
        weights = sum(m.size_gb for m in models)
        self.weights_gb = weights
        self.kv_bytes = max(2.0, (memory_gb - OS_RESERVED_GB - weights) * KV_SHARE) * GB
        self.engine_batch = 8 if memory_gb >= 64 else 4
        self.slots: dict[str, SimSlot] = {}
        for m in models:
            self.slots[m.id] = SimSlot(
                spec=m, solo_decode=chip.gpt_oss_decode * m.decode_factor * rng.uniform(0.9, 1.1),
                prefill=chip.prefill * m.prefill_factor * rng.uniform(0.85, 1.15),
                grant_bytes=self.kv_bytes / len(models))
        first = self.slots[models[0].id]
        self.benchmark = (round(first.solo_decode, 1), round(first.prefill, 1)) if benchmark else (0.0, 0.0)
        self.refused = 0

    # --- capacity the engines enforce -----------------------------------------------------------
    @property
    def shared(self) -> bool:
        return compare_versions(self.version, "0.7.5") < 0

    def _used_bytes(self) -> float:
        return sum(j.tokens * s.spec.kv_bytes_per_token for s in self.slots.values() for j in s.running)

    def budget_max_tokens(self, slot: SimSlot) -> int:
        """The slot's active_token_budget_max as the engine reports it (floored at 1,024)."""
        rate = slot.spec.kv_bytes_per_token
        if self.shared:
            own = sum(j.tokens for j in slot.running)
            free = max(0.0, self.kv_bytes - self._used_bytes())
            return max(1024, own + int(free // rate))
        return max(1024, int(slot.grant_bytes // rate))

    def _fits(self, slot: SimSlot, job: Job) -> bool:
        if len(slot.running) >= self.engine_batch:
            return False
        rate = slot.spec.kv_bytes_per_token
        if self.shared:
            return self._used_bytes() + job.tokens * rate <= self.kv_bytes
        return sum(j.tokens for j in slot.running) * rate + job.tokens * rate <= slot.grant_bytes

    def _never_fits(self, slot: SimSlot, job: Job) -> bool:
        limit = self.kv_bytes if self.shared else slot.grant_bytes
        return job.tokens * slot.spec.kv_bytes_per_token > limit

    # --- work ---------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        slot = self.slots.get(job.model)
        if slot is None or self._never_fits(slot, job):
            self.refused += 1
            job.future.set_result(Served("capacity_rejected"))
            return
        job.prefill_left = float(job.prompt)
        slot.waiting.append(job)
        self._admit(job.dispatched)

    def _admit(self, now: float) -> None:
        for slot in self.slots.values():
            while slot.waiting and self._fits(slot, slot.waiting[0]):
                job = slot.waiting.popleft()
                job.admitted = now
                slot.running.append(job)

    @property
    def batch(self) -> int:
        return sum(len(s.running) for s in self.slots.values())

    def advance(self, t0: float, t1: float) -> None:
        """Move every running request from model time t0 to t1."""
        batch = self.batch
        if batch == 0 or t1 <= t0:
            return
        prefilling = sum(1 for s in self.slots.values() for j in s.running if j.prefill_left > 0)
        finished = False
        for slot in self.slots.values():
            decode = slot.solo_decode / (1 + K_LOAD * (batch - 1))
            prefill = slot.prefill / max(1, prefilling)
            for job in list(slot.running):
                start = max(t0, job.admitted)  # admitted between two steps: only its own share
                dt, spent = t1 - start, 0.0
                if dt <= 0:
                    continue
                if job.prefill_left > 0:
                    need = job.prefill_left / prefill
                    if need > dt:
                        job.prefill_left -= prefill * dt
                        continue
                    job.prefill_left, spent = 0.0, need
                    job.first_token = start + need
                job.decoded += decode * (dt - spent)
                if job.decoded >= job.out_tokens:
                    done_at = t1 - (job.decoded - job.out_tokens) / decode
                    self._finish(slot, job, done_at)
                    finished = True
        if finished:
            self._admit(t1)

    def _finish(self, slot: SimSlot, job: Job, done_at: float) -> None:
        slot.running.remove(job)
        slot.served += 1
        decode_s = max(1e-6, done_at - job.first_token)
        decode_tps = job.out_tokens / decode_s
        prefill_s = max(1e-6, job.first_token - job.admitted)
        prefill_tps = job.prompt / prefill_s
        a = EWMA_ALPHA
        slot.decode_ewma = decode_tps if slot.decode_ewma == 0 else a * decode_tps + (1 - a) * slot.decode_ewma
        slot.prefill_ewma = prefill_tps if slot.prefill_ewma == 0 else a * prefill_tps + (1 - a) * slot.prefill_ewma
        if not job.future.done():
            job.future.set_result(Served("ok", (job.first_token - job.dispatched) * 1000.0, job.out_tokens,
                                         decode_tps))

    # --- the wire ----------------------------------------------------------------------------------
    def registration(self) -> dict:
        return {"version": self.version, "trust_level": self.trust, "private_only": False,
                "hardware": {"chip_name": self.chip.name, "chip_family": self.chip.family,
                             "chip_tier": self.chip.tier, "memory_gb": float(self.memory_gb),
                             "memory_bandwidth_gbs": self.chip.bandwidth_gbs, "gpu_cores": self.chip.gpu_cores},
                "decode_tps": self.benchmark[0], "prefill_tps": self.benchmark[1],
                "models": [{"id": s.spec.id, "size_bytes": int(s.spec.size_gb * GB),
                            "min_ram_gb": s.spec.min_ram_gb, "is_vision": False} for s in self.slots.values()]}

    def heartbeat(self) -> dict:
        batch = self.batch
        kv_used_gb = self._used_bytes() / GB
        active_gb = self.weights_gb + kv_used_gb
        slots = []
        for s in self.slots.values():
            slots.append({
                "model": s.spec.id, "state": "running" if s.running else "idle",
                "num_running": len(s.running), "num_waiting": len(s.waiting),
                "max_concurrency": self.engine_batch,
                "active_tokens": int(sum(j.prompt + j.decoded for j in s.running)),
                "max_tokens_potential": sum(j.max_tokens for j in s.running),
                "observed_decode_tps": round(s.decode_ewma, 3),
                "observed_prefill_tps": round(s.prefill_ewma, 3),
                "active_token_budget_used": sum(j.tokens for j in s.running),
                "active_token_budget_max": self.budget_max_tokens(s),
                "queued_token_budget": sum(j.tokens for j in s.waiting),
                "kv_bytes_per_token": s.spec.kv_bytes_per_token, "model_load_time_ms": 6000.0})
        return {"status": "serving" if batch else "idle", "warm_models": list(self.slots),
                "system_metrics": {"memory_pressure": round(min(1.0, (OS_RESERVED_GB + active_gb) / self.memory_gb), 3),
                                   "cpu_usage": round(min(1.0, 0.05 + 0.08 * batch), 3),
                                   "thermal_state": "nominal" if batch < 6 else "fair"},
                "backend_capacity": {"total_memory_gb": float(self.memory_gb),
                                     "gpu_memory_active_gb": round(active_gb, 3),
                                     "free_for_load_gb": round(max(0.0, self.memory_gb * 0.75 - active_gb), 3),
                                     "slots": slots}}


def build_fleet(n: int, seed: int) -> list[SimProvider]:
    """n providers drawn from the seed. The first two are hardware-trusted and cover both models, so
    even a tiny fleet can serve every request."""
    rng = random.Random(f"fleet-{seed}")
    fleet = []
    for i in range(n):
        chip = rng.choices(CHIPS, weights=[c.weight for c in CHIPS])[0]
        memory = rng.choice(chip.memory_options)
        if i == 1 and memory < 36:
            memory = max(chip.memory_options)
            if memory < 36:
                chip, memory = CHIPS[2], 64
        if i == 0:
            models = [GPT_OSS]
        elif i == 1:
            models = [GEMMA]
        elif memory < 36:
            models = [GPT_OSS]
        else:
            r = rng.random()
            both_ok = memory >= 64
            models = [GPT_OSS] if r < 0.4 else [GEMMA] if r < 0.75 or not both_ok else [GPT_OSS, GEMMA]
        version = rng.choice(("0.7.4", "0.7.5"))
        trust = "hardware" if i < 2 or rng.random() < 0.88 else "self_signed"
        pid = f"{chip.family.lower()}{chip.tier.lower()}-{i:02d}"
        fleet.append(SimProvider(pid, chip, memory, models, version, trust, rng, benchmark=rng.random() < 0.33))
    return fleet


# === statistics ====================================================================================
def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def outcome_label(d: dict) -> str:
    return d["outcome"] if d["outcome"] in ("routed", "queued") else f"rejected:{d['reason']}"


@dataclass
class Stats:
    sent: int = 0
    first: Counter = field(default_factory=Counter)        # first decisions by label
    second: Counter = field(default_factory=Counter)       # queue follow-ups by label
    lost: int = 0                                          # no first decision in time
    abandoned: int = 0                                     # still in flight when the demo ended
    errors: Counter = field(default_factory=Counter)       # exceptions in the gateway, by type
    followup_lost: int = 0                                 # queued, no second decision in time
    latencies_ms: list = field(default_factory=list)       # publish → first decision
    queue_wait_ms: list = field(default_factory=list)      # queued → follow-up
    served: Counter = field(default_factory=Counter)       # provider → routed requests
    completed: Counter = field(default_factory=Counter)    # completion status → count
    ttft_ms: list = field(default_factory=list)            # measured, model time
    predicted_ratio: list = field(default_factory=list)    # measured / estimated TTFT
    decode_tps: list = field(default_factory=list)
    by_model: Counter = field(default_factory=Counter)
    window: deque = field(default_factory=deque)           # (wall time, latency ms) per decision

    def decision(self, latency_ms: float | None) -> None:
        self.window.append((time.monotonic(), latency_ms))

    def recent(self, seconds: float) -> list:
        cutoff = time.monotonic() - seconds
        while self.window and self.window[0][0] < cutoff - 60:
            self.window.popleft()
        return [x for x in self.window if x[0] >= cutoff]


def spread(served: Counter, fleet: list[SimProvider]) -> dict:
    counts = sorted((served.get(p.pid, 0) for p in fleet), reverse=True)
    total = sum(counts)
    top_n = max(1, round(len(fleet) * 0.1))
    routable = [p for p in fleet if p.trust == "hardware"]
    return {"top10_share": (sum(counts[:top_n]) / total) if total else 0.0, "top_n": top_n,
            "served_nothing": sum(1 for c in counts if c == 0),
            "routable_served_nothing": sum(1 for p in routable if served.get(p.pid, 0) == 0),
            "routable": len(routable), "total": total}


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("switchyard_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def queue_depth(metrics: dict[str, float]) -> dict[str, int]:
    out = {}
    for name, v in metrics.items():
        m = re.match(r'switchyard_queue_depth\{model="([^"]*)"\}', name)
        if m:
            out[m.group(1)] = int(v)
    return out


# === the run =======================================================================================
class Demo:
    def __init__(self, args, bootstrap: str, prefix: str, worker):
        self.args, self.bootstrap, self.prefix, self.worker = args, bootstrap, prefix, worker
        self.fleet = build_fleet(args.providers, args.seed)
        self.by_id = {p.pid: p for p in self.fleet}
        self.stats = Stats()
        self.scale = args.time_scale
        self.t_start = time.monotonic()
        self.stop = asyncio.Event()        # no more arrivals
        self.abort = asyncio.Event()       # a second Ctrl-C: skip the drain
        self.interrupted = False
        self.inflight: set[asyncio.Task] = set()
        self.awaiting_first = 0
        self.awaiting_queue = 0
        self.serving = 0
        self.metrics: dict[str, float] = {}
        self.metrics_text = ""
        self.load_seconds = 0.0
        self.load_start: float | None = None
        self.tty = sys.stdout.isatty()

    def model_now(self) -> float:
        return (time.monotonic() - self.t_start) * self.scale

    # --- signals --------------------------------------------------------------------------------
    def on_signal(self) -> None:
        if self.stop.is_set():
            self.abort.set()
        self.interrupted = True
        self.stop.set()

    # --- the fleet ------------------------------------------------------------------------------
    async def simulate(self) -> None:
        last = self.model_now()
        while True:
            await asyncio.sleep(SIM_TICK_S)
            now = self.model_now()
            for p in self.fleet:
                p.advance(last, now)
            last = now

    async def heartbeats(self, p: SimProvider, pub: ProviderPublisher, offset: float) -> None:
        await asyncio.sleep(offset)
        while True:
            try:
                await pub.heartbeat(p.heartbeat())
            except Exception as e:  # noqa: BLE001 - a lost heartbeat is survivable; say so
                print(f"heartbeat of {p.pid} failed: {e!r}", file=sys.stderr)
            await asyncio.sleep(HEARTBEAT_S)

    # --- the gateway ----------------------------------------------------------------------------
    async def arrivals(self, gw: GatewayClient) -> None:
        rng = random.Random(f"arrivals-{self.args.seed}")
        mu, sigma = math.log(1000), math.log(10) / 1.2816  # p50 1k, p90 10k
        t0 = self.load_start = time.monotonic()
        next_t, i = 0.0, 0
        while not self.stop.is_set():
            next_t += rng.expovariate(self.args.rate)
            if next_t >= self.args.duration:
                break
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, t0 + next_t - time.monotonic()))
                break
            except asyncio.TimeoutError:
                pass
            model = GPT_OSS if rng.random() < GPT_OSS.share else GEMMA
            prompt = int(min(32_768, max(16, round(rng.lognormvariate(mu, sigma)))))
            max_tokens = rng.randint(256, 1024)
            out = max(1, round(max_tokens * rng.uniform(0.4, 1.0)))
            task = asyncio.create_task(self.request(gw, f"r{i:06d}", model.id, prompt, max_tokens, out))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
            i += 1
        self.load_seconds = time.monotonic() - t0

    async def request(self, gw: GatewayClient, rid: str, model: str, prompt: int, max_tokens: int,
                      out: int) -> None:
        st = self.stats
        st.sent += 1
        st.by_model[model] += 1
        req = {"request_id": rid, "model": model, "prompt_tokens": prompt, "max_tokens": max_tokens}
        try:
            await self._request(gw, st, req, rid, model, prompt, max_tokens, out)
        except asyncio.CancelledError:
            st.abandoned += 1
            raise
        except Exception as e:  # noqa: BLE001 - count it and keep the demo going
            if not st.errors:
                print(f"request {rid} failed: {e!r}", file=sys.stderr)
            st.errors[type(e).__name__] += 1

    async def _request(self, gw, st, req, rid, model, prompt, max_tokens, out) -> None:
        self.awaiting_first += 1
        t0 = time.perf_counter()
        try:
            d = await gw.route(req, timeout=self.args.route_timeout)
        except asyncio.TimeoutError:
            st.lost += 1
            return
        finally:
            self.awaiting_first -= 1
        latency = (time.perf_counter() - t0) * 1000
        st.latencies_ms.append(latency)
        st.decision(latency)
        st.first[outcome_label(d)] += 1
        if d["outcome"] == "queued":
            self.awaiting_queue += 1
            tq = time.perf_counter()
            try:
                d = await gw.follow_up(rid, d["attempt"], timeout=self.args.queue_timeout)
            except asyncio.TimeoutError:
                st.followup_lost += 1
                return
            finally:
                self.awaiting_queue -= 1
            st.queue_wait_ms.append((time.perf_counter() - tq) * 1000)
            st.decision(None)
            st.second[outcome_label(d)] += 1
        if d["outcome"] != "routed":
            return
        provider = self.by_id.get(d["provider_id"])
        st.served[d["provider_id"]] += 1
        if provider is None:  # routed somewhere this demo does not run: release it
            await gw.complete({"request_id": rid, "attempt": d["attempt"], "provider_id": d["provider_id"],
                               "model": model, "status": "error"})
            return
        job = Job(rid, d["attempt"], model, prompt, max_tokens, out, self.model_now(),
                  asyncio.get_running_loop().create_future())
        self.serving += 1
        try:
            provider.submit(job)
            served: Served = await job.future
        finally:
            self.serving -= 1
        st.completed[served.status] += 1
        if served.status == "ok":
            st.ttft_ms.append(served.ttft_ms)
            st.decode_tps.append(served.decode_tps)
            if d["estimated_ttft_ms"] > 0:
                st.predicted_ratio.append(served.ttft_ms / d["estimated_ttft_ms"])
        await gw.complete({"request_id": rid, "attempt": d["attempt"], "provider_id": provider.pid,
                           "model": model, "status": served.status, "prompt_tokens": prompt,
                           "completion_tokens": served.completion_tokens, "ttft_ms": served.ttft_ms})

    # --- the screen -----------------------------------------------------------------------------
    async def refresh_metrics(self) -> None:
        try:
            self.metrics_text = await asyncio.to_thread(self.worker.metrics)
            self.metrics = parse_metrics(self.metrics_text)
        except Exception:  # noqa: BLE001 - the summary shows the last good figures
            pass

    def elapsed(self) -> float:
        return time.monotonic() - self.load_start if self.load_start is not None else 0.0

    def summary(self, final: bool = False) -> str:
        st, a = self.stats, self.args
        elapsed = self.elapsed()
        if final:
            window = self.load_seconds or elapsed or 1.0
            rate = (sum(st.first.values()) + sum(st.second.values())) / window
            lat, span = st.latencies_ms, "all"
        else:
            recent = st.recent(SUMMARY_S)
            rate = len(recent) / SUMMARY_S
            lat, span = [x[1] for x in recent if x[1] is not None], f"last {SUMMARY_S:g}s"
        sp = spread(st.served, self.fleet)
        outcomes = Counter(st.first)
        outcomes.update({f"queue→{k}": v for k, v in st.second.items()})
        qd = queue_depth(self.metrics)
        lines = [
            f"Switchyard demo  {elapsed:5.0f}s / {a.duration:.0f}s   arrivals {a.rate:g}/s   "
            f"{len(self.fleet)} providers   provider time ×{self.scale:g}",
            f"decisions/s   {rate:6.1f}{' (mean)' if final else ''}   sent {st.sent}   decided {sum(st.first.values())}   "
            f"lost {st.lost}",
            "outcomes      " + ("  ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "-"),
            f"latency       {span} p50 {percentile(lat, 50):6.1f} ms  p99 {percentile(lat, 99):6.1f} ms"
            + ("" if final else f"   all p50 {percentile(st.latencies_ms, 50):6.1f} ms  "
                                f"p99 {percentile(st.latencies_ms, 99):6.1f} ms"),
            f"spread        top {sp['top_n']} providers (10%) {sp['top10_share']:.0%} of traffic   "
            f"served nothing {sp['served_nothing']}/{len(self.fleet)} "
            f"({sp['routable_served_nothing']} of {sp['routable']} hardware-trusted)",
            f"queue depth   router {sum(qd.values())} "
            f"({', '.join(f'{m} {v}' for m, v in sorted(qd.items())) or '-'})   "
            f"gateway waiting {self.awaiting_queue}   routing {self.awaiting_first}   serving {self.serving}",
        ]
        if self.stop.is_set() and not final:
            lines.append("stopping: waiting for in-flight requests" +
                         (" (Ctrl-C again to skip)" if self.interrupted else ""))
        return "\n".join(lines)

    def one_line(self) -> str:
        st = self.stats
        recent = st.recent(SUMMARY_S)
        lat = [x[1] for x in recent if x[1] is not None]
        sp = spread(st.served, self.fleet)
        outcomes = Counter(st.first)
        outcomes.update({f"queue→{k}": v for k, v in st.second.items()})
        return (f"[{self.elapsed():4.0f}s] {len(recent) / SUMMARY_S:5.1f} decisions/s | "
                + " ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
                + f" lost {st.lost} | latency p50 {percentile(lat, 50):.1f} p99 {percentile(lat, 99):.1f} ms"
                f" | top10% {sp['top10_share']:.0%}, idle {sp['served_nothing']}/{len(self.fleet)}"
                f" | queue {sum(queue_depth(self.metrics).values())}")

    async def screen(self) -> None:
        """Every 2 s: the summary redrawn in place on a terminal, else one appended line."""
        while True:
            await asyncio.sleep(SUMMARY_S)
            await self.refresh_metrics()
            if self.tty:
                sys.stdout.write("\x1b[H\x1b[2J" + self.summary() + "\n")
            else:
                sys.stdout.write(self.one_line() + "\n")
            sys.stdout.flush()

    # --- the whole run --------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal)
        background: list[asyncio.Task] = []
        producer = make_producer(self.bootstrap)
        await producer.start()
        try:
            pubs = {p.pid: ProviderPublisher(self.bootstrap, p.pid, topic_prefix=self.prefix, producer=producer)
                    for p in self.fleet}
            for p in self.fleet:
                await pubs[p.pid].register(p.registration())
            rng = random.Random(f"heartbeats-{self.args.seed}")
            background.append(asyncio.create_task(self.simulate()))
            for p in self.fleet:
                background.append(asyncio.create_task(self.heartbeats(p, pubs[p.pid], rng.uniform(0, 0.5))))
            await self.wait_online()
            async with GatewayClient(self.bootstrap, topic_prefix=self.prefix) as gw:
                background.append(asyncio.create_task(self.screen()))
                await self.arrivals(gw)
                self.stop.set()
                await self.drain()
                for task in list(self.inflight):
                    task.cancel()
                await asyncio.gather(*self.inflight, return_exceptions=True)
            await asyncio.sleep(0.5)  # let the last completions reach the journal
            await self.refresh_metrics()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            background.clear()
            for p in self.fleet:
                await pubs[p.pid].disconnect("demo finished")
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await producer.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        sys.stdout.write(self.summary(final=True) + "\n")

    async def wait_online(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            online = self.metrics.get("switchyard_providers_online", 0)
            if online >= len(self.fleet):
                return
            await asyncio.sleep(0.25)
            await self.refresh_metrics()
        if not self.stop.is_set():
            raise RuntimeError(f"providers not online after {timeout:.0f}s (worker log: {self.worker.log})")

    async def drain(self) -> None:
        """After the last arrival: let in-flight requests finish (queued ones included)."""
        limit = self.args.drain if not self.interrupted else min(self.args.drain, 10.0)
        deadline = time.monotonic() + limit
        while self.inflight and time.monotonic() < deadline and not self.abort.is_set():
            await asyncio.sleep(0.1)


# === the report ====================================================================================
def fmt_ms(v: float) -> str:
    return "-" if v != v else f"{v:,.1f}"


def build_report(demo: Demo, info: dict) -> tuple[str, dict]:
    st, a = demo.stats, demo.args
    sp = spread(st.served, demo.fleet)
    decided = sum(st.first.values())
    routed = st.first.get("routed", 0) + st.second.get("routed", 0)
    load_s = demo.load_seconds or a.duration
    figures = {
        "run_id": info["run_id"], "sent": st.sent, "decided": decided, "lost": st.lost,
        "followups_missing": st.followup_lost, "abandoned": st.abandoned, "errors": dict(st.errors), "routed": routed, "first_decisions": dict(st.first),
        "queue_followups": dict(st.second), "completions": dict(st.completed),
        "decisions_per_s": (decided + sum(st.second.values())) / load_s if load_s else 0.0,
        "latency_ms": {q: percentile(st.latencies_ms, q) for q in (50, 90, 99)},
        "latency_max_ms": max(st.latencies_ms) if st.latencies_ms else float("nan"),
        "queue_wait_ms": {q: percentile(st.queue_wait_ms, q) for q in (50, 90, 99)},
        "ttft_ms": {q: percentile(st.ttft_ms, q) for q in (50, 90, 99)},
        "spread": sp, "served": {p.pid: st.served.get(p.pid, 0) for p in demo.fleet},
        "interrupted": demo.interrupted, "provider_refusals": sum(p.refused for p in demo.fleet),
    }
    nan_free = json.loads(json.dumps(figures, default=str).replace("NaN", "null"))

    L = []
    L.append(f"# Switchyard demo report — run {info['run_id']}\n")
    L.append(f"{info['started']} · {'ended early by Ctrl-C · ' if demo.interrupted else ''}"
             f"load for {load_s:.0f} s\n")
    L.append("A real Kafka broker and a real Switchyard worker (`faust -A app worker`) routed the requests of "
             "a simulated fleet. **Provider time is scaled ×{:g}**: a request that would run 20 s on a real "
             "Mac takes {:.1f} s here, so the demo carries real traffic in little time. TTFTs and decode "
             "rates below are in model time (what a provider would measure); decision latency, queue "
             "waits and the router's clock are wall time.\n".format(demo.scale, 20 / demo.scale))
    L.append("## Settings\n")
    L.append("| setting | value |\n|---|---|")
    for k, v in [("duration (s)", a.duration), ("arrival rate (req/s, Poisson)", a.rate),
                 ("providers", a.providers), ("seed", a.seed), ("time scale", demo.scale),
                 ("prompt tokens", "lognormal, p50 ≈ 1k, p90 ≈ 10k, 16–32,768"),
                 ("max_tokens", "uniform 256–1024; generated 40–100 % of it"),
                 ("models", "gpt-oss-20b 60 %, gemma-4-26b-qat-4bit 40 %"),
                 ("load factor k (decode slowdown)", K_LOAD), ("heartbeat", f"every {HEARTBEAT_S:g} s (wall)"),
                 ("broker", info["broker"]), ("topic prefix", f"`{demo.prefix}`"), ("worker app id", info["app_id"]),
                 ("worker data dir", f"`{info['datadir']}`")]:
        L.append(f"| {k} | {v} |")
    for k, v in sorted(info["worker_settings"].items()):
        L.append(f"| worker `{k}` | `{v}` |")
    L.append("")

    L.append("## Outcomes\n")
    L.append(f"- Requests sent: **{st.sent}**; decided: **{decided}**; "
             f"**lost requests (no decision within {a.route_timeout:g} s): {st.lost}**")
    L.append(f"- Routed (first decision or from the queue): **{routed}**; decisions/s: "
             f"**{figures['decisions_per_s']:.1f}**")
    L.append(f"- Queued requests whose second decision did not come in time: {st.followup_lost}; "
             f"requests still in flight when the demo ended: {st.abandoned}; gateway errors: "
             f"{dict(st.errors) or 0}")
    L.append(f"- Completions published: {dict(st.completed) or '-'}; requests a provider refused: "
             f"{figures['provider_refusals']}\n")
    L.append("| first decision | count |\n|---|---|")
    for k, v in sorted(st.first.items()):
        L.append(f"| {k} | {v} |")
    if st.second:
        L.append("\n| queued request's second decision | count |\n|---|---|")
        for k, v in sorted(st.second.items()):
            L.append(f"| {k} | {v} |")
    L.append("")

    L.append("## Latency\n")
    L.append("| measure | p50 | p90 | p99 |\n|---|---|---|---|")
    for name, values in [("decision latency, ms (request publish → decision received)", st.latencies_ms),
                         ("queue wait, ms (queued → second decision)", st.queue_wait_ms),
                         ("TTFT measured, ms (model time)", st.ttft_ms),
                         ("TTFT measured / estimated", st.predicted_ratio),
                         ("per-request decode, tok/s (model time)", st.decode_tps)]:
        L.append(f"| {name} | " + " | ".join(fmt_ms(percentile(values, q)) for q in (50, 90, 99)) + " |")
    L.append("")

    L.append("## Traffic spread\n")
    L.append(f"- Top 10 % of providers ({sp['top_n']}) took **{sp['top10_share']:.0%}** of routed requests")
    L.append(f"- Providers that served nothing: **{sp['served_nothing']} of {len(demo.fleet)}** "
             f"({sp['routable_served_nothing']} of the {sp['routable']} hardware-trusted; self-signed boxes are "
             f"below the default trust floor)\n")

    L.append("## Fleet\n")
    L.append("| provider | chip | GB | version | trust | models | solo decode tok/s | prefill tok/s | batch | "
             "KV budget (tokens) | served | observed decode EWMA |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in demo.fleet:
        slots = list(p.slots.values())
        L.append("| {} | {} | {:g} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            p.pid, p.chip.name.replace("Apple ", ""), p.memory_gb, p.version, p.trust,
            ", ".join(s.spec.id for s in slots), " / ".join(f"{s.solo_decode:.0f}" for s in slots),
            " / ".join(f"{s.prefill:,.0f}" for s in slots), p.engine_batch,
            " / ".join(f"{int((p.kv_bytes if p.shared else s.grant_bytes) // s.spec.kv_bytes_per_token):,}"
                       + (" shared" if p.shared and len(slots) > 1 else "") for s in slots),
            st.served.get(p.pid, 0), " / ".join(f"{s.decode_ewma:.1f}" for s in slots)))
    L.append("")

    L.append("## Worker /metrics at the end (switchyard_*, histogram buckets omitted)\n")
    L.append("```")
    lines = [ln for ln in demo.metrics_text.splitlines()
             if ln.startswith("switchyard_") and "_bucket{" not in ln and "_created" not in ln]
    L.extend(lines or ["(not available)"])
    L.append("```\n")
    L.append(f"Worker log: `{info['worker_log']}`\n")
    return "\n".join(L), nan_free


def write_report(demo: Demo, info: dict, path: Path) -> Path:
    text, figures = build_report(demo, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


# === command line ==================================================================================
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m streams.demo",
        description="Run Switchyard end to end: a local Kafka broker (unless $KAFKA_BOOTSTRAP_SERVERS is "
                    "set), one worker, and a simulated fleet of Apple-silicon providers with a gateway "
                    "sending Poisson traffic. Shows a live summary every 2 s and writes a Markdown report "
                    "(plus a .json twin). Ctrl-C ends early and still writes the report.")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of traffic (default 120)")
    ap.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second (default 20)")
    ap.add_argument("--providers", type=int, default=24, help="fleet size (default 24)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the fleet and the traffic (default 7)")
    ap.add_argument("--report", default="out/demo-report.md", help="report path (default out/demo-report.md)")
    ap.add_argument("--time-scale", type=float, default=20.0,
                    help="provider time runs this many times faster than wall time (default 20)")
    ap.add_argument("--workdir", default="var/demo", help="worker data dirs go under here (default var/demo)")
    ap.add_argument("--route-timeout", type=float, default=10.0,
                    help="seconds a request waits for its decision before it counts as lost (default 10)")
    ap.add_argument("--queue-timeout", type=float, default=45.0,
                    help="seconds a queued request waits for its second decision (default 45)")
    ap.add_argument("--drain", type=float, default=45.0,
                    help="seconds to let in-flight requests finish after the last arrival (default 45)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="an EIGENINFERENCE_* routing setting for the worker (repeat)")
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.rate <= 0 or args.providers < 2 or args.time_scale <= 0:
        ap.error("--duration, --rate and --time-scale must be positive and --providers at least 2")
    return args


def main(argv=None) -> int:
    from .broker import LocalKafka
    from .worker_process import Worker

    args = parse_args(argv)
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    tag = run_id.replace("-", "")
    prefix, app_id = f"demo{tag}.", f"switchyard-demo-{tag}"
    rundir = Path(args.workdir).resolve() / run_id
    settings = dict(WORKER_SETTINGS)
    for item in args.setting:
        name, _, value = item.partition("=")
        name = name if name.startswith("EIGENINFERENCE_") else "EIGENINFERENCE_" + name
        settings[name] = value
    report_path = Path(args.report)
    info = {"run_id": run_id, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "app_id": app_id,
            "datadir": str(rundir / "worker"), "worker_log": str(rundir / "worker.log"),
            "worker_settings": settings}

    broker = worker = demo = None
    code = 0
    try:
        external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if external:
            bootstrap = external
            info["broker"] = f"external, {external}"
        else:
            print("starting a local Kafka broker (first run fetches its jars with Maven) …", flush=True)
            broker = LocalKafka().start()
            bootstrap = broker.bootstrap
            info["broker"] = f"LocalKafka at {bootstrap}, ready in {broker.start_seconds:.1f} s"
        print(f"starting a worker (app {app_id}, log {info['worker_log']}) …", flush=True)
        t0 = time.monotonic()
        worker = Worker(bootstrap, rundir / "worker", app_id, prefix, env=settings).start()
        info["app_id"] += f" (ready in {time.monotonic() - t0:.1f} s)"
        demo = Demo(args, bootstrap, prefix, worker)
        print(f"fleet of {len(demo.fleet)} providers; {args.rate:g} req/s for {args.duration:g} s", flush=True)
        asyncio.run(demo.run())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        if demo is not None:
            demo.interrupted = True
        code = 130 if demo is None else 0
    except Exception as e:  # noqa: BLE001 - report what we have, then fail
        print(f"demo failed: {e!r}", file=sys.stderr)
        code = 1
    finally:
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()
    if demo is not None:
        write_report(demo, info, report_path)
        print(f"report: {report_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
