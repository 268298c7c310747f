"""Synthetic fleets for core benchmarks (domain §5): n providers, each advertising `per_box` of
`models` models with warm slots, deterministic rates and load."""
from __future__ import annotations

CHIPS = [("M3", "Max", 400.0, 64.0), ("M4", "Max", 546.0, 128.0), ("M2", "Ultra", 800.0, 192.0),
         ("M4", "Pro", 273.0, 48.0), ("M1", "Max", 400.0, 64.0)]


def model_names(n: int) -> list[str]:
    return ["gpt-oss-20b", "gemma-4-26b-qat-4bit"] + [f"model-{i:02d}" for i in range(n - 2)]


def fleet_events(n: int, models: int, per_box: int, at_ms: int = 1_000) -> list[tuple[str, dict]]:
    names = model_names(models)
    events = []
    for i in range(n):
        pid = f"p{i:05d}"
        fam, tier, bw, mem = CHIPS[i % len(CHIPS)]
        mine = [names[(i + j) % models] for j in range(per_box)]
        events.append(("ProviderRegistered", {
            "event_id": f"reg-{pid}", "provider_id": pid, "registered_at_ms": at_ms, "version": "0.7.5",
            "trust_level": "hardware", "private_only": False,
            "hardware": {"chip_name": f"Apple {fam} {tier}", "chip_family": fam, "chip_tier": tier,
                         "memory_gb": mem, "memory_bandwidth_gbs": bw, "gpu_cores": 40},
            "decode_tps": 40.0 + i % 17, "prefill_tps": 0.0,
            "models": [{"id": m, "size_bytes": 12_000_000_000, "min_ram_gb": 24.0, "is_vision": False}
                       for m in mine]}))
        events.append(("Heartbeat", heartbeat(pid, i, mine, 1, at_ms + 1)))
    return events


def heartbeat(pid: str, i: int, mine: list[str], seq: int, at_ms: int, shift: int = 0) -> dict:
    """Provider i's heartbeat; `shift` moves its load (running requests, budgets, EWMAs)."""
    i0, i = i, i + shift
    return {"event_id": f"hb-{pid}-{seq}", "provider_id": pid, "seq": seq, "sent_at_ms": at_ms,
            "status": "serving", "warm_models": mine,
            "system_metrics": {"memory_pressure": 0.1 + (i0 % 5) / 10, "cpu_usage": 0.1 + (i % 4) / 10,
                               "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 8.0,
                                 "free_for_load_gb": None, "slots": [
                {"model": m, "state": "running", "num_running": (i + k) % 3, "num_waiting": 0,
                 "max_concurrency": 0, "active_tokens": 0, "max_tokens_potential": 2000 * ((i + k) % 3),
                 "observed_decode_tps": float(30 + i % 11 if k == 0 else 25 + i % 13),
                 "observed_prefill_tps": float(5000 + 37 * (i % 50)),
                 "active_token_budget_used": 2000 * ((i + k) % 3), "active_token_budget_max": 200_000,
                 "queued_token_budget": 0, "kv_bytes_per_token": 50_000 * (k + 1),
                 "model_load_time_ms": 0.0} for k, m in enumerate(mine)]}}


def request(rid: str, model: str, at_ms: int, prompt: int = 1200) -> dict:
    return {"request_id": rid, "attempt": 0, "model": model, "prompt_tokens": prompt, "max_tokens": 512,
            "max_ttft_ms": 0.0, "min_decode_tps": 0.0, "account_id": None, "consumer_key": None,
            "cache_affinity_key": None, "self_route_only": False, "prefer_owner": False,
            "requires_vision": False, "allowed_provider_ids": [], "excluded_provider_ids": [],
            "avoid_version": None, "reply_to": "", "sent_at_ms": at_ms}
