"""The provider model: rates, batch slowdown, engine limits, what heartbeats and completions say."""
from __future__ import annotations

import pytest

from streams import codec
from streams.sim.fleet import (CHIPS, GEMMA, GPT_OSS, Group, Job, ProviderSpec, SimProvider, SlotSpec,
                               build_fleet, features)


def spec(models=((GPT_OSS.id, 60.0, 1200.0, 0.27, 16),), version="0.7.15", behaviour="normal", memory=64,
         reports_prefill=True) -> ProviderSpec:
    return ProviderSpec(machine="m3max-0001", index=1, group="test", chip=CHIPS["m3max"], memory_gb=memory,
                        version=version, trust="hardware", behaviour=behaviour,
                        slots=tuple(SlotSpec(*m) for m in models), benchmark_decode=0.0, benchmark_prefill=0.0,
                        overhead_s=0.2, reports_prefill=reports_prefill, seed="t")


def job(rid, prompt=1200, out=600, model=GPT_OSS.id, max_tokens=1024, affinity=None):
    return Job(rid, 0, model, prompt, max_tokens, out, affinity)


def test_a_solo_request_prefills_then_decodes_at_the_true_rates():
    p = SimProvider(spec())
    j = job("a")
    p.advance(10.0)
    p.reserve(j, 10.0)
    assert p.next_t == pytest.approx(11.0)             # 1,200 tokens at 1,200 tok/s
    assert p.advance(20.0) == []                       # 600 tokens at 60 tok/s: 10 s more
    assert p.advance(30.0) == [j]
    assert j.first_token == pytest.approx(11.0)
    assert j.done_at == pytest.approx(21.0)
    assert j.decode_tps == pytest.approx(60.0)
    c = p.completion(j, 123)
    codec.validate("Completion", c)
    assert c["status"] == "ok" and c["ttft_ms"] == pytest.approx(1200.0)  # 1 s prefill + 0.2 s overhead
    hb = p.heartbeat(21.0, 1, 456)
    codec.validate("Heartbeat", hb)
    slot = hb["backend_capacity"]["slots"][0]
    assert slot["observed_decode_tps"] == pytest.approx(60.0) and slot["observed_prefill_tps"] == pytest.approx(1200.0)
    assert slot["num_running"] == 0 and slot["state"] == "idle" and slot["max_concurrency"] == 16


def test_batch_slowdown_and_shared_prefill():
    p = SimProvider(spec())
    a, b = job("a", prompt=1200, out=300), job("b", prompt=1200, out=300)
    p.reserve(a, 0.0)
    p.reserve(b, 0.0)
    done = p.advance(100.0)
    assert {x.request_id for x in done} == {"a", "b"}
    assert a.first_token == pytest.approx(2.0)          # two prefills share 1,200 tok/s
    assert a.decode_tps == pytest.approx(60.0 / 1.27)   # batch 2: solo / (1 + k)


def test_engine_batch_limit_makes_requests_wait_and_heartbeats_show_it():
    p = SimProvider(spec(models=((GEMMA.id, 20.0, 600.0, 1.1, 2),), version="0.7.4", reports_prefill=False))
    jobs = [job(f"r{i}", model=GEMMA.id, prompt=600, out=100) for i in range(3)]
    for j in jobs:
        p.reserve(j, 0.0)
    hb = p.heartbeat(0.0, 1, 0)
    slot = hb["backend_capacity"]["slots"][0]
    assert (slot["num_running"], slot["num_waiting"]) == (2, 1)
    assert slot["max_concurrency"] == 0                 # 0.7.4 does not report it
    assert slot["observed_prefill_tps"] == 0.0
    assert slot["active_token_budget_used"] == 2 * (600 + 1024) and slot["queued_token_budget"] == 600 + 1024
    p.advance(1000.0)
    assert jobs[2].admitted > 0 and jobs[2].ttft_s > jobs[0].ttft_s   # waited in the engine


def test_prefix_cache_hit_prefills_only_the_new_tokens():
    p = SimProvider(spec())
    first = job("a", prompt=2400, out=100, affinity="conv-1")
    p.reserve(first, 0.0)
    p.advance(100.0)
    second = job("b", prompt=2400 + 100 + 300, out=100, affinity="conv-1")
    p.reserve(second, 100.0)
    p.advance(200.0)
    assert second.prefill_tokens == 300
    assert second.ttft_s == pytest.approx(300 / 1200.0)


def test_behaviours_on_the_wire():
    legacy = SimProvider(spec(version="0.6.8"))
    assert legacy.heartbeat(0.0, 1, 0)["backend_capacity"] is None
    liar = SimProvider(spec(version="0.7.5", behaviour="mc_liar"))
    assert liar.heartbeat(0.0, 1, 0)["backend_capacity"]["slots"][0]["max_concurrency"] == 24
    failing = SimProvider(spec(behaviour="failing"))
    j = job("x")
    failing.reserve(j, 0.0)
    done = failing.advance(10.0)
    assert done == [j] and j.status == "error" and failing.completion(j, 0)["ttft_ms"] == 0.0
    reg = liar.registration(5, event_id="e")
    codec.validate("ProviderRegistered", reg)


def test_versions_decide_the_wire_features():
    assert not features("0.6.8").capacity and features("0.7.4").capacity
    assert not features("0.7.4").private_grants and features("0.7.5").private_grants
    assert features("0.7.15").reports_prefill and not features("0.7.6").reports_prefill


def test_build_fleet_is_deterministic_and_covers_models():
    groups = [Group("a", 1, {"m4max": 1}, (((GPT_OSS.id,), 1.0),), {"0.7.4": 1}),
              Group("b", 1, {"m2": 1}, (((GPT_OSS.id,), 1.0),), {"0.7.4": 1}, trust={"self_signed": 1})]
    one = build_fleet(groups, 6, 3, cover_models=(GPT_OSS.id, GEMMA.id))
    assert one == build_fleet(groups, 6, 3, cover_models=(GPT_OSS.id, GEMMA.id))
    assert one != build_fleet(groups, 6, 4, cover_models=(GPT_OSS.id, GEMMA.id))
    assert any(GEMMA.id in s.models and s.trust == "hardware" for s in one)
    assert sum(1 for s in one if s.group == "b") == 3
