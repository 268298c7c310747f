"""One provider session as the router sees it: registration, the latest accepted heartbeat, the
pooled KV budget reconstructed from it, and the coordinator-side pending reservations.

Ingest clamps live here (domain §1.1, §1.2, §2.8; rules §4) so that live ingest and offline replay
apply them identically. `ProviderEventError` carries the reason an event is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import Config
from .versions import at_or_above

MAX_DECODE_TPS = 500.0
MAX_BANDWIDTH_GBS = 2000.0
MAX_MEMORY_GB = 1024.0
MAX_SLOTS = 64
MAX_MODELS = 256
MAX_STRING = 256
LEGACY_MAX_CONCURRENCY = 24
MAX_TOKENS_POTENTIAL = 1_000_000
MAX_BUDGET = 10_000_000_000
MAX_COUNT = 1_000_000
MAX_KV_BYTES_PER_TOKEN = 16 * 1024 * 1024
MAX_LOAD_TIME_MS = 3.6e6
DEFAULT_MAX_CONCURRENT = 4

TRUST_RANK = {"none": 0, "self_signed": 1, "hardware": 2}
STATUSES = ("idle", "serving", "draining")
THERMAL = ("nominal", "fair", "serious", "critical")
SLOT_STATES = ("running", "idle", "idle_shutdown", "reloading", "crashed")
LOADED_STATES = ("running", "idle")


class ProviderEventError(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- clamps -----------------------------------------------------------------------------------------
def clamp_float(value, lo: float, hi: float) -> float:
    """NaN, negatives and non-numbers → lo; above hi → hi."""
    if type(value) is float:  # the decoder's, nearly always (NaN fails both tests: lo)
        return value if lo <= value <= hi else hi if value > hi else lo
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return lo
    if math.isnan(v) or v < lo:
        return lo
    return hi if v > hi else v


MIN_RATE = 1e-3  # tok/s or GB/s: anything slower is no measurement (and would divide to Inf)


def clamp_rate(value, hi: float) -> float:
    """A rate clamped to [0, hi], with absurdly small (e.g. subnormal) values counted as 0."""
    v = clamp_float(value, 0.0, hi)
    return v if v >= MIN_RATE else 0.0


def zero_outside(value, hi: float) -> float:
    """NaN, negative, absurdly small or above hi → 0 (the prefill ingest rule: zeroed, not clamped)."""
    if type(value) is float:  # the decoder's, nearly always
        return value if MIN_RATE <= value <= hi else 0.0
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return v if MIN_RATE <= v <= hi else 0.0


def clamp_int(value, lo: int, hi: int) -> int:
    if type(value) is int:  # the decoder's, nearly always
        return lo if value < lo else hi if value > hi else value
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        return lo
    return lo if v < lo else hi if v > hi else v


def _string(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProviderEventError("bad_field", f"{what} is not a string")
    if len(value) > MAX_STRING:
        raise ProviderEventError("oversized_string", what)
    return value


# --- heartbeat-derived state ------------------------------------------------------------------------
@dataclass(slots=True)
class Slot:
    model: str
    state: str
    num_running: int
    num_waiting: int
    max_concurrency: int
    max_tokens_potential: int
    observed_decode_tps: float
    observed_prefill_tps: float
    budget_used: int
    budget_max: int
    queued_budget: int
    kv_bytes_per_token: int
    model_load_time_ms: float

    @property
    def loaded(self) -> bool:
        return self.state in LOADED_STATES


@dataclass(slots=True)
class Pool:
    """The whole-box KV pool (domain §2.10.2–2.10.3), rebuilt on every accepted heartbeat."""
    used: int = 0
    total: int = 0
    committed: int = 0
    byte_mode: bool = False
    used_bytes: int = 0
    committed_bytes: int = 0
    total_bytes: int = 0
    rate: dict = field(default_factory=dict)  # model -> clamped KV bytes/token (budget slots)
    max_rate: int = 0

    @classmethod
    def from_slots(cls, slots: list[Slot]) -> "Pool":
        pool = cls()
        budget = [s for s in slots if s.budget_max > 0]
        if not budget:
            return pool
        used = committed = used_bytes = committed_bytes = max_rate = 0
        shared_free = shared_free_bytes = 0
        byte_mode = True
        rate = pool.rate
        for s in budget:  # locals, not attributes: this runs on every heartbeat with budgets
            uq = s.budget_used + s.queued_budget
            slot_used = uq if uq > 0 else 0
            c = uq if uq > s.max_tokens_potential else s.max_tokens_potential
            if c < 0:
                c = 0
            used += slot_used
            committed += c
            free = s.budget_max - slot_used
            if free > shared_free:
                shared_free = free
            r = s.kv_bytes_per_token
            if r > 0:
                used_bytes += slot_used * r
                committed_bytes += c * r
                if free * r > shared_free_bytes:
                    shared_free_bytes = free * r
                rate.setdefault(s.model, r)
                if r > max_rate:
                    max_rate = r
            else:
                byte_mode = False
        pool.used, pool.committed, pool.total = used, committed, used + shared_free
        pool.byte_mode, pool.used_bytes, pool.committed_bytes = byte_mode, used_bytes, committed_bytes
        pool.total_bytes, pool.max_rate = used_bytes + shared_free_bytes, max_rate
        return pool


@dataclass(slots=True)
class Backend:
    total_memory_gb: float
    gpu_memory_active_gb: float
    free_for_load_gb: float | None
    slots: list[Slot]
    by_model: dict  # model -> first Slot reported for it
    pool: Pool
    any_budget: bool


@dataclass(slots=True)
class Pending:
    model: str
    tokens: int
    reserved_at_ms: float


@dataclass(slots=True)
class ModelEntry:
    size_gb: float
    min_ram_gb: float
    is_vision: bool


class ProviderState:
    """A registered provider session."""

    __slots__ = (
        "provider_id", "session", "registered_at_ms", "version", "account_id", "trust",
        "private_only", "chip_name", "family", "chip_class", "memory_gb", "bandwidth_gbs",
        "decode_tps", "prefill_tps", "models", "last_seen", "last_seq", "status", "warm_models",
        "memory_pressure", "cpu_usage", "thermal", "backend", "last_prefill", "pending",
        "pending_by_model", "pending_tokens_by_model", "pending_tokens_all",
    )

    def __init__(self, event: dict, config: Config, now: float):
        pid = _string(event.get("provider_id"), "provider_id")
        if not pid:
            raise ProviderEventError("missing_provider_id")
        hw = event.get("hardware") or {}
        models = event.get("models") or []
        if len(models) > MAX_MODELS:
            raise ProviderEventError("too_many_models", str(len(models)))
        trust = _string(event.get("trust_level"), "trust_level") or "none"
        if trust not in TRUST_RANK:
            raise ProviderEventError("bad_trust_level", trust)
        self.provider_id = pid
        self.session = _string(event.get("event_id"), "event_id")
        self.registered_at_ms = now
        self.version = _string(event.get("version"), "version").strip()
        self.account_id = _string(event.get("account_id"), "account_id") or None
        self.trust = trust
        self.private_only = bool(event.get("private_only"))
        self.chip_name = _string(hw.get("chip_name"), "chip_name")
        self.family = _string(hw.get("chip_family"), "chip_family")
        tier = _string(hw.get("chip_tier"), "chip_tier")
        self.chip_class = f"{self.family}|{tier}" if self.family else self.chip_name
        self.memory_gb = clamp_float(hw.get("memory_gb"), 0.0, MAX_MEMORY_GB)
        self.bandwidth_gbs = clamp_rate(hw.get("memory_bandwidth_gbs"), MAX_BANDWIDTH_GBS)
        self.decode_tps = clamp_rate(event.get("decode_tps"), MAX_DECODE_TPS)
        self.prefill_tps = clamp_rate(event.get("prefill_tps"), config.max_prefill_tps)
        self.models: dict[str, ModelEntry] = {}
        for m in models:
            mid = _string(m.get("id"), "models[].id")
            if mid and mid not in self.models:
                self.models[mid] = ModelEntry(
                    size_gb=clamp_float(m.get("size_bytes"), 0.0, 1e15) / 1e9,
                    min_ram_gb=clamp_float(m.get("min_ram_gb"), 0.0, MAX_MEMORY_GB),
                    is_vision=bool(m.get("is_vision")))
        self.last_seen = now
        self.last_seq = 0
        self.status = "idle"
        self.warm_models: tuple[str, ...] = ()
        self.memory_pressure = 0.0
        self.cpu_usage = 0.0
        self.thermal = "nominal"
        self.backend: Backend | None = None
        self.last_prefill: dict[str, float] = {}
        self.pending: dict[tuple[str, int], Pending] = {}
        self.pending_by_model: dict[str, int] = {}
        self.pending_tokens_by_model: dict[str, int] = {}
        self.pending_tokens_all = 0

    # --- static rates (domain §2.5.1, §2.13.2 step 4) ---
    def static_decode_tps(self) -> float:
        if self.decode_tps > 0:
            return self.decode_tps
        if self.bandwidth_gbs > 0:
            return math.sqrt(self.bandwidth_gbs)
        return 1.0

    def static_prefill_tps(self, config: Config) -> float:
        if self.prefill_tps > 0:
            return self.prefill_tps
        return self.static_decode_tps() * config.prefill_decode_ratio

    # --- heartbeat ------------------------------------------------------------------------------
    def parse_heartbeat(self, event: dict, config: Config) -> tuple[Backend | None, list[tuple[str, int]]]:
        """Validate and clamp a heartbeat's capacity report. Returns (backend, v2 trips)."""
        bc = event.get("backend_capacity")
        if bc is None:
            return None, []
        raw_slots = bc.get("slots") or []
        if len(raw_slots) > MAX_SLOTS:
            raise ProviderEventError("too_many_slots", str(len(raw_slots)))
        v2 = at_or_above(self.version, config.v2_floor)
        trips: list[tuple[str, int]] = []
        slots: list[Slot] = []
        by_model: dict[str, Slot] = {}
        any_budget = False
        for s in raw_slots:
            model = _string(s.get("model"), "slot.model")
            state = _string(s.get("state"), "slot.state")
            if state not in SLOT_STATES:
                raise ProviderEventError("bad_slot_state", state[:32])
            mc = clamp_int(s.get("max_concurrency"), 0, 1 << 62)
            if v2 and mc > config.v2_ceiling:  # v2 tripwire first: it records the original report
                trips.append((model, mc))
                mc = config.v2_ceiling
            mc = min(mc, LEGACY_MAX_CONCURRENCY)
            slot = Slot(
                model=model, state=state,
                num_running=clamp_int(s.get("num_running"), 0, MAX_COUNT),
                num_waiting=clamp_int(s.get("num_waiting"), 0, MAX_COUNT),
                max_concurrency=mc,
                max_tokens_potential=clamp_int(s.get("max_tokens_potential"), 0, MAX_TOKENS_POTENTIAL),
                observed_decode_tps=clamp_rate(s.get("observed_decode_tps"), MAX_DECODE_TPS),
                observed_prefill_tps=zero_outside(s.get("observed_prefill_tps"), config.max_prefill_tps),
                budget_used=clamp_int(s.get("active_token_budget_used"), 0, MAX_BUDGET),
                budget_max=clamp_int(s.get("active_token_budget_max"), 0, MAX_BUDGET),
                queued_budget=clamp_int(s.get("queued_token_budget"), 0, MAX_BUDGET),
                kv_bytes_per_token=clamp_int(s.get("kv_bytes_per_token"), 0, MAX_KV_BYTES_PER_TOKEN),
                model_load_time_ms=clamp_float(s.get("model_load_time_ms"), 0.0, MAX_LOAD_TIME_MS),
            )
            slots.append(slot)
            by_model.setdefault(model, slot)
            any_budget = any_budget or slot.budget_max > 0
        free = bc.get("free_for_load_gb")
        if free is not None:
            try:
                free = float(free)
            except (TypeError, ValueError):
                free = None
            if free is not None and not (0 <= free <= MAX_MEMORY_GB):
                free = None
        backend = Backend(
            total_memory_gb=clamp_float(bc.get("total_memory_gb"), 0.0, MAX_MEMORY_GB),
            gpu_memory_active_gb=clamp_float(bc.get("gpu_memory_active_gb"), 0.0, MAX_MEMORY_GB),
            free_for_load_gb=free, slots=slots, by_model=by_model,
            pool=Pool.from_slots(slots) if any_budget else Pool(), any_budget=any_budget)
        return backend, trips

    @staticmethod
    def parse_metrics(event: dict) -> tuple:
        """Validate a heartbeat's status and system metrics: (status, thermal, pressure, cpu, warm)."""
        status = _string(event.get("status"), "status") or "idle"
        if status not in STATUSES:
            raise ProviderEventError("bad_status", status[:32])
        sm = event.get("system_metrics") or {}
        thermal = _string(sm.get("thermal_state"), "thermal_state") or "nominal"
        if thermal not in THERMAL:
            raise ProviderEventError("bad_thermal_state", thermal[:32])
        warm = event.get("warm_models") or []
        if len(warm) > MAX_MODELS:
            raise ProviderEventError("too_many_models", str(len(warm)))
        return (status, thermal, clamp_float(sm.get("memory_pressure"), 0.0, 1.0),
                clamp_float(sm.get("cpu_usage"), 0.0, 1.0),
                tuple([_string(w, "warm_models[]") for w in warm]))

    def set_metrics(self, metrics: tuple) -> None:
        self.status, self.thermal, self.memory_pressure, self.cpu_usage, self.warm_models = metrics

    # --- box concurrency (domain §2.7) ------------------------------------------------------------
    def box_max_concurrency(self, config: Config) -> int:
        b = self.backend
        if b is None:
            value = DEFAULT_MAX_CONCURRENT
        elif b.any_budget:
            value = 24
        else:
            mem = b.total_memory_gb if b.total_memory_gb > 0 else self.memory_gb
            value = 2 if mem <= 24 else 4 if mem <= 48 else 6 if mem <= 96 else 8 if mem <= 128 else 12
        if at_or_above(self.version, config.v2_floor):
            value = min(value, config.v2_ceiling)
        return value

    def total_memory_gb(self) -> float:
        b = self.backend
        if b is not None and b.total_memory_gb > 0:
            return b.total_memory_gb
        return self.memory_gb

    # --- pending reservations (domain §1.5) -------------------------------------------------------
    def add_pending(self, key: tuple[str, int], model: str, tokens: int, now: float) -> None:
        self.pending[key] = Pending(model, tokens, now)
        self.pending_by_model[model] = self.pending_by_model.get(model, 0) + 1
        self.pending_tokens_by_model[model] = self.pending_tokens_by_model.get(model, 0) + tokens
        self.pending_tokens_all += tokens

    def remove_pending(self, key: tuple[str, int]) -> Pending | None:
        p = self.pending.pop(key, None)
        if p is None:
            return None
        n = self.pending_by_model[p.model] - 1
        if n:
            self.pending_by_model[p.model] = n
            self.pending_tokens_by_model[p.model] -= p.tokens
        else:
            del self.pending_by_model[p.model]
            del self.pending_tokens_by_model[p.model]
        self.pending_tokens_all -= p.tokens
        return p

    def pending_bytes(self) -> int | None:
        """Σ tokens × resident rate over all pending requests; None when a pending model has no
        resident rate (seed-era: a cold pending model forces token accounting)."""
        b = self.backend
        if b is None or not b.pool.byte_mode:
            return None
        rate = b.pool.rate
        total = 0
        for model, tokens in self.pending_tokens_by_model.items():
            r = rate.get(model)
            if r is None:
                return None
            total += tokens * r
        return total
