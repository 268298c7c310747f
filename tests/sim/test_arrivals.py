"""Arrivals: the synthetic generator's figures (domain §6.3) and replay of the public traces."""
from __future__ import annotations

from collections import Counter

import pytest

from streams import codec
from streams.sim.arrivals import (PromptSampler, Traffic, gateway_request, load_trace, replay_trace, synthetic,
                                  trace_rate, traces_dir)
from streams.sim.stats import percentile

MIX = {"gpt-oss-20b": 0.4, "gemma-4-26b-qat-4bit": 0.6}


def test_synthetic_prompts_rates_and_mix_match_production():
    arr = list(synthetic(Traffic(rate=20.0, mix=MIX), 1800, seed=1))
    assert 0.9 * 36_000 < len(arr) < 1.1 * 36_000
    prompts = [a.prompt for a in arr]
    assert 850 <= percentile(prompts, 50) <= 1300          # p50 ≈ 1k (domain §6.3: 979)
    assert 8_000 <= percentile(prompts, 90) <= 12_500       # p90 ≈ 10k (9,993)
    assert percentile(prompts, 99.9) >= 50_000 and max(prompts) <= 131_000
    share = Counter(a.model for a in arr)
    assert share["gemma-4-26b-qat-4bit"] / len(arr) == pytest.approx(0.6, abs=0.03)
    assert all(a.out_tokens <= a.max_tokens for a in arr)
    assert all(arr[i].t <= arr[i + 1].t for i in range(len(arr) - 1))


def test_follow_up_turns_share_consumer_and_affinity_key_and_carry_history():
    arr = list(synthetic(Traffic(rate=5.0, mix=MIX), 3600, seed=2))
    by_key: dict = {}
    for a in arr:
        by_key.setdefault(a.affinity_key, []).append(a)
    multi = [v for v in by_key.values() if len(v) > 1]
    assert len(multi) > 100
    for turns in multi[:50]:
        assert len({(t.consumer_key, t.model) for t in turns}) == 1
        assert all(turns[i + 1].prompt > turns[i].prompt for i in range(len(turns) - 1))


def test_synthetic_is_deterministic_from_the_seed():
    a = [(x.t, x.prompt, x.model) for x in synthetic(Traffic(rate=5.0, mix=MIX), 600, seed=9)]
    assert a == [(x.t, x.prompt, x.model) for x in synthetic(Traffic(rate=5.0, mix=MIX), 600, seed=9)]
    assert a != [(x.t, x.prompt, x.model) for x in synthetic(Traffic(rate=5.0, mix=MIX), 600, seed=10)]


def test_prompt_sampler_hits_its_anchors():
    s = PromptSampler()
    assert s(0.5) == 979 and s(0.9) == 9993 and s(0.999) == 74473 and s(1.0) == 124754


def test_gateway_stamps_like_the_api():
    a = next(synthetic(Traffic(rate=1.0, mix=MIX), 100, seed=1))
    soft = gateway_request(a, 1000)
    hard = gateway_request(a, 1000, hard_ttft=True)
    codec.validate("RouteRequest", soft)
    assert soft["max_ttft_ms"] == 0.0 and soft["min_decode_tps"] == 15.0
    assert hard["max_ttft_ms"] == 5000.0 + a.prompt
    assert soft["consumer_key"] == a.consumer_key and soft["cache_affinity_key"] == a.affinity_key


needs_traces = pytest.mark.skipif(not (traces_dir() / "mooncake-fast25").exists(), reason="public traces not present")


@needs_traces
@pytest.mark.parametrize("kind", ["azure-code", "azure-conv", "mooncake"])
def test_trace_slices_load_with_times_and_lengths(kind):
    rows = load_trace(kind, limit=500)
    assert len(rows) == 500
    assert rows[0].t == 0.0 and all(rows[i].t <= rows[i + 1].t for i in range(499))
    assert all(r.prompt > 0 and r.out >= 0 for r in rows)
    if kind == "mooncake":
        keys = Counter(r.affinity for r in rows if r.affinity)
        assert keys and all(k.startswith("mc-0-") for k in keys)   # block 0 is the shared system prompt
    else:
        assert all(r.affinity is None for r in rows)
    assert trace_rate(rows) > 0


@needs_traces
def test_trace_replay_scales_rate_loops_and_keeps_lengths():
    rows = load_trace("azure-conv", limit=300)
    span = rows[-1].t
    arr = list(replay_trace(rows, span / 2, seed=1, mix=MIX, scale=2.0))
    assert len(arr) >= 295                                       # ×2 rate: the whole slice in half the time
    assert [a.prompt for a in arr[:50]] == [r.prompt for r in rows[:50]]
    assert arr[10].t == pytest.approx(rows[10].t / 2)
    looped = list(replay_trace(rows, span * 1.5, seed=1, mix=MIX, scale=1.0))
    assert len(looped) > 330                                     # replayed again after its end
    assert all(a.out_tokens <= a.max_tokens for a in looped)
