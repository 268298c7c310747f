"""Hostile input never crashes the routing core and never pushes a ring, median, budget or counter
out of its bounds (architecture invariant 3). Hypothesis throws generated event streams — NaN, Inf,
negative and huge numbers, absurd KV rates, thousands of slots, unknown models and enums, empty
versions, replayed sequence numbers — at `Router.apply` and checks the state after every entry.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings, strategies as st

from streams.provider import MAX_DECODE_TPS, MAX_KV_BYTES_PER_TOKEN
from streams.router import Router

PIDS = ["a", "b", "c", "d"]
MODELS = ["gpt-oss-20b", "gemma-4-26b-qat-4bit", "", "X" * 300]
EXAMPLES = 300          # hypothesis: shrinkable streams of up to 60 events
EVENTS = 60
VOLUME = 100_000        # plus a seeded stream of this many events, for volume

hostile_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, -1.0, 1e308, -1e308, 6500.0, 25000.0, 1e-320]))
hostile_int = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from([0, -1, 1, 2**62, 10**10]))
word = st.one_of(st.sampled_from(["", "running", "idle", "crashed", "reloading", "idle_shutdown", "draining",
                                  "serving", "nominal", "critical", "fair", "hardware", "none", "weird"]),
                 st.text(max_size=8))


@st.composite
def slot(draw):
    return {"model": draw(st.sampled_from(MODELS)), "state": draw(word), "num_running": draw(hostile_int),
            "num_waiting": draw(hostile_int), "max_concurrency": draw(hostile_int),
            "active_tokens": draw(hostile_int), "max_tokens_potential": draw(hostile_int),
            "observed_decode_tps": draw(hostile_float), "observed_prefill_tps": draw(hostile_float),
            "active_token_budget_used": draw(hostile_int), "active_token_budget_max": draw(hostile_int),
            "queued_token_budget": draw(hostile_int), "kv_bytes_per_token": draw(hostile_int),
            "model_load_time_ms": draw(hostile_float)}


@st.composite
def event(draw):
    return hostile_event(draw)


def hostile_event(draw):
    kind = draw(st.sampled_from(["ProviderRegistered", "Heartbeat", "Heartbeat", "Heartbeat", "RouteRequest",
                                 "RouteRequest", "Completion", "ProviderDisconnected", "ConfigChange", "Tick",
                                 "Bogus"]))
    pid = draw(st.sampled_from(PIDS))
    t = draw(st.one_of(st.integers(0, 10**7), st.sampled_from([-5, 2**62])))
    if kind == "ProviderRegistered":
        return kind, {"event_id": draw(st.sampled_from(["r1", "r2", "", pid])), "provider_id": pid,
                      "registered_at_ms": t, "version": draw(st.sampled_from(["", "0.7.5", "v0.7.4", "x.y", "9" * 40])),
                      "trust_level": draw(word), "private_only": draw(st.booleans()),
                      "hardware": {"chip_name": "Apple M3 Max", "chip_family": draw(st.sampled_from(["M3", ""])),
                                   "chip_tier": "Max", "memory_gb": draw(hostile_float),
                                   "memory_bandwidth_gbs": draw(hostile_float), "gpu_cores": 1},
                      "decode_tps": draw(hostile_float), "prefill_tps": draw(hostile_float),
                      "models": [{"id": m, "size_bytes": draw(hostile_int), "min_ram_gb": draw(hostile_float),
                                  "is_vision": draw(st.booleans())}
                                 for m in draw(st.lists(st.sampled_from(MODELS), max_size=3))]}
    if kind == "Heartbeat":
        many = draw(st.integers(0, 10)) == 0
        slots = [draw(slot())] * 2000 if many else draw(st.lists(slot(), max_size=3))
        return kind, {"event_id": draw(st.text(max_size=3)), "provider_id": pid, "seq": draw(hostile_int),
                      "sent_at_ms": t, "status": draw(word), "warm_models": [],
                      "system_metrics": {"memory_pressure": draw(hostile_float), "cpu_usage": draw(hostile_float),
                                         "thermal_state": draw(word)},
                      "backend_capacity": draw(st.one_of(st.none(), st.just({
                          "total_memory_gb": draw(hostile_float), "gpu_memory_active_gb": draw(hostile_float),
                          "free_for_load_gb": draw(st.one_of(st.none(), hostile_float)), "slots": slots})))}
    if kind == "RouteRequest":
        return kind, {"request_id": draw(st.sampled_from(["q1", "q2", "q3", "", "q4"])),
                      "attempt": draw(st.sampled_from([0, 1, -1])), "model": draw(st.sampled_from(MODELS)),
                      "prompt_tokens": draw(hostile_int), "max_tokens": draw(hostile_int),
                      "max_ttft_ms": draw(hostile_float), "min_decode_tps": draw(hostile_float),
                      "account_id": None, "consumer_key": draw(st.sampled_from([None, "c"])),
                      "cache_affinity_key": draw(st.sampled_from([None, "k"])),
                      "self_route_only": draw(st.booleans()), "prefer_owner": False, "requires_vision": False,
                      "allowed_provider_ids": [], "excluded_provider_ids": [], "avoid_version": None,
                      "reply_to": "", "sent_at_ms": t}
    if kind == "Completion":
        return kind, {"event_id": draw(st.text(max_size=3)), "request_id": draw(st.sampled_from(["q1", "q2", "zz"])),
                      "attempt": 0, "provider_id": pid, "model": "gpt-oss-20b",
                      "status": draw(st.sampled_from(["ok", "error", "cancelled", "weird"])),
                      "prompt_tokens": 1, "completion_tokens": 1, "ttft_ms": draw(hostile_float),
                      "completed_at_ms": t}
    if kind == "ProviderDisconnected":
        return kind, {"event_id": draw(st.text(max_size=3)), "provider_id": pid, "at_ms": t, "reason": "x"}
    if kind == "ConfigChange":
        name = draw(st.sampled_from(["EIGENINFERENCE_SATISFICING_BAND", "EIGENINFERENCE_TTFT_HARD_REJECT",
                                     "EIGENINFERENCE_PREFILL_FALLBACK_MODE", "EIGENINFERENCE_MAX_PREFILL_TPS",
                                     "EIGENINFERENCE_NOPE", "EIGENINFERENCE_QUEUE_MAX_DEPTH"]))
        value = draw(st.sampled_from(["true", "enforce", "NaN", "inf", "-3", "1", "", "garbage"]))
        return kind, {"config_id": "x", "settings": {name: value}, "changed_at_ms": t, "author": "fuzz"}
    if kind == "Tick":
        return kind, {"at_ms": t}
    return kind, {"whatever": draw(hostile_int)}


def check_bounds(router: Router) -> None:
    max_prefill = router.config.max_prefill_tps
    for family, limit in ((router.rings.decode, MAX_DECODE_TPS), (router.rings.solo, MAX_DECODE_TPS),
                          (router.rings.prefill, max_prefill)):
        for ring in family.rings.values():
            samples = ring.samples()
            assert len(samples) <= 50
            assert all(0 < s <= limit and math.isfinite(s) for s in samples)
            if samples:
                assert min(samples) <= ring.median <= max(samples)
    for p in router.providers.values():
        assert p.pending_tokens_all >= 0 and all(v > 0 for v in p.pending_by_model.values())
        assert 0 <= p.memory_pressure <= 1 and 0 <= p.cpu_usage <= 1
        b = p.backend
        if b is not None:
            assert len(b.slots) <= 64
            pool = b.pool
            assert pool.used >= 0 and pool.total >= 0 and pool.used_bytes >= 0 and pool.total_bytes >= 0
            assert all(0 <= s.kv_bytes_per_token <= MAX_KV_BYTES_PER_TOKEN for s in b.slots)
            assert all(0 <= s.observed_decode_tps <= MAX_DECODE_TPS for s in b.slots)
            assert all(s.max_concurrency <= 24 for s in b.slots)
    assert all(v >= 0 for v in router.counters.values())


def check_outputs(outputs: list) -> None:
    for kind, record in outputs:
        if kind == "RouteDecision":
            assert math.isfinite(record["estimated_ttft_ms"]) and record["estimated_ttft_ms"] >= 0
            assert math.isfinite(record["cost_ms"])
            assert record["http_status"] in (200, 202, 400, 429, 503)
            assert record["outcome"] in ("routed", "queued", "rejected")
        elif kind == "Rejected":
            assert record["reason"]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(event(), min_size=EVENTS // 2, max_size=EVENTS))
def test_hostile_event_streams_never_crash_or_break_bounds(events):
    router = Router()
    for offset, (kind, record) in enumerate(events):
        outputs = router.apply(offset, None, kind, record)
        check_outputs(outputs)
        check_bounds(router)


FLOATS = [0.0, -1.0, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 6500.0, 25000.0, 1e-320,
          14.0, 93.0, 3.5]
INTS = [0, -1, 1, 2, 3, 24, 30, 2**62, -(2**63), 2**63 - 1, 10**10, 1000, 100_000]
WORDS = ["", "running", "idle", "crashed", "reloading", "idle_shutdown", "draining", "serving", "nominal",
         "critical", "fair", "hardware", "none", "weird"]


def random_event(rng) -> tuple[str, dict]:
    """The same hostile shapes as `hostile_event`, drawn with a seeded generator for volume."""
    f, i, w = (lambda: rng.choice(FLOATS)), (lambda: rng.choice(INTS)), (lambda: rng.choice(WORDS))
    pid, t = rng.choice(PIDS), rng.choice([rng.randrange(10**7), -5, 2**62])
    kind = rng.choice(["ProviderRegistered", "Heartbeat", "Heartbeat", "Heartbeat", "RouteRequest",
                       "RouteRequest", "Completion", "ProviderDisconnected", "ConfigChange", "Tick", "Bogus"])
    if kind == "ProviderRegistered":
        return kind, {"event_id": f"r{rng.randrange(50)}", "provider_id": pid, "registered_at_ms": t,
                      "version": rng.choice(["", "0.7.5", "v0.7.4", "x.y"]), "trust_level": w(),
                      "hardware": {"chip_family": rng.choice(["M3", ""]), "chip_tier": "Max",
                                   "memory_gb": f(), "memory_bandwidth_gbs": f()},
                      "decode_tps": f(), "prefill_tps": f(),
                      "models": [{"id": rng.choice(MODELS), "size_bytes": i(), "min_ram_gb": f(),
                                  "is_vision": rng.random() < .5} for _ in range(rng.randrange(4))]}
    if kind == "Heartbeat":
        slots = [{"model": rng.choice(MODELS), "state": w(), "num_running": i(), "num_waiting": i(),
                  "max_concurrency": i(), "max_tokens_potential": i(), "observed_decode_tps": f(),
                  "observed_prefill_tps": f(), "active_token_budget_used": i(),
                  "active_token_budget_max": i(), "queued_token_budget": i(), "kv_bytes_per_token": i(),
                  "model_load_time_ms": f()} for _ in range(rng.choice([0, 1, 2, 3, 2000]))]
        return kind, {"event_id": f"h{rng.randrange(10**6)}", "provider_id": pid, "seq": i(), "sent_at_ms": t,
                      "status": w(), "system_metrics": {"memory_pressure": f(), "cpu_usage": f(),
                                                        "thermal_state": w()},
                      "backend_capacity": None if rng.random() < .2 else {
                          "total_memory_gb": f(), "gpu_memory_active_gb": f(),
                          "free_for_load_gb": rng.choice([None, f()]), "slots": slots}}
    if kind == "RouteRequest":
        return kind, {"request_id": f"q{rng.randrange(5000)}", "attempt": rng.choice([0, 1, -1]),
                      "model": rng.choice(MODELS), "prompt_tokens": i(), "max_tokens": i(), "max_ttft_ms": f(),
                      "min_decode_tps": f(), "consumer_key": rng.choice([None, "c"]),
                      "cache_affinity_key": rng.choice([None, "k"]), "self_route_only": rng.random() < .1,
                      "sent_at_ms": t}
    if kind == "Completion":
        return kind, {"event_id": f"c{rng.randrange(10**6)}", "request_id": f"q{rng.randrange(5000)}",
                      "attempt": 0, "provider_id": pid, "status": rng.choice(["ok", "error", "cancelled", "x"]),
                      "ttft_ms": f(), "completed_at_ms": t}
    if kind == "ProviderDisconnected":
        return kind, {"event_id": f"d{rng.randrange(10**6)}", "provider_id": pid, "at_ms": t}
    if kind == "ConfigChange":
        return kind, {"settings": {rng.choice(["EIGENINFERENCE_SATISFICING_BAND", "EIGENINFERENCE_NOPE",
                                               "EIGENINFERENCE_PREFILL_FALLBACK_MODE",
                                               "EIGENINFERENCE_MAX_PREFILL_TPS"]):
                                   rng.choice(["true", "enforce", "NaN", "inf", "-3", "1", "", "x"])},
                      "changed_at_ms": t}
    if kind == "Tick":
        return kind, {"at_ms": t}
    return kind, {"whatever": i()}


def test_a_hundred_thousand_hostile_events_never_crash_or_break_bounds():
    import random
    from collections import Counter
    rng, router, kinds = random.Random(2026), Router(), Counter()
    for offset in range(VOLUME):
        kind, record = random_event(rng)
        kinds[kind] += 1
        check_outputs(router.apply(offset, None, kind, record))
        if offset % 101 == 0:
            check_bounds(router)
    check_bounds(router)
    assert min(kinds.values()) > 5000  # every kind of event was thrown at it
    assert router.counters["rejected_too_many_slots"] > 0
    assert router.counters["heartbeats_applied"] > 0 and router.counters["decisions_routed_ok"] >= 0
