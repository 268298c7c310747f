"""The fast path (streams/candidates.py: per-model candidate columns, vectorised scan and selection)
decides exactly like the scalar scan (`Router(fast=False)`, the path `explain` traces).

Random journals — fleets of several providers over several models with random slots, budgets,
rates, pending reservations, thermal states, versions, trust, accounts, legacy providers without
backend capacity, config patches (hard TTFT gate, band, enforce/shadow, floors, dedicated models,
caps, long prompts, …), calibrator windows past warm-up, disconnects and staleness — are fed to
both routers; every output (decisions, reservations, telemetry) must be identical, floats included
(bit for bit: both paths use the same formulas in the same order).
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings, strategies as st

from streams import scan_kernel
from streams.calibration import WARM_UP, SampleRing, WINDOW
from streams.router import Router

MODELS = ["gpt-oss-20b", "gemma-4-26b-qat-4bit", "qwen-vl-7b"]
CHIPS = [("M3", "Max"), ("M4", "Max"), ("M4", "Pro"), ("M2", "Ultra"), ("M1", "")]
VERSIONS = ["0.7.5", "0.8.1", "0.6.0", "", "v0.9.0-rc1"]
ACCOUNTS = [None, None, "acct-a", "acct-b"]
STATES = ["running", "running", "running", "idle", "idle_shutdown", "reloading", "crashed"]

CONFIG_CHOICES = {
    "TTFT_HARD_REJECT": ["true", "false"],
    "SATISFICING_BAND": ["true", "false"],
    "SATISFICING_RESPECT_HEALTH": ["true", "false"],
    "SATISFICING_TTFT_MARGIN_MS": ["0", "1000", "5000"],
    "PREFILL_FALLBACK_MODE": ["off", "shadow", "enforce"],
    "MIN_TRUST": ["none", "self_signed", "hardware"],
    "DEDICATED_MODELS": ["", "gemma", "qwen"],
    "MODEL_VERSION_FLOORS": ["", "gpt-oss=0.7.0", "gemma=0.8.0,qwen=0.7.5"],
    "QUALITY_CONCURRENCY_CAP": ["true", "false"],
    "QUALITY_CAP_PER_MODEL_TPS": ["true", "false"],
    "QUALITY_CAP_SOLO_MIN_SAMPLES": ["1", "2", "5"],
    "QUALITY_CONCURRENCY_OVERCOMMIT": ["1.2", "2.5", "0.5"],
    "MODEL_SOLO_TPS_SEED": ["", "gpt-oss-20b=40,qwen-vl-7b=12"],
    "WARM_POOL_DECODE_FLOOR_TPS": ["15", "0", "30"],
    "TTFT_PREFILL_MEDIANS": ["true", "false"],
    "TTFT_PREFILL_MIN_SAMPLES": ["1", "2", "5"],
    "TTFT_CALIBRATION": ["on", "off"],
    "TTFT_LIVE_DEADLINE_BASE_MS": ["5000", "400", "30000"],
    "LONG_PROMPT_TOKENS": ["0", "2000"],
    "LONG_PROMPT_PREFILL_WEIGHT": ["2.0", "3.5"],
    "MIN_DECODE_TPS": ["15", "0", "25"],
    "EFFECTIVE_TPS_LOAD_FACTOR": ["0.27", "0", "0.5"],
    "CACHE_AFFINITY_BONUS_MS": ["1500", "0", "10000"],
    "QUEUE_BEFORE_SHED": ["true", "false"],
    "QUEUE_MAX_DEPTH": ["10", "2"],
    "V2_VERSION_FLOOR": ["", "0.8.0"],
    "V2_MAX_CONCURRENCY_CEILING": ["4", "2"],
    "MAX_PREFILL_TPS": ["20000", "5000"],
    "PREFILL_FALLBACK_TPS": ["6500", "300"],
}


def _odd(rng: random.Random, lo: float, hi: float) -> float:
    """An irregular float, so that any reordering of the arithmetic shows up in the last bits."""
    return rng.uniform(lo, hi)


def _registration(rng: random.Random, pid: str, now: int) -> dict:
    fam, tier = rng.choice(CHIPS)
    models = rng.sample(MODELS, rng.randint(1, len(MODELS)))
    return {"type": "ProviderRegistered", "event_id": f"reg-{pid}-{rng.random()}", "provider_id": pid,
            "registered_at_ms": now, "version": rng.choice(VERSIONS), "account_id": rng.choice(ACCOUNTS),
            "trust_level": rng.choice(["hardware"] * 6 + ["self_signed", "none"]),
            "private_only": rng.random() < 0.05,
            "hardware": {"chip_name": f"Apple {fam} {tier}", "chip_family": fam, "chip_tier": tier,
                         "memory_gb": rng.choice([16.0, 36.0, 64.0, 128.0, 192.0]),
                         "memory_bandwidth_gbs": rng.choice([0.0, 150.0, 400.0, 800.0]), "gpu_cores": 40},
            "decode_tps": rng.choice([0.0, 20.0, 45.0, _odd(rng, 8, 90)]),
            "prefill_tps": rng.choice([0.0, 0.0, 300.0, _odd(rng, 100, 9000)]),
            "models": [{"id": m, "size_bytes": rng.choice([0, 12_000_000_000, 60_000_000_000]),
                        "min_ram_gb": rng.choice([0.0, 0.0, 24.0, 100.0]), "is_vision": "vl" in m or rng.random() < 0.2}
                       for m in models]}


def _slot(rng: random.Random, model: str) -> dict:
    budget = rng.random() < 0.5
    running = rng.choice([0, 0, 1, 1, 2, 3])
    return {"model": model, "state": rng.choice(STATES), "num_running": running,
            "num_waiting": rng.choice([0, 0, 0, 1, 2]), "max_concurrency": rng.choice([0, 0, 1, 2, 4, 8, 30]),
            "max_tokens_potential": rng.choice([0, 0, 1000, 8000]),
            "observed_decode_tps": rng.choice([0.0, 0.0, 18.0, 31.5, _odd(rng, 3, 120), _odd(rng, 3, 120)]),
            "observed_prefill_tps": rng.choice([0.0, 0.0, 0.0, 2500.0, _odd(rng, 50, 19000), 30000.0]),
            "active_token_budget_used": rng.choice([0, 500, 4000]) if budget else 0,
            "active_token_budget_max": rng.choice([3000, 20_000, 200_000]) if budget else 0,
            "queued_token_budget": rng.choice([0, 0, 700]) if budget else 0,
            "kv_bytes_per_token": rng.choice([0, 50_000, 120_000]), "model_load_time_ms": 0.0}


def _heartbeat(rng: random.Random, pid: str, models: list[str], seq: int, now: int) -> dict:
    legacy = rng.random() < 0.15
    slots = [_slot(rng, m) for m in models if rng.random() < 0.8]
    if rng.random() < 0.1:
        slots.append(_slot(rng, "unadvertised-model"))
    return {"type": "Heartbeat", "event_id": f"hb-{pid}-{seq}-{rng.random()}", "provider_id": pid,
            "seq": seq, "sent_at_ms": now,
            "status": rng.choice(["idle", "serving", "serving", "draining"] if rng.random() < 0.3 else ["serving"]),
            "warm_models": models,
            "system_metrics": {"memory_pressure": rng.choice([0.0, 0.1, _odd(rng, 0, 1)]),
                               "cpu_usage": rng.choice([0.1, _odd(rng, 0, 1)]),
                               "thermal_state": rng.choice(["nominal"] * 5 + ["fair", "serious", "critical"])},
            "backend_capacity": None if legacy else {
                "total_memory_gb": rng.choice([0.0, 64.0, 128.0]),
                "gpu_memory_active_gb": rng.choice([0.0, 8.0, _odd(rng, 0, 100)]),
                "free_for_load_gb": rng.choice([None, None, 10.0, 90.0]), "slots": slots}}


def _request(rng: random.Random, rid: str, now: int, pids: list[str]) -> dict:
    account = rng.choice(ACCOUNTS)
    special = rng.random() < 0.4
    self_route = special and account is not None and rng.random() < 0.3
    prefer_owner = special and account is not None and not self_route and rng.random() < 0.4
    return {"type": "RouteRequest", "request_id": rid, "attempt": rng.choice([0, 0, 0, 1]),
            "model": rng.choice(MODELS + ["unknown-model"] if rng.random() < 0.05 else MODELS),
            "prompt_tokens": rng.choice([0, 100, 1200, 2500, 9000, 150_000]),
            "max_tokens": rng.choice([0, 256, 512, 4000]),
            "max_ttft_ms": rng.choice([0.0, 0.0, 0.0, 800.0, 3000.0, 40_000.0]),
            "min_decode_tps": rng.choice([0.0, 0.0, 10.0, 30.0]),
            "account_id": account, "consumer_key": rng.choice([None, "cons-1"]),
            "cache_affinity_key": rng.choice([None, "chat-1", "chat-2"]),
            "self_route_only": self_route, "prefer_owner": prefer_owner,
            "requires_vision": special and rng.random() < 0.25,
            "allowed_provider_ids": rng.sample(pids, min(len(pids), 2)) if special and rng.random() < 0.2 else [],
            "excluded_provider_ids": rng.sample(pids, min(len(pids), 1)) if special and rng.random() < 0.2 else [],
            "avoid_version": rng.choice(VERSIONS[:3]) if special and rng.random() < 0.3 else None,
            "reply_to": "", "sent_at_ms": now}


def journal(seed: int, n_providers: int, steps: int) -> list[dict]:
    """A random but reproducible journal, as JSON Lines records with a "type" key."""
    rng = random.Random(seed)
    now = 1_000
    lines: list[dict] = []
    pids = [f"box-{i:02d}" for i in range(n_providers)]
    online: dict[str, list[str]] = {}
    seqs: dict[str, int] = {}
    patch = {f"EIGENINFERENCE_{k}": rng.choice(v) for k, v in CONFIG_CHOICES.items() if rng.random() < 0.4}
    if patch:
        lines.append({"type": "ConfigChange", "config_id": "t", "settings": patch, "changed_at_ms": now, "author": "t"})
    for pid in pids:
        reg = _registration(rng, pid, now)
        lines.append(reg)
        online[pid] = [m["id"] for m in reg["models"]]
        seqs[pid] = 1
        lines.append(_heartbeat(rng, pid, online[pid], 1, now))
    rid = 0
    for _ in range(steps):
        now += rng.choice([0, 10, 500])
        x = rng.random()
        live = sorted(online)
        if x < 0.45:
            rid += 1
            lines.append(_request(rng, f"req-{rid}", now, pids))
        elif x < 0.7 and live:
            pid = rng.choice(live)
            seqs[pid] += 1
            lines.append(_heartbeat(rng, pid, online[pid], seqs[pid], now))
        elif x < 0.85:
            lines.append({"type": "Completion", "event_id": f"done-{rng.random()}",
                          "request_id": f"req-{rng.randint(1, max(1, rid))}", "attempt": rng.choice([0, 0, 1]),
                          "provider_id": "", "model": "", "status": rng.choice(["ok", "ok", "error", "cancelled"]),
                          "prompt_tokens": 100, "completion_tokens": 10,
                          "ttft_ms": rng.choice([0.0, 350.0, 1800.0]), "completed_at_ms": now})
        elif x < 0.89:
            k, v = rng.choice(sorted(CONFIG_CHOICES.items()))
            lines.append({"type": "ConfigChange", "config_id": "t", "settings": {f"EIGENINFERENCE_{k}": rng.choice(v)},
                          "changed_at_ms": now, "author": "t"})
        elif x < 0.93 and live:
            pid = rng.choice(live)
            del online[pid]
            lines.append({"type": "ProviderDisconnected", "event_id": f"dc-{rng.random()}", "provider_id": pid,
                          "at_ms": now, "reason": "closed"})
        elif x < 0.97:
            pid = rng.choice(pids)
            reg = _registration(rng, pid, now)
            lines.append(reg)
            online[pid] = [m["id"] for m in reg["models"]]
            seqs[pid] = 1
            lines.append(_heartbeat(rng, pid, online[pid], 1, now))
        elif x < 0.985:
            lines.append({"type": "CalibratorSeed", "model": rng.choice(MODELS), "family": rng.choice(CHIPS)[0],
                          "source": rng.choice(["observed", "median", "anchor", "static"]),
                          "ratio": rng.choice([0.3, 0.55, 1.3, 2.0]), "by_family": rng.random() < 0.5})
        else:
            big = rng.random() < 0.25
            now += 95_000 if big else 20_000
            lines.append({"type": "Tick", "at_ms": now})
            if big:  # every provider went stale: the fleet reconnects
                for pid in pids:
                    reg = _registration(rng, pid, now)
                    lines.append(reg)
                    online[pid] = [m["id"] for m in reg["models"]]
                    seqs[pid] = 1
                    lines.append(_heartbeat(rng, pid, online[pid], 1, now))
    return lines


def _seed_calibrator(router: Router, line: dict) -> None:
    """Put a calibrator window past warm-up (too slow to reach through 50 completions here)."""
    cal = router.calibrator
    if line["by_family"]:
        key, table = (line["model"], line["family"], line["source"]), cal.by_family
    else:
        key, table = (line["model"], line["source"]), cal.by_model
    ring = table.get(key)
    if ring is None:
        ring = table[key] = SampleRing(WINDOW)
    for _ in range(WARM_UP):
        ring.record(line["ratio"])
    cal.observations += WARM_UP
    counts = cal.versions.setdefault(line["model"], {})
    counts[line["source"]] = counts.get(line["source"], 0) + WARM_UP


def run_both(lines: list[dict]) -> tuple[Router, Router]:
    fast, scalar = Router(), Router(fast=False)
    for offset, line in enumerate(lines):
        record = dict(line)
        kind = record.pop("type")
        if kind == "CalibratorSeed":
            _seed_calibrator(fast, record)
            _seed_calibrator(scalar, record)
            continue
        got = fast.apply(offset, None, kind, dict(record))
        want = scalar.apply(offset, None, kind, dict(record))
        assert got == want, f"line {offset} ({kind}): fast {got!r} != scalar {want!r}"
        # the capacity feed, from the index vs the loop, and no effect on decisions; not after
        # every line, so that several heartbeats' rows are rebuilt at the next read of an index
        for model in MODELS if offset % 4 == 3 else ():
            got, want = fast.capacity(model), scalar.capacity(model)
            assert got == want, f"line {offset}: capacity of {model}: fast {got!r} != scalar {want!r}"
    assert fast.counters == scalar.counters
    assert fast.reservations == scalar.reservations
    return fast, scalar


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_providers=st.integers(2, 10), steps=st.integers(5, 90))
def test_fast_path_decides_like_the_scalar_scan(seed, n_providers, steps):
    fast, _ = run_both(journal(seed, n_providers, steps))
    assert fast.fast.stats["declined_index"] == 0 and fast.fast.stats["declined_cost"] == 0
    assert fast.fast.stats["declined_capacity"] == 0


def test_fast_path_serves_most_decisions_on_a_long_journal():
    """A longer run over a bigger fleet: identical outputs, and the fast path did the deciding."""
    fast, _ = run_both(journal(7, 40, 1500))
    stats = fast.fast.stats
    assert stats["scans"] > 500 and stats["capacity"] > 500
    assert stats["declined_index"] == 0 and stats["declined_cost"] == 0


def test_the_warm_up_compiles_every_variant_a_long_journal_uses():
    """A worker compiles the loops when it starts; a decision must never compile another variant
    (an F-ordered column copy after a re-layout once did: seconds on a request's path)."""
    scan_kernel.warm_up()
    kernels = [v for v in vars(scan_kernel).values() if hasattr(v, "signatures")]
    before = {k.__name__: len(k.signatures) for k in kernels}
    fast, _ = run_both(journal(7, 40, 1500))
    assert fast.fast.stats["scans"] > 500
    assert {k.__name__: len(k.signatures) for k in kernels} == before


def test_decisions_match_with_rings_and_calibration_warm():
    """Small min-sample settings so ring medians, the solo cap and calibrated TTFTs all move."""
    rng_lines = journal(11, 12, 600)
    warm = {"type": "ConfigChange", "config_id": "t", "changed_at_ms": 1_000, "author": "t", "settings": {
        "EIGENINFERENCE_QUALITY_CAP_SOLO_MIN_SAMPLES": "1", "EIGENINFERENCE_TTFT_PREFILL_MIN_SAMPLES": "1",
        "EIGENINFERENCE_SATISFICING_BAND": "true", "EIGENINFERENCE_TTFT_HARD_REJECT": "true"}}
    seeds = [{"type": "CalibratorSeed", "model": m, "family": f, "source": s, "ratio": 0.5, "by_family": True}
             for m in MODELS for f, _ in CHIPS for s in ("observed", "median", "static")]
    run_both([warm] + seeds + rng_lines)


def twin_journal(seed: int, n_providers: int, steps: int) -> list[dict]:
    """Near-identical providers (the benchmark fleet's shape): many exact cost ties, so near-tie
    draws, affinity and the band decide often."""
    rng = random.Random(seed)
    now = 1_000
    lines: list[dict] = [{"type": "ConfigChange", "config_id": "t", "changed_at_ms": now, "author": "t",
                          "settings": {"EIGENINFERENCE_SATISFICING_BAND": rng.choice(["true", "false"]),
                                       "EIGENINFERENCE_QUALITY_CAP_SOLO_MIN_SAMPLES": "1"}}]
    models = MODELS[:2]
    for i in range(n_providers):
        pid = f"twin-{i:03d}"
        lines.append({"type": "ProviderRegistered", "event_id": f"reg-{pid}", "provider_id": pid,
                      "registered_at_ms": now, "version": "0.7.5", "account_id": None, "trust_level": "hardware",
                      "private_only": False,
                      "hardware": {"chip_name": "Apple M4 Max", "chip_family": "M4", "chip_tier": "Max",
                                   "memory_gb": 128.0, "memory_bandwidth_gbs": 546.0, "gpu_cores": 40},
                      "decode_tps": 50.0, "prefill_tps": 0.0,
                      "models": [{"id": m, "size_bytes": 12_000_000_000, "min_ram_gb": 24.0, "is_vision": False}
                                 for m in models]})
    seq = 1

    def beat(pid, busy):
        return {"type": "Heartbeat", "event_id": f"hb-{pid}-{seq}", "provider_id": pid, "seq": seq,
                "sent_at_ms": now, "status": "serving", "warm_models": models,
                "system_metrics": {"memory_pressure": 0.1, "cpu_usage": 0.1, "thermal_state": "nominal"},
                "backend_capacity": {"total_memory_gb": 128.0, "gpu_memory_active_gb": 8.0, "free_for_load_gb": None,
                                     "slots": [{"model": m, "state": "running", "num_running": busy if k == 0 else 0,
                                                "num_waiting": 0, "max_concurrency": 0, "max_tokens_potential": 0,
                                                "observed_decode_tps": 40.0, "observed_prefill_tps": 5000.0,
                                                "active_token_budget_used": 0, "active_token_budget_max": 100_000,
                                                "queued_token_budget": 0, "kv_bytes_per_token": 60_000,
                                                "model_load_time_ms": 0.0} for k, m in enumerate(models)]}}

    for i in range(n_providers):
        lines.append(beat(f"twin-{i:03d}", 0))
    for k in range(steps):
        now += 5
        x = rng.random()
        if x < 0.6:
            lines.append({"type": "RouteRequest", "request_id": f"t{k}", "attempt": 0, "model": rng.choice(models),
                          "prompt_tokens": 800, "max_tokens": 256, "max_ttft_ms": 0.0, "min_decode_tps": 0.0,
                          "account_id": None, "consumer_key": "c", "cache_affinity_key": rng.choice(["a", "b", None]),
                          "self_route_only": False, "prefer_owner": False, "requires_vision": False,
                          "allowed_provider_ids": [], "excluded_provider_ids": [], "avoid_version": None,
                          "reply_to": "", "sent_at_ms": now})
        elif x < 0.85:
            lines.append({"type": "Completion", "event_id": f"d{k}", "request_id": f"t{rng.randint(0, k)}",
                          "attempt": 0, "provider_id": "", "model": "", "status": "ok", "prompt_tokens": 800,
                          "completion_tokens": 10, "ttft_ms": 0.0, "completed_at_ms": now})
        else:
            seq += 1
            lines.append(beat(f"twin-{rng.randrange(n_providers):03d}", rng.choice([0, 1, 1, 2])))
    return lines


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_providers=st.integers(2, 40), steps=st.integers(10, 150))
def test_fast_path_breaks_ties_like_the_scalar_scan(seed, n_providers, steps):
    run_both(twin_journal(seed, n_providers, steps))
