"""Time estimates for one (provider, model, request): effective decode rate, the prefill resolution
chain with its source, raw and calibrated TTFT (domain §2.13), the cost function (§2.11) and the
projected per-request decode rate (§2.11, used by the decode floor and the band).

Arithmetic follows the formulas' written order (rules §2) so two implementations agree.
"""
from __future__ import annotations

import math

from .config import Config
from .provider import ProviderState, Slot
from .rings import TpsRegistry

COLD_PENALTY_MS = 30_000.0
IDLE_SHUTDOWN_PENALTY_MS = 20_000.0
QUEUE_MS = 3_000.0
PENDING_MS = 750.0
THERMAL_MS = {"fair": 2_000.0, "serious": 8_000.0}


def slot_state(p: ProviderState, slot: Slot | None) -> str:
    return slot.state if slot is not None else "unknown"


def state_penalty(state: str) -> float:
    if state in ("running", "idle", ""):
        return 0.0
    if state == "idle_shutdown":
        return IDLE_SHUTDOWN_PENALTY_MS
    return COLD_PENALTY_MS


def static_effective_tps(p: ProviderState, slot: Slot | None, config: Config) -> float:
    """The last step of the effective-rate chain: the provider's static rate under load."""
    static = p.static_decode_tps()
    running = slot.num_running if slot is not None else 0
    if static <= 0:
        return 1.0
    if config.k <= 0 or running <= 0:
        return static
    return max(1.0, static / (1 + config.k * running))


def effective_tps(p: ProviderState, model: str, slot: Slot | None, config: Config, rings: TpsRegistry) -> float:
    if slot is not None and slot.observed_decode_tps > 0:
        return slot.observed_decode_tps
    fleet = rings.decode.median(model, p.family)
    if fleet > 0:
        return fleet
    return static_effective_tps(p, slot, config)


def prefill_fallback(p: ProviderState, config: Config, recalibrate: bool) -> tuple[float, str]:
    """Steps 3–4 of the prefill chain (before the ceiling): the anchor or the static rate."""
    static = p.static_prefill_tps(config)
    if recalibrate and p.backend is not None and config.prefill_anchor_tps > static:
        return config.prefill_anchor_tps, "anchor"
    return static, "static"


def resolve_prefill(p: ProviderState, model: str, slot: Slot | None, config: Config, rings: TpsRegistry,
                    recalibrate: bool, medians: bool | None = None) -> tuple[float, str]:
    """(prefill tok/s, source) — observed → median → anchor → static, capped at the ceiling."""
    if medians is None:
        medians = config.prefill_medians
    if slot is not None and slot.observed_prefill_tps > 0:
        value, source = slot.observed_prefill_tps, "observed"
    else:
        median, n = rings.prefill.stats(model, p.chip_class) if medians else (0.0, 0)
        if medians and median > 0 and n >= config.prefill_min_samples:
            value, source = median, "median"
        else:
            value, source = prefill_fallback(p, config, recalibrate)
    return min(value, config.max_prefill_tps), source


def raw_ttft_ms(p: ProviderState, model: str, slot: Slot | None, prompt: int, prefill: float,
                eff_tps: float) -> float:
    if p.backend is None:
        return 0.0
    if prefill <= 0:
        prefill = 1.0
    if eff_tps <= 0:
        eff_tps = 1.0
    running = slot.num_running if slot is not None else 0
    waiting = slot.num_waiting if slot is not None else 0
    pending_model = p.pending_by_model.get(model, 0)
    ahead = prompt * (waiting + max(0, pending_model - (running + waiting))) if prompt > 0 else 0
    penalty = state_penalty(slot_state(p, slot))
    ttft = penalty + ahead / prefill * 1000 + prompt / prefill * 1000 + 1000 / eff_tps
    if not math.isfinite(ttft) or ttft <= 0:
        return 0.0
    return ttft


def effective_queue(p: ProviderState, model: str, slot: Slot | None) -> int:
    backend = (slot.num_running + slot.num_waiting) if slot is not None else 0
    return max(p.pending_by_model.get(model, 0), backend)


def health_ms(p: ProviderState) -> float:
    gpu = 0.0
    b = p.backend
    if b is not None and b.total_memory_gb > 0:
        gpu = min(1.0, max(0.0, b.gpu_memory_active_gb / b.total_memory_gb))
    return (4000 * p.memory_pressure + 1500 * p.cpu_usage + THERMAL_MS.get(p.thermal, 0.0)
            + 5000 * gpu)


def cost_ms(p: ProviderState, model: str, slot: Slot | None, config: Config, prompt: int, req_max: int,
            eff_tps: float, resolved_prefill: float) -> float:
    state = slot_state(p, slot)
    penalty = state_penalty(state)
    queue_ms = QUEUE_MS * effective_queue(p, model, slot)
    pending_ms = PENDING_MS * len(p.pending)
    if slot is not None and slot.budget_max > 0:
        backlog = (slot.budget_used + slot.queued_budget) / eff_tps * 1000
    else:
        potential = slot.max_tokens_potential if slot is not None else 0
        waiting = slot.num_waiting if slot is not None else 0
        pend = p.pending_tokens_by_model.get(model, 0)
        backlog = (potential + waiting * req_max
                   + max(0, pend - potential - waiting * req_max)) / eff_tps * 1000
    static_prefill = min(p.static_prefill_tps(config), config.max_prefill_tps)
    this_req = prompt / static_prefill * 1000 + req_max / eff_tps * 1000
    if config.long_prompt_tokens > 0 and prompt >= config.long_prompt_tokens:
        cold = not (slot is not None and slot.loaded)
        this_req += (config.long_prompt_weight - 1) * (
            prompt / resolved_prefill * 1000 + (penalty if cold else 0.0))
    return penalty + queue_ms + pending_ms + backlog + this_req + health_ms(p)


def projected_decode_tps(p: ProviderState, slot: Slot | None, config: Config) -> float:
    b = max(0, slot.num_running) if slot is not None else 0
    observed = slot.observed_decode_tps if slot is not None else 0.0
    solo = observed * (1 + config.k * b) if observed > 0 else p.static_decode_tps()
    if solo <= 0:
        return 0.0
    return solo / (1 + config.k * (b + 1))
