"""Admission: per-model quality caps (domain §2.6), concurrency headroom (§2.6.5, §2.7), per-slot,
pooled-token and pooled-byte KV admission with cold pricing (§2.10), legacy memory admission and
hardware fit (§2.10.6), and the pooled remaining budget the capacity feed advertises (§2.10.7).
"""
from __future__ import annotations

import math

from .config import Config
from .provider import ProviderState, Slot
from .rings import TpsRegistry

KV_DEFAULT_BYTES_PER_TOKEN = 400_000
MAX_KV_TOKENS = 16 * 2**20
GIB = 2**30


# --- quality cap ----------------------------------------------------------------------------------
def quality_concurrency(solo: float, floor: float, k: float, base: int, fallback: int) -> int:
    limit = base if base > 0 else fallback
    limit = max(1, limit)
    if floor <= 0 or solo <= 0 or k <= 0:
        return limit
    if solo <= floor:
        return 1
    b = math.floor((solo / floor - 1) / k)
    return max(1, min(limit, b))


def class_solo_tps(model: str, chip_class: str, config: Config, rings: TpsRegistry) -> float | None:
    """The per-model solo rate for a chip class: own class median → min of class medians → seed;
    None when none applies (the provider's static rate is used then)."""
    if not config.per_model_tps:
        return None
    median, n = rings.solo.stats(model, chip_class)
    if n >= config.solo_min_samples and median > 0:
        return median
    cross, total, _ = rings.solo.min_across_chips(model)
    if total >= config.solo_min_samples and cross > 0:
        return cross  # rules §8: min of class medians, no seed clamp
    return config.solo_seed.get(model.lower())


def resolved_solo_tps(p: ProviderState, model: str, config: Config, rings: TpsRegistry) -> tuple[float, bool]:
    """(rate, per_model): own class median → min of class medians → seed → provider static rate."""
    rate = class_solo_tps(model, p.chip_class, config, rings)
    if rate is not None:
        return rate, True
    return p.static_decode_tps(), False


def base_concurrency(p: ProviderState, slot: Slot | None, config: Config) -> int:
    if slot is not None and slot.max_concurrency > 0:
        return slot.max_concurrency
    return p.box_max_concurrency(config)


def effective_cap(p: ProviderState, model: str, slot: Slot | None, config: Config, rings: TpsRegistry) -> int:
    base = base_concurrency(p, slot, config)
    if not config.quality_cap:
        return base
    return cap_for_class_rate(p, model, base, class_solo_tps(model, p.chip_class, config, rings), config)


def cap_for_class_rate(p: ProviderState, model: str, base: int, class_rate: float | None, config: Config) -> int:
    """The quality cap given the class's per-model solo rate (`class_solo_tps`; None = static)."""
    if class_rate is not None:
        rate, per_model = class_rate, True
    else:
        rate, per_model = p.static_decode_tps(), False
    if p.decode_tps <= 0 and not per_model and config.is_dedicated(model) is None:
        return base  # never cap a non-dedicated model from the bandwidth proxy
    qc = quality_concurrency(rate, config.decode_floor, config.k, base, config.fallback_concurrency)
    capped = max(1, math.ceil(qc * config.overcommit_for(model)))
    return min(capped, base)


def pending_load_for_model(p: ProviderState, model: str, slot: Slot | None) -> int:
    if slot is not None and slot.max_concurrency > 0:
        return max(p.pending_by_model.get(model, 0), slot.num_running + slot.num_waiting)
    return len(p.pending)


def has_headroom(p: ProviderState, model: str, slot: Slot | None, config: Config, rings: TpsRegistry,
                 cap: int | None = None) -> bool:
    """`cap`: the provider's `effective_cap` for the model, when the caller already has it."""
    if cap is None:
        cap = effective_cap(p, model, slot, config, rings)
    return pending_load_for_model(p, model, slot) < cap and len(p.pending) < p.box_max_concurrency(config)


# --- KV admission ---------------------------------------------------------------------------------
def slot_budget_admits(p: ProviderState, model: str, slot: Slot, tokens: int) -> bool:
    used_queued = slot.budget_used + slot.queued_budget
    committed = max(0, max(used_queued, slot.max_tokens_potential))
    extra = max(0, p.pending_tokens_by_model.get(model, 0) - committed)
    return used_queued + extra + tokens <= slot.budget_max


def pooled_remaining_tokens(p: ProviderState, model: str, slot: Slot | None) -> int:
    """−1 when the box reports no budget; else the largest n that `pooled_budget_admits` accepts."""
    b = p.backend
    if b is None or b.pool.total <= 0:
        return -1
    pool = b.pool
    pending_bytes = p.pending_bytes()
    if pool.byte_mode and pending_bytes is not None:
        rate = slot.kv_bytes_per_token if slot is not None and slot.kv_bytes_per_token > 0 else pool.max_rate
        free = pool.total_bytes - pool.used_bytes - max(0, pending_bytes - pool.committed_bytes)
        return max(0, free) // rate
    return max(0, pool.total - pool.used - max(0, p.pending_tokens_all - pool.committed))


def pooled_budget_admits(p: ProviderState, model: str, slot: Slot | None, tokens: int) -> bool:
    b = p.backend
    if b is None or b.pool.total <= 0:
        return True
    pool = b.pool
    pending_bytes = p.pending_bytes()
    if pool.byte_mode and pending_bytes is not None:
        rate = slot.kv_bytes_per_token if slot is not None and slot.kv_bytes_per_token > 0 else pool.max_rate
        return (pool.used_bytes + max(0, pending_bytes - pool.committed_bytes) + tokens * rate
                <= pool.total_bytes)
    return pool.used + max(0, p.pending_tokens_all - pool.committed) + tokens <= pool.total


def free_memory_admits(p: ProviderState, model: str, slot: Slot | None, prompt: int, max_tokens: int) -> bool:
    tokens = prompt + max_tokens
    if slot is not None and slot.budget_max > 0:
        return slot_budget_admits(p, model, slot, tokens) and pooled_budget_admits(p, model, slot, tokens)
    if not pooled_budget_admits(p, model, slot, tokens):
        return False
    entry = p.models.get(model)
    size = entry.size_gb if entry is not None else 0.0
    total = p.total_memory_gb()
    if size <= 0 or total <= 0:
        return True
    kv_gb = min(tokens, MAX_KV_TOKENS) * KV_DEFAULT_BYTES_PER_TOKEN / GIB
    loaded = slot is not None and slot.loaded
    required = (0.0 if loaded else size) + kv_gb
    b = p.backend
    if not loaded and not p.pending:
        if b is not None and b.free_for_load_gb is not None:
            return size * 1.2 * (1e9 / GIB) <= b.free_for_load_gb
        return size + kv_gb + 4 <= total
    active = b.gpu_memory_active_gb if b is not None else 0.0
    return total - active >= required


def hardware_fits(p: ProviderState, model: str) -> bool:
    entry = p.models.get(model)
    total = p.total_memory_gb()
    if entry is None or total <= 0:
        return True
    if entry.min_ram_gb > 0:
        return entry.min_ram_gb <= total
    if entry.size_gb > 0:
        return entry.size_gb * 2 <= total
    return True
