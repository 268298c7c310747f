"""The simulated fleet: Apple-silicon provider machines that really serve what they are routed.

Two layers:

* `ProviderSpec` — an immutable description of one machine (chip, memory, models, binary version,
  trust, behaviour, true rates), drawn by `build_fleet` from a recipe of `Group`s (presets.py holds
  the recipes; the default one follows domain §6.1).
* `SimProvider` — the machine's dynamics, in simulated seconds, independent of any clock or
  transport so the offline discrete-event simulation, the live mode and the what-if tool can all
  drive it:

      p.advance(t)        -> jobs finished up to time t (ok, error, capacity_rejected)
      p.reserve(job, t)   -> the routed request enters the engine at t (call advance(t) first)
      p.next_t            -> when the next job changes phase (prefill done / decode done / failure)
      p.heartbeat(t, ...) -> the Heartbeat record a real provider would send now
      p.completion(job)   -> the Completion the gateway reports for a finished job
      p.registration(...) -> the ProviderRegistered record of the current session

The engine model (per machine, all slots share the GPU):

* each slot (one per advertised model) has a TRUE solo decode rate, a TRUE prefill rate, an engine
  load factor k (legacy engine: gemma collapses at batch ≥ 4, domain §6.2; CBv2: k ≈ 0.39) and an
  engine batch limit;
* per-request decode at box batch B (running requests over all slots) = solo / (1 + k·(B − 1));
* requests in prefill share the box's prefill compute equally; a request whose conversation
  (cache-affinity key) is in the slot's prefix cache only prefills the new tokens;
* a request is admitted when the engine batch and the KV budget hold it (v0.7.4 and older: one
  box-wide KV pool every slot reports as its headroom; v0.7.5+: private per-engine grants), else it
  waits in the engine (reported as num_waiting / queued_token_budget);
* TTFT = time queued in the engine + prefill time (+ a small per-machine dispatch overhead);
  the heartbeat reports EWMAs (α 0.3) of per-request decode and prefill rates, as providers do.

Behaviours (hostile or broken machines): `failing` (every request errors after a few seconds, as the
24 GB boxes with 0 % success did), `black_hole` (accepts, never answers; the gateway gives up after
`GATEWAY_TIMEOUT_S`), `fast_liar` (reports 5× its real decode rate), `mc_liar` (a v2 box reporting
`max_concurrency` 24 while its engine runs 4), `flapping` (disconnects and reconnects as a new
session), `wedged` (goes silent, then reconnects), `crashy` (a slot crashes now and then).
"""
from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..versions import compare_versions

INF = float("inf")
EPS_TOKENS = 1e-3           # a phase with less work than this left is done (floating-point slack)
EWMA_ALPHA = 0.3            # providers' observed-rate EWMA weight (domain §6.2)
OS_RESERVED_GB = 8.0        # memory a box keeps for macOS and the provider process
KV_SHARE = 0.5              # share of the remaining memory the engine gives the KV cache
GB = 1e9
PREFIX_CACHE_ENTRIES = 64   # conversations a slot keeps in its prefix cache
MIN_PREFILL_TOKENS = 16     # even a full prefix-cache hit prefills the last few tokens
GATEWAY_TIMEOUT_S = 120.0   # a gateway gives up on a request without an answer after this
LEGACY_ENGINE_BATCH = 16    # legacy engine: running requests per slot (more wait)
V2_ENGINE_BATCH = 4         # CBv2 engine: running requests per slot (what an honest v2 box reports)
LIAR_MAX_CONCURRENCY = 24


# === hardware and models ===========================================================================
@dataclass(frozen=True)
class Chip:
    key: str
    name: str
    family: str
    tier: str
    bandwidth_gbs: float      # public Apple figures (domain §6.1)
    memory_options: tuple     # GB
    gpu_cores: int
    decode: float             # true solo decode of gpt-oss-20b, tok/s
    prefill: float            # true prefill of gpt-oss-20b, tok/s

    @property
    def chip_class(self) -> str:
        return f"{self.family}|{self.tier}"


CHIPS = {c.key: c for c in (
    Chip("m1pro", "Apple M1 Pro", "M1", "Pro", 200.0, (32,), 16, 36.0, 600.0),
    Chip("m1max", "Apple M1 Max", "M1", "Max", 400.0, (32, 64), 32, 58.0, 900.0),
    Chip("m1ultra", "Apple M1 Ultra", "M1", "Ultra", 800.0, (64, 128), 64, 72.0, 1100.0),
    Chip("m2", "Apple M2", "M2", "", 100.0, (24,), 10, 20.0, 350.0),
    Chip("m2pro", "Apple M2 Pro", "M2", "Pro", 200.0, (32,), 19, 40.0, 700.0),
    Chip("m2max", "Apple M2 Max", "M2", "Max", 400.0, (32, 64, 96), 38, 62.0, 1100.0),
    Chip("m2ultra", "Apple M2 Ultra", "M2", "Ultra", 800.0, (64, 128, 192), 76, 85.0, 1700.0),
    Chip("m3", "Apple M3", "M3", "", 100.0, (24,), 10, 21.0, 400.0),
    Chip("m3pro", "Apple M3 Pro", "M3", "Pro", 150.0, (36,), 18, 40.0, 800.0),
    Chip("m3max", "Apple M3 Max", "M3", "Max", 400.0, (36, 48, 64, 128), 40, 70.0, 1500.0),
    Chip("m3ultra", "Apple M3 Ultra", "M3", "Ultra", 819.0, (96, 256, 512), 80, 96.0, 2300.0),
    Chip("m4", "Apple M4", "M4", "", 120.0, (24, 32), 10, 24.0, 450.0),
    Chip("m4pro", "Apple M4 Pro", "M4", "Pro", 273.0, (24, 48, 64), 20, 50.0, 1000.0),
    Chip("m4max", "Apple M4 Max", "M4", "Max", 546.0, (36, 48, 64, 128), 40, 93.0, 2000.0),
    Chip("m5", "Apple M5", "M5", "", 153.0, (24, 32), 10, 30.0, 1260.0),
)}


@dataclass(frozen=True)
class Engine:
    decode_factor: float      # solo decode relative to gpt-oss-20b on the same chip
    prefill_factor: float
    k: float                  # the engine's real load factor


@dataclass(frozen=True)
class ModelSpec:
    id: str
    size_gb: float
    min_ram_gb: float
    kv_bytes_per_token: int
    legacy: Engine            # provider binaries below 0.7.5
    cbv2: Engine              # 0.7.5 and later (continuous batching v2)

    def engine(self, cbv2: bool) -> Engine:
        return self.cbv2 if cbv2 else self.legacy


GPT_OSS = ModelSpec("gpt-oss-20b", 12.8, 24.0, 24_576, Engine(1.0, 1.0, 0.27), Engine(1.0, 1.05, 0.27))
# Legacy engine: gemma 10–18 tok/s solo on the postmortem's mixed boxes, 2–3 tok/s at batch ≥ 4;
# CBv2 on an M4 Max: 101.8 / 59.6 / 38.0 / 24.7 tok/s at B = 1/2/4/8 (k ≈ 0.39).
GEMMA = ModelSpec("gemma-4-26b-qat-4bit", 15.6, 36.0, 100_000, Engine(0.2, 0.5, 1.1), Engine(1.1, 0.7, 0.39))
QWEN36 = ModelSpec("qwen3.6-35b", 20.0, 48.0, 40_960, Engine(0.8, 0.6, 0.3), Engine(0.95, 0.7, 0.3))
QWEN35 = ModelSpec("qwen3.5-35b", 20.0, 48.0, 40_960, Engine(0.75, 0.6, 0.3), Engine(0.9, 0.7, 0.3))
MODELS = {m.id: m for m in (GPT_OSS, GEMMA, QWEN36, QWEN35)}


@dataclass(frozen=True)
class Features:
    """What a provider binary version does on the wire."""
    capacity: bool            # sends backend_capacity (0.7.0+); older: legacy, null
    kv_rates: bool            # reports kv_bytes_per_token (0.7.4+)
    private_grants: bool      # v0.7.5 KV layout: private per-engine grants
    cbv2: bool                # the CBv2 engine
    reports_mc: bool          # reports slot max_concurrency (0 = unreported before 0.7.5)
    reports_prefill: bool     # reports observed_prefill_tps (0.7.14+)
    benchmark: bool           # sends a registration decode benchmark (old Swift providers)


def features(version: str) -> Features:
    def at(v: str) -> bool:
        return bool(version) and compare_versions(version, v) >= 0
    return Features(capacity=at("0.7.0"), kv_rates=at("0.7.4"), private_grants=at("0.7.5"),
                    cbv2=at("0.7.5"), reports_mc=at("0.7.5"), reports_prefill=at("0.7.14"),
                    benchmark=not at("0.7.5"))


# === the fleet recipe ==============================================================================
@dataclass(frozen=True)
class Group:
    """One kind of machine in a fleet recipe. Weights need not sum to 1."""
    name: str
    weight: float
    chips: dict                           # chip key -> weight
    models: tuple                         # ((model ids...), weight) pairs
    versions: dict                        # version -> weight
    trust: dict = field(default_factory=lambda: {"hardware": 1.0})
    behaviours: dict = field(default_factory=lambda: {"normal": 1.0})
    min_memory_gb: int = 0
    max_memory_gb: int = 1024
    benchmark_share: float = 0.7          # of machines whose version sends a benchmark
    prefill_benchmark_share: float = 0.2
    reports_prefill: bool | None = None   # None: as the version does; False: never (prefill-starved)


@dataclass(frozen=True)
class SlotSpec:
    model: str
    solo_decode: float
    prefill: float
    k: float
    engine_batch: int


@dataclass(frozen=True)
class ProviderSpec:
    machine: str              # stable machine name; the first session's provider id
    index: int
    group: str
    chip: Chip
    memory_gb: int
    version: str
    trust: str
    behaviour: str
    slots: tuple              # SlotSpec per advertised model
    benchmark_decode: float   # registration decode_tps (0 = none)
    benchmark_prefill: float
    overhead_s: float         # dispatch → engine, tokenisation: added to every TTFT
    reports_prefill: bool
    seed: str                 # seeds the machine's own random stream

    @property
    def models(self) -> tuple:
        return tuple(s.model for s in self.slots)

    @property
    def features(self) -> Features:
        return features(self.version)


def _weighted(rng: random.Random, table: dict):
    keys = list(table)
    return rng.choices(keys, weights=[table[k] for k in keys])[0]


def _allocate(groups: list[Group], n: int) -> list[Group]:
    """n machines over the groups by weight (largest remainder; ties by group order)."""
    total = sum(g.weight for g in groups)
    quotas = [g.weight / total * n for g in groups]
    counts = [int(q) for q in quotas]
    order = sorted(range(len(groups)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    out = []
    for g, c in zip(groups, counts):
        out.extend([g] * c)
    return out


def _needs_gb(models) -> float:
    need = max(MODELS[m].min_ram_gb for m in models)
    weights = sum(MODELS[m].size_gb for m in models)
    return max(need, weights + OS_RESERVED_GB + 2.0)


def _spread(groups: list[Group], n: int, rng: random.Random) -> list[Group]:
    """Interleave the allocated groups so that a prefix of the fleet resembles the whole."""
    slots = _allocate(groups, n)
    keyed = []
    seen: dict[str, int] = {}
    count = {g.name: slots.count(g) for g in groups}
    for g in slots:
        i = seen.get(g.name, 0)
        seen[g.name] = i + 1
        keyed.append(((i + 0.5) / count[g.name], rng.random(), g))
    keyed.sort(key=lambda x: (x[0], x[1]))
    return [g for _, _, g in keyed]


def make_spec(index: int, group: Group, rng: random.Random, seed) -> ProviderSpec:
    models = _weighted(rng, dict(group.models))
    need = max(_needs_gb(models), group.min_memory_gb)
    chip_keys = [k for k in group.chips
                 if any(need <= m <= group.max_memory_gb for m in CHIPS[k].memory_options)]
    if not chip_keys:  # nothing in the group fits: the biggest box of the group's chips
        chip_keys = [max(group.chips, key=lambda k: max(CHIPS[k].memory_options))]
    chip = CHIPS[_weighted(rng, {k: group.chips[k] for k in chip_keys})]
    options = [m for m in chip.memory_options if need <= m <= group.max_memory_gb] or [max(chip.memory_options)]
    memory = rng.choice(options)
    version = _weighted(rng, group.versions)
    feats = features(version)
    trust = _weighted(rng, group.trust)
    behaviour = _weighted(rng, group.behaviours)
    slots = []
    for m in models:
        spec = MODELS[m]
        eng = spec.engine(feats.cbv2)
        batch = V2_ENGINE_BATCH if feats.cbv2 else LEGACY_ENGINE_BATCH
        slots.append(SlotSpec(m, round(chip.decode * eng.decode_factor * rng.uniform(0.9, 1.1), 2),
                              round(chip.prefill * eng.prefill_factor * rng.uniform(0.85, 1.15), 1),
                              eng.k, batch))
    bench_decode = bench_prefill = 0.0
    if feats.benchmark and rng.random() < group.benchmark_share:
        # the registration benchmark runs the machine's first model: gpt-oss on a mixed box, so a
        # box with a slow gemma engine still registers as fast (the postmortem's "benchmarked fast")
        first = slots[0]
        bench_decode = round(chip.decode * MODELS[first.model].engine(False).decode_factor * rng.uniform(0.95, 1.05), 1)
        if first.model == GEMMA.id and len(slots) > 1:
            bench_decode = round(chip.decode * rng.uniform(0.95, 1.05), 1)
        if rng.random() < group.prefill_benchmark_share:
            bench_prefill = round(first.prefill * rng.uniform(0.9, 1.1), 1)
    reports_prefill = feats.reports_prefill if group.reports_prefill is None else group.reports_prefill
    machine = f"{chip.key}-{index:04d}"
    return ProviderSpec(machine=machine, index=index, group=group.name, chip=chip, memory_gb=memory,
                        version=version, trust=trust, behaviour=behaviour, slots=tuple(slots),
                        benchmark_decode=bench_decode, benchmark_prefill=bench_prefill,
                        overhead_s=round(rng.uniform(0.15, 0.6), 3), reports_prefill=reports_prefill,
                        seed=f"{seed}-{machine}")


def build_fleet(groups: list[Group], n: int, seed, cover_models: tuple = ()) -> list[ProviderSpec]:
    """n machines drawn from the recipe, deterministic from `seed`. Every model in `cover_models`
    is served by at least one hardware-trusted, well-behaved machine, so a tiny fleet can serve every
    request of the traffic mix."""
    rng = random.Random(f"fleet-{seed}")
    plan = _spread(groups, n, rng)
    specs = [make_spec(i, g, rng, seed) for i, g in enumerate(plan)]
    for model in cover_models:
        if any(s.trust == "hardware" and s.behaviour == "normal" and model in s.models for s in specs):
            continue
        # convert the last machine that is not the only good server of another covered model
        for i in range(len(specs) - 1, -1, -1):
            s = specs[i]
            others = [m for m in cover_models if m != model and m in s.models
                      and s.trust == "hardware" and s.behaviour == "normal"]
            if any(sum(1 for x in specs if m in x.models and x.trust == "hardware"
                       and x.behaviour == "normal") <= 1 for m in others):
                continue
            g = Group(f"{s.group}+cover", 1.0, chips={"m4max": 1.0, "m3max": 1.0}, models=(((model,), 1.0),),
                      versions={"0.7.6": 1.0})
            specs[i] = make_spec(i, g, random.Random(f"cover-{seed}-{model}"), seed)
            break
    return specs


# === the dynamics ==================================================================================
class Job:
    """A routed request on a machine."""
    __slots__ = ("request_id", "attempt", "model", "prompt", "max_tokens", "out_tokens", "affinity",
                 "dispatched", "admitted", "prefill_tokens", "prefill_left", "decode_left",
                 "first_token", "done_at", "status", "estimated_ttft_ms", "provider_id", "tag")

    def __init__(self, request_id: str, attempt: int, model: str, prompt: int, max_tokens: int,
                 out_tokens: int, affinity: str | None = None, estimated_ttft_ms: float = 0.0, tag=None):
        self.request_id, self.attempt, self.model = request_id, attempt, model
        self.prompt, self.max_tokens = prompt, max_tokens
        self.out_tokens = max(1, min(out_tokens, max_tokens))
        self.affinity = affinity
        self.estimated_ttft_ms = estimated_ttft_ms
        self.tag = tag
        self.dispatched = self.admitted = self.first_token = self.done_at = None
        self.prefill_tokens = 0
        self.prefill_left = 0.0
        self.decode_left = float(self.out_tokens)
        self.status = ""
        self.provider_id = ""

    @property
    def tokens(self) -> int:  # what the engine reserves: prompt + max output
        return self.prompt + self.max_tokens

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.dispatched if self.first_token is not None else 0.0

    @property
    def decode_tps(self) -> float:
        if self.first_token is None or self.done_at is None or self.done_at <= self.first_token:
            return 0.0
        return self.out_tokens / (self.done_at - self.first_token)


class SimSlot:
    __slots__ = ("spec", "model", "solo", "prefill", "k", "engine_batch", "kv_rate", "grant_bytes",
                 "running", "waiting", "decode_ewma", "prefill_ewma", "served", "cache", "dec_rate",
                 "pre_rate", "max_load", "crashed_until")

    def __init__(self, spec: SlotSpec, grant_bytes: float):
        self.spec = spec
        self.model = spec.model
        self.solo, self.prefill, self.k, self.engine_batch = spec.solo_decode, spec.prefill, spec.k, spec.engine_batch
        self.kv_rate = MODELS[spec.model].kv_bytes_per_token
        self.grant_bytes = grant_bytes
        self.running: list[Job] = []
        self.waiting: deque[Job] = deque()
        self.decode_ewma = 0.0
        self.prefill_ewma = 0.0
        self.served = 0
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.dec_rate = self.pre_rate = 0.0
        self.max_load = 0          # most requests (running + waiting) seen at once
        self.crashed_until = -1.0


class SimProvider:
    """One machine's dynamics in simulated seconds (see the module docstring)."""

    def __init__(self, spec: ProviderSpec, start_s: float = 0.0):
        self.spec = spec
        self.feats = spec.features
        self.rng = random.Random(spec.seed)
        self.session = 0
        self.pid = spec.machine
        self.online = True
        self.weights_gb = sum(MODELS[m].size_gb for m in spec.models)
        self.kv_bytes = max(2.0, (spec.memory_gb - OS_RESERVED_GB - self.weights_gb) * KV_SHARE) * GB
        n = len(spec.slots)
        self.slots: dict[str, SimSlot] = {s.model: SimSlot(s, self.kv_bytes / n) for s in spec.slots}
        self._slot_list = list(self.slots.values())
        self.t = start_s
        self.next_t = INF
        self.batch = 0
        self.failing: list[Job] = []       # jobs that end without being served, at job.done_at
        self.refused = 0
        self.served = 0
        self.heartbeats = 0
        self.lost = 0
        self.next_change_t = INF
        self._change = None
        self._plan_change(start_s, first=True)

    # --- identity -----------------------------------------------------------------------------
    @property
    def machine(self) -> str:
        return self.spec.machine

    @property
    def shared_pool(self) -> bool:
        return not self.feats.private_grants

    def registration(self, at_ms: int, event_id: str | None = None) -> dict:
        s = self.spec
        return {
            "event_id": event_id or f"reg-{self.pid}", "provider_id": self.pid, "registered_at_ms": at_ms,
            "version": s.version, "account_id": None, "trust_level": s.trust, "private_only": False,
            "hardware": {"chip_name": s.chip.name, "chip_family": s.chip.family, "chip_tier": s.chip.tier,
                         "memory_gb": float(s.memory_gb), "memory_bandwidth_gbs": float(s.chip.bandwidth_gbs),
                         "gpu_cores": s.chip.gpu_cores},
            "decode_tps": float(s.benchmark_decode), "prefill_tps": float(s.benchmark_prefill),
            "models": [{"id": m, "size_bytes": int(MODELS[m].size_gb * GB), "min_ram_gb": float(MODELS[m].min_ram_gb),
                        "is_vision": False} for m in s.models]}

    # --- lifecycle (flapping, wedged, crashy) ---------------------------------------------------
    def _plan_change(self, t: float, first: bool = False) -> None:
        b = self.spec.behaviour
        if b in ("flapping", "wedged"):
            if self.online:
                self._change = "disconnect" if b == "flapping" else "silent"
                self.next_change_t = t + self.rng.uniform(300.0, 1800.0) * (0.5 if first else 1.0)
            else:
                self._change = "reconnect"
                self.next_change_t = t + self.rng.uniform(30.0, 240.0)
        elif b == "crashy":
            self._change = "crash"
            self.next_change_t = t + self.rng.uniform(600.0, 2400.0) * (0.5 if first else 1.0)
        else:
            self.next_change_t = INF

    def change(self, t: float) -> tuple[str, list[Job]]:
        """Apply the lifecycle change due at t (call when t ≥ next_change_t). Returns (what, jobs):
        "disconnect"/"silent" with the jobs it lost, "reconnect" (a new session: new provider id),
        "crash" with the jobs the crashed slot failed (their Completions are due now)."""
        what = self._change
        jobs: list[Job] = []
        if what in ("disconnect", "silent"):
            self.advance(t)
            jobs = self._drop_all()
            self.online = False
            self.lost += len(jobs)
        elif what == "reconnect":
            self.session += 1
            self.pid = f"{self.spec.machine}~{self.session}"
            self.online = True
            self.t = max(self.t, t)
        elif what == "crash":
            jobs = self.advance(t)
            slot = self._slot_list[self.rng.randrange(len(self._slot_list))]
            slot.crashed_until = t + self.rng.uniform(30.0, 120.0)
            for j in list(slot.running) + list(slot.waiting):
                j.status, j.done_at = "error", t
                jobs.append(j)
            self.batch -= len(slot.running)
            slot.running.clear()
            slot.waiting.clear()
            self._recompute()
        self._plan_change(t)
        return what, jobs

    def _drop_all(self) -> list[Job]:
        jobs = list(self.failing)
        self.failing.clear()
        for s in self._slot_list:
            jobs.extend(s.running)
            jobs.extend(s.waiting)
            s.running.clear()
            s.waiting.clear()
        for j in jobs:
            j.status = "lost"
        self.batch = 0
        self.next_t = INF
        return jobs

    # --- capacity the engines enforce ---------------------------------------------------------
    def _used_bytes(self) -> float:
        return sum(j.tokens * s.kv_rate for s in self._slot_list for j in s.running)

    def budget_max_tokens(self, slot: SimSlot) -> int:
        """The slot's active_token_budget_max as the engine reports it (floored at 1,024)."""
        if self.shared_pool:
            own = sum(j.tokens for j in slot.running)
            free = max(0.0, self.kv_bytes - self._used_bytes())
            return max(1024, own + int(free // slot.kv_rate))
        return max(1024, int(slot.grant_bytes // slot.kv_rate))

    def _fits(self, slot: SimSlot, job: Job) -> bool:
        if len(slot.running) >= slot.engine_batch:
            return False
        if self.shared_pool:
            return self._used_bytes() + job.tokens * slot.kv_rate <= self.kv_bytes
        return (sum(j.tokens for j in slot.running) + job.tokens) * slot.kv_rate <= slot.grant_bytes

    def _never_fits(self, slot: SimSlot, job: Job) -> bool:
        limit = self.kv_bytes if self.shared_pool else slot.grant_bytes
        return job.tokens * slot.kv_rate > limit

    # --- work ---------------------------------------------------------------------------------
    def reserve(self, job: Job, t: float) -> bool:
        """The routed request reaches the machine at t (after `advance(t)`). False when the machine
        refuses it outright; it then fails like any other job (its Completion comes from `advance`)."""
        if t > self.t:
            raise RuntimeError("advance(t) before reserve(job, t)")
        job.dispatched = t
        job.provider_id = self.pid
        slot = self.slots.get(job.model)
        b = self.spec.behaviour
        if slot is None or self._never_fits(slot, job) or not self.online:
            self.refused += 1
            self._fail(job, t + 0.05, "capacity_rejected")
            return False
        if slot.crashed_until > t:
            self._fail(job, t + 0.1, "error")
            return True
        if b == "failing":
            self._fail(job, t + self.rng.uniform(0.5, 3.0), "error")
            return True
        if b == "black_hole":
            self._fail(job, t + GATEWAY_TIMEOUT_S, "error")
            return True
        slot.waiting.append(job)
        load = len(slot.running) + len(slot.waiting)
        if load > slot.max_load:
            slot.max_load = load
        self._admit()
        self._recompute()
        return True

    def _fail(self, job: Job, at: float, status: str) -> None:
        job.status, job.done_at = status, at
        self.failing.append(job)
        if at < self.next_t:
            self.next_t = at

    def _admit(self) -> None:
        t = self.t
        for slot in self._slot_list:
            while slot.waiting and self._fits(slot, slot.waiting[0]):
                job = slot.waiting.popleft()
                job.admitted = t
                cached = slot.cache.get(job.affinity) if job.affinity is not None else None
                tokens = job.prompt
                if cached:
                    tokens = max(MIN_PREFILL_TOKENS, job.prompt - cached)
                    slot.cache.move_to_end(job.affinity)
                job.prefill_tokens = tokens
                job.prefill_left = float(tokens)
                slot.running.append(job)
                self.batch += 1

    def _recompute(self) -> None:
        """Rates are constant between events; find the next one."""
        t = self.t
        nt = INF
        for j in self.failing:
            if j.done_at < nt:
                nt = j.done_at
        batch = self.batch
        if batch:
            n_pref = 0
            for s in self._slot_list:
                for j in s.running:
                    if j.first_token is None:
                        n_pref += 1
            share = n_pref if n_pref > 1 else 1
            for s in self._slot_list:
                if not s.running:
                    continue
                dec = s.solo / (1.0 + s.k * (batch - 1))
                pre = s.prefill / share
                s.dec_rate, s.pre_rate = dec, pre
                for j in s.running:
                    x = t + (j.prefill_left / pre if j.first_token is None else j.decode_left / dec)
                    if x < nt:
                        nt = x
        self.next_t = nt

    def _step(self, t1: float) -> None:
        dt = t1 - self.t
        if dt <= 0:
            return
        if self.batch:
            for s in self._slot_list:
                if not s.running:
                    continue
                pd, dd = s.pre_rate * dt, s.dec_rate * dt
                for j in s.running:
                    if j.first_token is None:
                        j.prefill_left -= pd
                    else:
                        j.decode_left -= dd
        self.t = t1

    def advance(self, t: float) -> list[Job]:
        """Run the machine to time t; the jobs that ended (in time order of their phase events)."""
        finished: list[Job] = []
        while self.next_t <= t:
            self._step(self.next_t)
            self._transitions(finished)
            self._admit()
            self._recompute()
        if t > self.t:
            self._step(t)
        return finished

    def _transitions(self, finished: list[Job]) -> None:
        now = self.t
        if self.failing:
            keep = []
            for j in self.failing:
                (finished if j.done_at <= now else keep).append(j)
            self.failing = keep
        for s in self._slot_list:
            if not s.running:
                continue
            done = None
            for j in s.running:
                if j.first_token is None:
                    if j.prefill_left <= EPS_TOKENS:
                        j.prefill_left = 0.0
                        j.first_token = now
                elif j.decode_left <= EPS_TOKENS:
                    if done is None:
                        done = []
                    done.append(j)
            if done:
                for j in done:
                    s.running.remove(j)
                    self.batch -= 1
                    self._finish(s, j, now)
                    finished.append(j)

    def _finish(self, slot: SimSlot, job: Job, now: float) -> None:
        job.done_at = now
        job.status = "ok"
        slot.served += 1
        self.served += 1
        decode_s = now - job.first_token
        decode_tps = job.out_tokens / decode_s if decode_s > 0 else slot.solo
        prefill_s = job.first_token - job.admitted
        prefill_tps = job.prompt / prefill_s if prefill_s > 0 else slot.prefill
        a = EWMA_ALPHA
        slot.decode_ewma = decode_tps if slot.decode_ewma == 0 else a * decode_tps + (1 - a) * slot.decode_ewma
        slot.prefill_ewma = prefill_tps if slot.prefill_ewma == 0 else a * prefill_tps + (1 - a) * slot.prefill_ewma
        if job.affinity is not None:
            slot.cache[job.affinity] = job.prompt + job.out_tokens
            slot.cache.move_to_end(job.affinity)
            while len(slot.cache) > PREFIX_CACHE_ENTRIES:
                slot.cache.popitem(last=False)

    # --- the wire -----------------------------------------------------------------------------
    def completion(self, job: Job, at_ms: int) -> dict:
        ok = job.status == "ok"
        ttft = (job.ttft_s + self.spec.overhead_s) * 1000.0 if ok else 0.0
        return {"event_id": f"c-{job.request_id}-{job.attempt}", "request_id": job.request_id,
                "attempt": job.attempt, "provider_id": job.provider_id, "model": job.model,
                "status": job.status, "prompt_tokens": job.prompt,
                "completion_tokens": job.out_tokens if ok else 0, "ttft_ms": round(ttft, 3),
                "completed_at_ms": at_ms}

    def measured_ttft_ms(self, job: Job) -> float:
        return (job.ttft_s + self.spec.overhead_s) * 1000.0

    def load(self) -> int:
        return self.batch + sum(len(s.waiting) for s in self._slot_list)

    def heartbeat(self, t: float, seq: int, at_ms: int) -> dict:
        """The Heartbeat a real provider of this version sends at t (after `advance(t)`)."""
        spec, f = self.spec, self.feats
        batch = self.batch
        kv_used_gb = self._used_bytes() / GB
        active_gb = self.weights_gb + kv_used_gb
        waiting = sum(len(s.waiting) for s in self._slot_list)
        rec = {"event_id": f"hb-{self.pid}-{seq}", "provider_id": self.pid, "seq": seq, "sent_at_ms": at_ms,
               "status": "serving" if batch or waiting else "idle",
               "warm_models": [s.model for s in self._slot_list if s.crashed_until <= t],
               "system_metrics": {
                   "memory_pressure": round(min(1.0, (OS_RESERVED_GB + active_gb) / spec.memory_gb), 3),
                   "cpu_usage": round(min(1.0, 0.05 + 0.08 * batch), 3),
                   "thermal_state": "nominal" if batch < 8 else "fair" if batch < 14 else "serious"},
               "backend_capacity": None}
        if not f.capacity:
            return rec
        slots = []
        behaviour = spec.behaviour
        for s in self._slot_list:
            crashed = s.crashed_until > t
            running, waiting_n = len(s.running), len(s.waiting)
            used = sum(j.tokens for j in s.running)
            decode = s.decode_ewma
            if behaviour == "fast_liar":
                decode = min(500.0, decode * 5) if decode > 0 else 300.0
            if f.reports_mc:
                mc = LIAR_MAX_CONCURRENCY if behaviour == "mc_liar" else s.engine_batch
            else:
                mc = 0
            slots.append({
                "model": s.model,
                "state": "crashed" if crashed else "running" if running or waiting_n else "idle",
                "num_running": running, "num_waiting": waiting_n, "max_concurrency": mc,
                "active_tokens": int(sum(j.prompt + (j.out_tokens - j.decode_left) for j in s.running)),
                "max_tokens_potential": sum(j.max_tokens for j in s.running),
                "observed_decode_tps": round(decode, 3),
                "observed_prefill_tps": round(s.prefill_ewma, 3) if spec.reports_prefill else 0.0,
                "active_token_budget_used": used,
                "active_token_budget_max": self.budget_max_tokens(s),
                "queued_token_budget": sum(j.tokens for j in s.waiting),
                "kv_bytes_per_token": s.kv_rate if f.kv_rates else 0,
                "model_load_time_ms": 6000.0})
        rec["backend_capacity"] = {
            "total_memory_gb": float(spec.memory_gb), "gpu_memory_active_gb": round(active_gb, 3),
            "free_for_load_gb": round(max(0.0, spec.memory_gb * 0.75 - active_gb), 3), "slots": slots}
        return rec
