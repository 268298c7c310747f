"""The worked examples of domain §4 (A–F) and the example journals of spec/examples.

Common fixture (domain §4, built by `helpers`): M3 Max, 64 GB, 400 GB/s, decode benchmark D, no
prefill benchmark (static prefill = 12·D), memory pressure 0.1, cpu 0.1, nominal ⇒ health 550 ms,
hardware trust, one "running" slot with nothing running. Settings as rules §3 says: quality cap on,
no dedicated models unless stated, MIN_DECODE_TPS 15, MIN_TRUST hardware, k 0.27.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from streams import admission as adm
from streams import estimates as est
from streams.calibration import TtftCalibrator
from streams.config import DEFAULT, Config, parse_model_float_map, parse_version_floors
from streams.rings import RingFamily, SampleRing
from streams.serve_counter import ServeCounter

from .helpers import (EXAMPLES, FIXTURE_HEALTH_MS, GEMMA, GPT_OSS, QWEN, Journal, config_change,
                      disconnected, heartbeat, model_entry, near_tie_pick, read_jsonl, registered, request,
                      run_journal_file, slot, tick)

TOL = 0.01  # rules §2: estimated_ttft_ms and cost_ms within 0.01 ms


def cap(j: Journal, pid: str, model: str) -> int:
    p = j.p(pid)
    return adm.effective_cap(p, model, j.slot(pid, model), j.config, j.router.rings)


def routed_to(d: dict, pid: str) -> bool:
    return d["outcome"] == "routed" and d["provider_id"] == pid


def assert_not_admitted(d: dict) -> None:
    """A capacity rejection of a non-dedicated model: queued (queue-before-shed), never routed."""
    assert d["outcome"] == "queued" and d["http_status"] == 202, d
    assert d["capacity_rejections"] >= 1 and d["candidates"] == 0, d


def test_default_settings_are_the_worked_example_assumptions():
    c = DEFAULT
    assert c.quality_cap is True and c.dedicated == () and c.min_decode_tps == 15.0
    assert c.min_trust == "hardware" and c.k == 0.27 and c.decode_floor == 15.0
    assert c.overcommit == 1.2 and c.fallback_concurrency == 4


def test_fixture_health_penalty_is_550_ms():
    j = Journal()
    j.provider("box-a", 30)
    assert est.health_ms(j.p("box-a")) == pytest.approx(FIXTURE_HEALTH_MS, abs=1e-9)


# =================================================================================================
# A. Per-model quality caps and solo rates (#524)
# =================================================================================================
def mixed_box(j: Journal, pid: str = "mixed", decode_tps: float = 93, gpt_max=500_000, gemma_max=400_000,
              **reg) -> None:
    j.provider(pid, decode_tps, models=[GPT_OSS, GEMMA],
               slots=[slot(GPT_OSS, budget_max=gpt_max), slot(GEMMA, budget_max=gemma_max)], **reg)


def record_solo_through_heartbeats(j: Journal, pid: str, model: str, tps: float, n: int, other: str) -> None:
    """n heartbeats where `model` runs one request alone at `tps` (solo samples), then a quiet one."""
    for _ in range(n):
        j.beat(pid, [slot(model, running=1, decode=tps, budget_max=400_000),
                     slot(other, state="idle", budget_max=500_000)])
    j.beat(pid, [slot(GPT_OSS, budget_max=500_000), slot(GEMMA, budget_max=400_000)])


@pytest.mark.parametrize("source", ["trusted_median", "seed"])
def test_A1_mixed_box_caps_gemma_at_2_and_gpt_oss_at_23(source):
    j = Journal(MODEL_SOLO_TPS_SEED=f"{GEMMA}=14") if source == "seed" else Journal()
    mixed_box(j)
    if source == "trusted_median":
        record_solo_through_heartbeats(j, "mixed", GEMMA, 14, 5, other=GPT_OSS)
        assert j.router.rings.solo.stats(GEMMA, "M3|Max") == (14, 5)
    assert j.p("mixed").box_max_concurrency(j.config) == 24  # budget slots ⇒ base 24
    assert cap(j, "mixed", GEMMA) == 2      # 14 ≤ 15 ⇒ qc 1 ⇒ ceil(1.2)
    assert cap(j, "mixed", GPT_OSS) == 23   # qc floor(5.2/0.27) = 19 ⇒ ceil(22.8)
    # through the router: the third concurrent gemma request is not admitted
    assert routed_to(j.route("g1", GEMMA), "mixed")
    assert routed_to(j.route("g2", GEMMA), "mixed")
    assert_not_admitted(j.route("g3", GEMMA))


def test_A1_gpt_oss_admits_23_concurrent_requests_then_sheds():
    j = Journal()
    mixed_box(j)
    for i in range(23):
        assert routed_to(j.route(f"r{i}"), "mixed")
    assert_not_admitted(j.route("r23"))


def test_A1_kill_switch_caps_gemma_from_the_provider_rate():
    j = Journal(MODEL_SOLO_TPS_SEED=f"{GEMMA}=14", QUALITY_CAP_PER_MODEL_TPS="false")
    mixed_box(j)
    assert cap(j, "mixed", GEMMA) == 23


def test_A2_cold_start_seeds_cap_gemma_2_and_gpt_oss_4():
    j = Journal(MODEL_SOLO_TPS_SEED=f"{GEMMA}=14,{GPT_OSS}=30")
    mixed_box(j)
    assert (cap(j, "mixed", GEMMA), cap(j, "mixed", GPT_OSS)) == (2, 4)
    for i in range(4):
        assert routed_to(j.route(f"r{i}"), "mixed")
    assert_not_admitted(j.route("r4"))


def test_A2_newer_load_factor_gives_gpt_oss_3():
    j = Journal(MODEL_SOLO_TPS_SEED=f"{GEMMA}=14,{GPT_OSS}=30", EFFECTIVE_TPS_LOAD_FACTOR="0.39")
    mixed_box(j)
    assert cap(j, "mixed", GPT_OSS) == 3


def test_A3_quality_cap_uses_static_rate_not_observed_ewma():
    j = Journal()
    j.provider("gemma-box", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000, decode=2.6)])
    assert j.slot("gemma-box", GEMMA).observed_decode_tps == 2.6
    assert cap(j, "gemma-box", GEMMA) == 2
    assert routed_to(j.route("r1", GEMMA), "gemma-box")
    assert routed_to(j.route("r2", GEMMA), "gemma-box")
    assert_not_admitted(j.route("r3", GEMMA))


def test_A4_cap_scales_with_model_speed():
    j = Journal()
    j.provider("gemma-box", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)])
    j.provider("qwen-box", 57, models=[QWEN], slots=[slot(QWEN, budget_max=1_000_000)])
    assert cap(j, "gemma-box", GEMMA) == 2
    assert cap(j, "qwen-box", QWEN) == 12  # qc 10 ⇒ ceil(12)
    for i in range(12):
        assert routed_to(j.route(f"q{i}", QWEN), "qwen-box")
    assert_not_admitted(j.route("q12", QWEN))


def test_A4_newer_load_factor_gives_qwen_9():
    j = Journal(EFFECTIVE_TPS_LOAD_FACTOR="0.39")
    j.provider("qwen-box", 57, models=[QWEN], slots=[slot(QWEN, budget_max=1_000_000)])
    assert cap(j, "qwen-box", QWEN) == 9


def test_A5_cap_is_min_of_reported_and_quality():
    j = Journal()
    j.provider("gemma-box", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000, max_concurrency=8)])
    j.provider("qwen-box", 57, models=[QWEN], slots=[slot(QWEN, budget_max=1_000_000, max_concurrency=1)])
    assert cap(j, "gemma-box", GEMMA) == 2
    assert cap(j, "qwen-box", QWEN) == 1
    assert routed_to(j.route("q1", QWEN), "qwen-box")
    assert_not_admitted(j.route("q2", QWEN))


def test_A6_bandwidth_proxy_caps_only_dedicated_models():
    j = Journal(DEDICATED_MODELS="gemma-4")
    j.provider("gemma-box", 0, models=[GEMMA], bandwidth=800, slots=[slot(GEMMA, budget_max=100_000)])
    j.provider("qwen-box", 0, models=[QWEN], bandwidth=800, slots=[slot(QWEN, budget_max=1_000_000)])
    assert j.p("qwen-box").static_decode_tps() == pytest.approx(28.28, abs=0.01)
    assert cap(j, "qwen-box", QWEN) == 24
    assert cap(j, "gemma-box", GEMMA) == 4
    for i in range(4):
        assert routed_to(j.route(f"g{i}", GEMMA), "gemma-box")
    d = j.route("g4", GEMMA)  # dedicated: no queue
    assert (d["outcome"], d["reason"], d["http_status"]) == ("rejected", "machine_busy", 429)


def test_A7_per_model_rate_caps_without_registration_benchmark():
    j = Journal()
    mixed_box(j, decode_tps=0, bandwidth=800)
    record_solo_through_heartbeats(j, "mixed", GEMMA, 14, 5, other=GPT_OSS)
    assert cap(j, "mixed", GEMMA) == 2
    assert cap(j, "mixed", GPT_OSS) == 24


def test_A8_disabled_cap_keeps_flat_cap():
    j = Journal(QUALITY_CONCURRENCY_CAP="false")
    j.provider("gemma-box", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)])
    assert cap(j, "gemma-box", GEMMA) == 24
    for i in range(3):
        assert routed_to(j.route(f"g{i}", GEMMA), "gemma-box")


def test_A9_quality_cap_sheds_then_spreads_to_a_new_box():
    j = Journal(DEDICATED_MODELS="gemma-4")
    j.provider("box-a", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)])
    assert routed_to(j.route("p1", GEMMA), "box-a")
    assert routed_to(j.route("p2", GEMMA), "box-a")
    d1 = j.route("req-1", GEMMA)
    assert (d1["outcome"], d1["reason"], d1["capacity_rejections"]) == ("rejected", "machine_busy", 1)
    j.provider("box-b", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)])
    assert routed_to(j.route("req-2", GEMMA), "box-b")


def test_A10_admit_recheck_uses_the_quality_cap():
    j = Journal(DEDICATED_MODELS="gemma-4")
    j.provider("box-a", 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)])
    p, s = j.p("box-a"), j.slot("box-a", GEMMA)
    assert routed_to(j.route("p1", GEMMA), "box-a")
    assert adm.has_headroom(p, GEMMA, s, j.config, j.router.rings)      # 1 pending < cap 2
    assert routed_to(j.route("p2", GEMMA), "box-a")
    assert not adm.has_headroom(p, GEMMA, s, j.config, j.router.rings)  # 2 pending = cap 2
    assert j.route("p3", GEMMA)["outcome"] == "rejected"


def test_A11_solo_ring_median_and_fifo_eviction():
    rings = Journal().router.rings
    for v in (18, 10, 14, 12, 16):
        rings.solo.record("m", "M3|Max", v)
    assert rings.solo.stats("m", "M3|Max") == (14, 5)
    for _ in range(50):
        rings.solo.record("m2", "c", 100)
    for _ in range(10):
        rings.solo.record("m2", "c", 200)
    assert rings.solo.stats("m2", "c") == (100, 50)
    assert rings.solo.rings[("m2", "c")].samples().count(200) == 10
    for v in (0, -3):
        rings.solo.record("m3", "c", v)
    rings.solo.record("", "c", 20)
    assert rings.solo.stats("m3", "c") == (0, 0) and rings.solo.stats("", "c") == (0, 0)
    assert rings.decode.stats("m", "M3|Max") == (0, 0) and rings.decode.stats("m", "M3") == (0, 0)


def test_ring_examples_of_domain_2_4():
    assert SampleRing(samples=[9000, 5000, 6500, 6000, 7000]).stats() == (6500, 5)
    assert SampleRing(samples=[1, 2, 3, 4]).stats() == (2.5, 4)  # even count: mean of the middle two
    ring = SampleRing(samples=[1000] * 50 + [2000] * 10)
    assert ring.stats() == (1000, 50) and ring.samples() == [1000] * 40 + [2000] * 10


def test_A12_cross_class_is_min_of_class_medians_with_total_count():
    fam = RingFamily()
    for v in (20, 20):
        fam.record("m", "M1", v)
    for v in (30, 30, 30):
        fam.record("m", "M4", v)
    fam.record("other", "M1", 999)
    assert fam.min_across_chips("m")[:2] == (20, 5)
    fam2 = RingFamily()
    for _ in range(20):
        fam2.record("m", "M4|Max", 30)
    fam2.record("m", "M1", 12)
    assert fam2.min_across_chips("m")[:2] == (12, 21)


def test_A14_only_the_active_slot_yields_solo_samples():
    j = Journal()
    j.provider("mixed", 93, models=[GPT_OSS, GEMMA])
    for _ in range(5):
        j.beat("mixed", [slot(GEMMA, running=1, decode=14), slot(GPT_OSS, state="idle", decode=60)])
    rings = j.router.rings
    assert rings.solo.stats(GEMMA, "M3|Max")[1] == 5
    assert rings.solo.stats(GPT_OSS, "M3|Max") == (0, 0)
    assert rings.decode.stats(GPT_OSS, "M3") == (60, 5)


def test_A15_solo_recording_requires_a_running_decode():
    j = Journal()
    j.provider("box", 93, models=[GEMMA], slots=[])
    j.beat("box", [slot(GEMMA, running=0, waiting=1, decode=14)])
    assert j.router.rings.solo.stats(GEMMA, "M3|Max")[1] == 0
    j.beat("box", [slot(GEMMA, running=1, decode=12)])
    assert j.router.rings.solo.stats(GEMMA, "M3|Max") == (12, 1)
    assert j.router.rings.decode.stats(GEMMA, "M3") == (13, 2)


def test_A17_resolver_chain_seed_then_min_of_class_medians():
    j = Journal(MODEL_SOLO_TPS_SEED=f"{GEMMA}=14")
    mixed_box(j)
    p, c, rings = j.p("mixed"), j.config, j.router.rings
    assert p.chip_class == "M3|Max"
    assert adm.resolved_solo_tps(p, GEMMA, c, rings) == (14, True)
    for cls, values in (("M1", (16, 16, 16)), ("M2", (20, 20))):
        for v in values:
            rings.solo.record(GEMMA, cls, v)
    assert adm.resolved_solo_tps(p, GEMMA, c, rings) == (16, True)
    for v in (10, 12, 12, 12, 30):
        rings.solo.record(GEMMA, "M3", v)
    assert adm.resolved_solo_tps(p, GEMMA, c, rings) == (12, True)
    assert adm.resolved_solo_tps(p, GPT_OSS, c, rings) == (93, False)


def test_A18_min_sample_floor_keeps_provider_rate_until_trusted():
    j = Journal(QUALITY_CAP_SOLO_MIN_SAMPLES="6")
    mixed_box(j)
    p, c, rings = j.p("mixed"), j.config, j.router.rings
    for _ in range(5):
        rings.solo.record(GEMMA, "M4|Pro", 14)
    assert adm.resolved_solo_tps(p, GEMMA, c, rings) == (93, False)
    rings.solo.record(GEMMA, "M4|Pro", 14)
    assert adm.resolved_solo_tps(p, GEMMA, c, rings) == (14, True)


@pytest.mark.parametrize("raw, expected", [
    ("", {}),
    (" gemma-4-26b-qat-4bit=14 , gpt-oss-20b=30 ", {"gemma-4-26b-qat-4bit": 14.0, "gpt-oss-20b": 30.0}),
    ("GPT-OSS-20B=30", {"gpt-oss-20b": 30.0}),
    ("bogus,=3,x=,gemma=abc,gemma=0,gemma=-2,good=14.5", {"good": 14.5}),
    ("a=NaN,b=+Inf,c=Inf,d=-Inf,e=Infinity,good=2", {"good": 2.0}),
    ("bogus,=3,x=abc", {}),
])
def test_A19_model_float_map_parsing(raw, expected):
    assert parse_model_float_map(raw) == expected


def test_A19_seed_lookup_lowercases_the_model():
    j = Journal(MODEL_SOLO_TPS_SEED="GEMMA-4-26B-QAT-4BIT=14")
    mixed_box(j)
    assert adm.resolved_solo_tps(j.p("mixed"), GEMMA, j.config, j.router.rings) == (14, True)


# =================================================================================================
# B. Pooled KV admission (#524)
# =================================================================================================
@pytest.mark.parametrize("slots, used, committed, total", [
    ([slot("a", budget_max=10_000, budget_used=1_000, queued_budget=500, potential=3_000)], 1_500, 3_000, 10_000),
    ([slot("a", budget_max=10_000, budget_used=2_000), slot("b", budget_max=9_000, budget_used=1_000)],
     3_000, 3_000, 11_000),
    ([slot("a", budget_max=10_000, budget_used=-50, potential=-10), slot("legacy", budget_max=0, budget_used=5_000)],
     0, 0, 10_000),
    # the examples of domain §2.10.2
    ([slot("a", budget_max=10_000, budget_used=7_000), slot("b", budget_max=10_000, budget_used=7_000)],
     14_000, 14_000, 17_000),
    ([slot("a", budget_max=10_000, budget_used=8_000), slot("b", budget_max=5_000, budget_used=3_000)],
     11_000, 11_000, 13_000),
    ([slot("a", budget_max=10_000, budget_used=11_000)], 11_000, 11_000, 11_000),
    ([slot("a", budget_max=10_000, budget_used=-500)], 0, 0, 10_000),
], ids=["B1a-single", "B1b-shared-once", "B1c-clamped-and-legacy", "two-7k", "8k-3k", "overcommitted",
        "negative-used"])
def test_B1_pool_reconstruction_from_a_heartbeat(slots, used, committed, total):
    j = Journal()
    j.provider("box", 93, models=["a", "b"], slots=slots)
    pool = j.p("box").backend.pool
    assert (pool.used, pool.committed, pool.total) == (used, committed, total)


def co_resident_box(j: Journal, pid="box", gpt=None, gemma=None, models=(GPT_OSS, GEMMA), decode_tps=93, **reg):
    j.provider(pid, decode_tps, models=list(models),
               slots=[gpt or slot(GPT_OSS, budget_max=10_000), gemma or slot(GEMMA, budget_max=10_000)], **reg)


def test_B2_pooled_admission_blocks_co_residency_double_spend():
    j = Journal()
    co_resident_box(j)
    for i in range(5):
        assert routed_to(j.route(f"r{i}", GPT_OSS, 100, 1_900), "box")
    assert_not_admitted(j.route("r5", GPT_OSS, 100, 1_900))   # slot budget
    assert_not_admitted(j.route("g1", GEMMA, 100, 1_900))     # pool fully pending


def test_B3_pooled_admission_allows_co_resident_within_pool():
    j = Journal()
    co_resident_box(j)
    for i in range(2):
        assert routed_to(j.route(f"r{i}", GPT_OSS, 100, 1_900), "box")
    assert routed_to(j.route("g1", GEMMA, 100, 1_900), "box")


@pytest.mark.parametrize("tokens, admitted", [(5_500, True), (5_501, False)])
def test_B4_single_model_slot_check_counts_pending_beyond_committed(tokens, admitted):
    j = Journal()
    j.provider("box", 93, slots=[slot(GPT_OSS, budget_max=10_000, budget_used=3_000, queued_budget=500,
                                       potential=6_000)])
    for i in range(2):  # 7,000 coordinator-pending tokens
        assert routed_to(j.route(f"p{i}", GPT_OSS, 500, 3_000), "box")
    assert j.p("box").pending_tokens_by_model[GPT_OSS] == 7_000
    d = j.route("x", GPT_OSS, 500, tokens - 500)
    assert (d["outcome"] == "routed") is admitted


def pend(p, model: str, tokens: int, n: int = 1) -> None:
    for i in range(n):
        p.add_pending((f"{model}-{tokens}-{len(p.pending)}", i), model, tokens, 0)


@pytest.mark.parametrize("pending_all, admitted", [(10_000, False), (4_000, True)])
def test_B5_pooled_check_rejects_gap_double_spend(pending_all, admitted):
    j = Journal()
    co_resident_box(j, models=("a", "b"), gpt=slot("a", budget_max=10_000), gemma=slot("b", budget_max=10_000))
    p = j.p("box")
    pend(p, "a", pending_all)
    assert p.pending_tokens_by_model.get("b", 0) == 0
    assert adm.free_memory_admits(p, "b", j.slot("box", "b"), 100, 1_900) is admitted


def byte_box(j: Journal, pid="box", models=("big-kv", "small-kv")):
    j.provider(pid, 93, models=list(models),
               slots=[slot("big-kv", budget_max=10_000, kv=100_000), slot("small-kv", budget_max=100_000, kv=10_000)])


@pytest.mark.parametrize("pending_small, admitted", [(90_000, False), (40_000, True)])
def test_B6_byte_normalised_pool_for_heterogeneous_kv(pending_small, admitted):
    j = Journal()
    byte_box(j)
    p = j.p("box")
    pool = p.backend.pool
    assert pool.byte_mode and pool.total_bytes == 1_000_000_000 and pool.total == 100_000
    pend(p, "small-kv", pending_small)
    assert pool.used + pending_small + 3_000 <= pool.total  # token math alone would admit
    assert adm.free_memory_admits(p, "big-kv", j.slot("box", "big-kv"), 100, 2_900) is admitted


def test_B6_a_budget_slot_without_kv_rate_disables_byte_mode():
    j = Journal()
    j.provider("box", 93, models=["big-kv", "small-kv"],
               slots=[slot("big-kv", budget_max=10_000, kv=100_000), slot("small-kv", budget_max=100_000)])
    assert j.p("box").backend.pool.byte_mode is False


def test_B8_byte_double_spend_rejected_on_the_real_path():
    j = Journal()
    co_resident_box(j, gpt=slot(GPT_OSS, budget_max=100_000, kv=10_000),
                    gemma=slot(GEMMA, budget_max=10_000, kv=100_000))
    for i in range(9):
        assert routed_to(j.route(f"r{i}", GPT_OSS, 500, 9_500), "box")
    assert_not_admitted(j.route("g1", GEMMA, 100, 2_900))


def test_B10_legacy_provider_ignores_pooled_fields():
    j = Journal()
    j.provider("box", 93, models=[model_with_size(GPT_OSS, 14)], slots=[slot(GPT_OSS)],
               hb={"gpu_active_gb": 10})
    p = j.p("box")
    pend(p, "some-cold-model", 2**30)
    assert p.backend.pool.total == 0
    assert adm.free_memory_admits(p, GPT_OSS, j.slot("box"), 100, 256)


def model_with_size(model, size_gb, min_ram_gb=0.0):
    return model_entry(model, size_gb=size_gb, min_ram_gb=min_ram_gb)


def test_B11_huge_kv_rate_is_clamped_and_fails_closed():
    j = Journal()
    j.provider("box", 93, slots=[slot(GPT_OSS, budget_max=10_000, budget_used=5_000, kv=(2**63 - 1) // 2)])
    p, s = j.p("box"), j.slot("box")
    pool = p.backend.pool
    assert s.kv_bytes_per_token == 16_777_216
    assert pool.used_bytes == 5_000 * 2**24 and pool.total_bytes == 10_000 * 2**24
    assert adm.pooled_budget_admits(p, GPT_OSS, s, 5_000)
    assert not adm.pooled_budget_admits(p, GPT_OSS, s, 5_001)
    assert_not_admitted(j.route("big", GPT_OSS, 100, 4_901))
    assert routed_to(j.route("fits", GPT_OSS, 100, 4_900), "box")


def test_B12_cold_request_priced_at_max_resident_rate():
    j = Journal()
    co_resident_box(j, models=(GPT_OSS, GEMMA, QWEN), gpt=slot(GPT_OSS, budget_max=100_000, kv=10_000),
                    gemma=slot(GEMMA, budget_max=10_000, kv=100_000))
    p = j.p("box")
    assert p.backend.pool.max_rate == 100_000 and j.slot("box", QWEN) is None
    # 20,000 cold tokens × 100 kB = 2 GB > 1 GB; token accounting (20k ≤ 100k) would admit
    assert_not_admitted(j.route("cold-burst", QWEN, 100, 19_900))
    assert adm.pooled_remaining_tokens(p, QWEN, None) == 10_000
    assert routed_to(j.route("cold-fits", QWEN, 100, 9_900), "box")


def assert_remaining_agrees(p, model, s) -> None:
    """Domain §2.10.7 invariant: pooledBudgetAdmits(n) ⇔ n ≤ pooledRemaining (for requests n ≥ 1)."""
    n = adm.pooled_remaining_tokens(p, model, s)
    if n < 0:
        assert adm.pooled_budget_admits(p, model, s, 10**9)
        return
    if n > 0:
        assert adm.pooled_budget_admits(p, model, s, n)
    assert not adm.pooled_budget_admits(p, model, s, n + 1)


def test_B12_remaining_tokens_agree_with_admission_on_every_path():
    j = Journal()
    co_resident_box(j, models=(GPT_OSS, GEMMA, QWEN), gpt=slot(GPT_OSS, budget_max=100_000, kv=10_000),
                    gemma=slot(GEMMA, budget_max=10_000, kv=100_000))
    p = j.p("box")
    paths = []
    for label in ("byte", "byte+pending", "pending-unknown"):
        if label == "byte+pending":
            pend(p, GPT_OSS, 30_000)
        if label == "pending-unknown":
            pend(p, QWEN, 1_000)  # a cold pending model forces token accounting (seed-era)
            assert p.pending_bytes() is None
        for model in (GPT_OSS, GEMMA, QWEN):
            assert_remaining_agrees(p, model, j.slot("box", model))
        paths.append(label)
    j2 = Journal()
    co_resident_box(j2)  # token mode (no KV rates)
    pend(j2.p("box"), GPT_OSS, 3_000)
    for model in (GPT_OSS, GEMMA, "cold"):
        assert_remaining_agrees(j2.p("box"), model, j2.slot("box", model))


_slot_strategy = st.fixed_dictionaries({
    "budget_max": st.integers(0, 50_000), "budget_used": st.integers(-100, 60_000),
    "queued_budget": st.integers(0, 5_000), "potential": st.integers(0, 60_000),
    "kv": st.sampled_from([0, 10_000, 100_000, 2**24, 2**40])})


@hyp_settings(max_examples=150, deadline=None)
@given(slots=st.lists(_slot_strategy, min_size=0, max_size=3),
       pending=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40_000)), max_size=4))
def test_B12_remaining_tokens_invariant_property(slots, pending):
    models = ["m0", "m1", "m2"]
    j = Journal()
    j.provider("box", 93, models=models + ["cold"],
               slots=[slot(models[i], **s) for i, s in enumerate(slots)])
    p = j.p("box")
    for idx, tokens in pending:
        pend(p, (models + ["cold"])[idx], tokens)
    for model in models + ["cold"]:
        assert_remaining_agrees(p, model, j.slot("box", model))


def test_B13_capacity_feed_blocks_every_model_when_the_pool_is_pending():
    j = Journal()
    co_resident_box(j, models=(GPT_OSS, GEMMA, QWEN))
    before = j.router.capacity(GEMMA)
    assert before["routable_providers"] == 1 and before["remaining_tokens"] == 10_000
    for i in range(5):
        assert routed_to(j.route(f"r{i}", GPT_OSS, 100, 1_900), "box")
    gemma = j.router.capacity(GEMMA)
    assert j.slot("box", GEMMA).budget_used == 0
    assert gemma["routable_providers"] == 0 and gemma["remaining_tokens"] == 0
    assert j.router.capacity(QWEN)["routable_providers"] == 0


# =================================================================================================
# C. v2 clamp, box ceiling, version floors (#526)
# =================================================================================================
def test_dedicated_model_gate_bars_mixed_boxes():
    """Domain §2.2: a dedicated model may only route to boxes advertising nothing but its builds."""
    j = Journal(DEDICATED_MODELS="gemma-4")
    co_resident_box(j, pid="mixed", gpt=slot(GPT_OSS), gemma=slot(GEMMA))
    assert j.route("g1", GEMMA)["candidates"] == 0
    assert routed_to(j.route("o1", GPT_OSS), "mixed")
    j.provider("gemma-only", 30, models=[GEMMA], slots=[slot(GEMMA)])
    assert routed_to(j.route("g2", GEMMA), "gemma-only")


def test_C1_v2_clamp_at_or_above_floor_clamps_and_trips():
    j = Journal(V2_VERSION_FLOOR="0.7.5", V2_MAX_CONCURRENCY_CEILING="4")
    out = j.apply(registered("v075", 60, version="0.7.5"),
                  heartbeat("v075", 1, [slot(GPT_OSS, max_concurrency=24)]))
    assert j.slot("v075").max_concurrency == 4
    assert [r for t, r in out if t == "Tripwire"] == [{"provider_id": "v075", "version": "0.7.5", "model": GPT_OSS, "reported": 24}]
    assert j.router.tripwires[GPT_OSS] == 1
    j.apply(registered("v076", 60, version="0.7.6"), heartbeat("v076", 1, [slot(GPT_OSS, max_concurrency=24)]))
    assert j.slot("v076").max_concurrency == 4
    assert j.router.tripwires[GPT_OSS] == 2


@pytest.mark.parametrize("floor, version, reported, stored, trip", [
    ("0.7.5", "0.7.4", 24, 24, False),
    ("0.7.5", "0.7.4", 30, 24, False),   # legacy clamp only
    ("0.7.5", "", 24, 24, False),        # unreported version is below every floor
    ("", "0.7.5", 24, 24, False),        # feature off
    ("0.7.5", "0.7.5", 4, 4, False),     # honest report
    ("0.7.5", "0.7.5", 0, 0, False),     # unreported concurrency never touched
    ("0.7.5", "0.7.5", 30, 4, True),     # trip records the original report (30, not 24)
])
def test_C3_v2_clamp_table(floor, version, reported, stored, trip):
    j = Journal(V2_VERSION_FLOOR=floor)
    out = j.apply(registered("box", 60, version=version),
                  heartbeat("box", 1, [slot(GPT_OSS, max_concurrency=reported)]))
    assert j.slot("box").max_concurrency == stored
    trips = [r for t, r in out if t == "Tripwire"]
    assert trips == ([{"provider_id": "box", "version": version, "model": GPT_OSS, "reported": reported}] if trip else [])


def test_C3_v2_settings_normalise():
    c = Config({"EIGENINFERENCE_V2_VERSION_FLOOR": "  0.7.5  ", "EIGENINFERENCE_V2_MAX_CONCURRENCY_CEILING": "0"})
    assert (c.v2_floor, c.v2_ceiling) == ("0.7.5", 4)


@pytest.mark.parametrize("floor, version, box_max", [("0.7.5", "0.7.5", 4), ("0.7.5", "0.7.4", 24), ("", "0.7.5", 24)])
def test_C4_v2_box_ceiling_bounds_aggregate_headroom(floor, version, box_max):
    j = Journal(V2_VERSION_FLOOR=floor)
    co_resident_box(j, gpt=slot(GPT_OSS, budget_max=100_000), gemma=slot(GEMMA, budget_max=100_000), version=version)
    assert j.p("box").box_max_concurrency(j.config) == box_max
    for i in range(2):
        assert routed_to(j.route(f"o{i}", GPT_OSS), "box")
        assert routed_to(j.route(f"g{i}", GEMMA), "box")
    fifth = j.route("o9", GPT_OSS)
    if box_max == 4:
        assert_not_admitted(fifth)
    else:
        assert routed_to(fifth, "box")


def test_C5_version_floor_is_a_routing_gate():
    j = Journal(MODEL_VERSION_FLOORS="gemma-4=0.7.5")
    for pid, version in (("old", "0.7.4"), ("unversioned", "")):
        co_resident_box(j, pid=pid, gpt=slot(GPT_OSS), gemma=slot(GEMMA), version=version)
    d = j.route("g0", GEMMA)
    assert (d["outcome"], d["reason"], d["http_status"]) == ("rejected", "no_provider", 503)
    o = j.route("o0", GPT_OSS)
    assert o["outcome"] == "routed" and o["provider_id"] in ("old", "unversioned")
    co_resident_box(j, pid="new", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.5")
    for i in range(3):
        assert routed_to(j.route(f"g{i + 1}", GEMMA), "new")


def test_C5_below_floor_is_structural_absence_in_the_verdict_counts():
    j = Journal(MODEL_VERSION_FLOORS="gemma-4=0.7.5")
    co_resident_box(j, pid="old", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.4")
    d = j.route("g", GEMMA)
    assert (d["candidates"], d["capacity_rejections"], d["too_large"]) == (0, 0, 0)
    assert d["reason"] == "no_provider" and d["retry_after_s"] == 2
    assert j.route("o", GPT_OSS)["candidates"] == 1


def test_C6_version_floors_set_and_cleared_live():
    j = Journal()
    co_resident_box(j, pid="old", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.4")
    assert routed_to(j.route("g1", GEMMA), "old")
    j.apply(config_change({"MODEL_VERSION_FLOORS": "gemma-4=0.7.5"}))
    assert j.route("g2", GEMMA)["reason"] == "no_provider"
    j.apply(config_change({"MODEL_VERSION_FLOORS": ""}))
    assert routed_to(j.route("g3", GEMMA), "old")


@pytest.mark.skip(reason="warm-pool controller is out of scope for the routing core (domain §8.5)")
def test_C7_version_floor_warm_pool_candidacy():
    pass


def test_C8_version_floor_applies_to_self_route():
    j = Journal(MODEL_VERSION_FLOORS="gemma-4=0.7.5")
    co_resident_box(j, pid="owned-old", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.4", account_id="acct-1")
    co_resident_box(j, pid="public-new", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.5")
    own = {"account_id": "acct-1", "self_route_only": True}
    assert j.route("g1", GEMMA, **own)["reason"] == "no_provider"
    assert routed_to(j.route("o1", GPT_OSS, **own), "owned-old")
    co_resident_box(j, pid="owned-new", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.5", account_id="acct-1")
    assert routed_to(j.route("g2", GEMMA, **own), "owned-new")


@pytest.mark.skip(reason="alias resolution is out of scope for the routing core (domain §8.5)")
def test_C9_version_floor_alias_resolution():
    pass


@pytest.mark.parametrize("raw, expected", [
    ("", ()),
    ("gemma-4=0.7.5", (("gemma-4", "0.7.5"),)),
    (" gemma-4 = 0.7.5 , gpt-oss = 0.8.0 ", (("gemma-4", "0.7.5"), ("gpt-oss", "0.8.0"))),
    ("GEMMA-4=0.7.5", (("gemma-4", "0.7.5"),)),
    ("bogus,=0.7.5,gemma-4=,x", ()),
    ("gemma-4=v0.7.5", (("gemma-4", "v0.7.5"),)),
])
def test_C10_version_floor_parsing(raw, expected):
    assert parse_version_floors(raw) == expected


def test_C10_first_matching_floor_wins():
    c = Config({"EIGENINFERENCE_MODEL_VERSION_FLOORS": "gemma=0.9.0,gemma-4=0.7.5"})
    assert c.version_floor(GEMMA) == "0.9.0" and c.version_floor(GPT_OSS) is None


def test_C11_capacity_feed_respects_version_floors():
    j = Journal(MODEL_VERSION_FLOORS="gemma-4=0.7.5")
    co_resident_box(j, pid="old", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.4")
    co_resident_box(j, pid="new", gpt=slot(GPT_OSS), gemma=slot(GEMMA), version="0.7.5")
    assert j.router.capacity(GEMMA)["routable_providers"] == 1
    assert j.router.capacity(GPT_OSS)["routable_providers"] == 2


# =================================================================================================
# D. Prefill-honest TTFT (#453 + #526) and calibration
# =================================================================================================
LONG_PROMPT = 13_711
_peer = iter(range(10**6))


def peers_measured_prefill(j: Journal, value: float, n: int, model: str = GPT_OSS, family="M3", tier="Max"):
    """n same-class peers each report one observed prefill EWMA, then leave (the ring keeps them)."""
    for _ in range(n):
        pid = f"peer-{next(_peer)}"
        at = j.router.now
        j.apply(registered(pid, 30, models=[model], family=family, tier=tier, at_ms=at),
                heartbeat(pid, 1, [slot(model, prefill=value)], at_ms=at),
                disconnected(pid, at_ms=at))


def long_request(rid, **kw):
    kw.setdefault("max_ttft_ms", 5_000)
    return request(rid, GPT_OSS, LONG_PROMPT, 256, **kw)


def test_D1_trusted_prefill_median_admits_the_long_prompt():
    j = Journal()
    j.provider("box", 30)
    peers_measured_prefill(j, 6_500, 5)
    assert j.router.rings.prefill.stats(GPT_OSS, "M3|Max") == (6_500, 5)
    d = j.decide(long_request("long"))
    assert routed_to(d, "box") and d["prefill_source"] == "median"
    assert d["estimated_ttft_ms"] == pytest.approx(LONG_PROMPT / 6_500 * 1000 + 1000 / 30, abs=TOL)
    assert d["estimated_ttft_ms"] == pytest.approx(2_143, abs=1)


def test_D1_medians_off_falls_back_to_static_and_rejects():
    j = Journal(TTFT_PREFILL_MEDIANS="false")
    j.provider("box", 30)
    peers_measured_prefill(j, 6_500, 5)
    d = j.decide(long_request("long"))
    assert (d["outcome"], d["reason"], d["http_status"]) == ("rejected", "ttft_too_slow", 429)
    assert d["ttft_rejections"] == 1
    assert d["estimated_ttft_ms"] == pytest.approx(LONG_PROMPT / 360 * 1000 + 1000 / 30, abs=TOL)
    assert d["estimated_ttft_ms"] == pytest.approx(38_119, abs=1)


def test_D2_prefill_median_needs_min_samples_and_the_floor_is_live():
    j = Journal()
    j.provider("box", 30)
    peers_measured_prefill(j, 6_500, 4)
    assert j.decide(long_request("a"))["reason"] == "ttft_too_slow"
    peers_measured_prefill(j, 6_500, 1)
    assert routed_to(j.decide(long_request("b")), "box")
    j.release(j.decisions[-1])
    j.apply(config_change({"TTFT_PREFILL_MIN_SAMPLES": "6"}))
    assert j.decide(long_request("c"))["reason"] == "ttft_too_slow"


@pytest.mark.parametrize("hard_gate", [False, True])
def test_D3_preflight_estimate_follows_the_median(hard_gate):
    j = Journal(TTFT_HARD_REJECT="true" if hard_gate else "false")
    j.provider("box", 30)
    before = j.decide(request("before", GPT_OSS, LONG_PROMPT, 256))
    assert before["estimated_ttft_ms"] >= 30_000
    assert before["outcome"] == ("rejected" if hard_gate else "routed")
    if not hard_gate:
        j.release(before)
    peers_measured_prefill(j, 6_500, 5)
    after = j.decide(request("after", GPT_OSS, LONG_PROMPT, 256))
    assert routed_to(after, "box") and after["estimated_ttft_ms"] <= 4_000


def test_D3_capacity_feed_ttft_uses_the_routing_prefill_chain():
    j = Journal()
    j.provider("box", 30)
    peers_measured_prefill(j, 6_500, 5)
    feed = j.router.capacity(GPT_OSS)
    assert feed["estimated_ttft_ms"] == pytest.approx(500 / 6_500 * 1000 + 1000 / 30, abs=TOL)


# (registration prefill_tps, observed slot prefill, ring samples, mode, medians) → (value, source)
D4_CASES = {
    "no-median-static":          (0, 0, [], "off", True, 360, "static"),
    "observed-beats-median":     (0, 9_000, [6_500] * 50, "off", True, 9_000, "observed"),
    "trusted-median":            (0, 0, [6_500] * 5, "off", True, 6_500, "median"),
    "median-may-lower":          (4_000, 0, [2_000] * 5, "off", True, 2_000, "median"),
    "untrusted-median-anchor":   (0, 0, [6_500] * 4, "enforce", True, 6_500, "anchor"),
    "untrusted-median-off":      (0, 0, [6_500] * 4, "off", True, 360, "static"),
    "anchor-never-lowers":       (9_000, 0, [], "enforce", True, 9_000, "static"),
    "median-capped":             (0, 0, [30_000] * 5, "off", True, 20_000, "median"),
    "medians-off":               (0, 0, [6_500] * 50, "off", False, 360, "static"),
    "medians-off-enforce":       (0, 0, [6_500] * 50, "enforce", False, 6_500, "anchor"),
}


@pytest.mark.parametrize("case", D4_CASES.values(), ids=D4_CASES.keys())
def test_D4_prefill_resolution_order(case):
    static, observed, samples, mode, medians, value, source = case
    j = Journal(PREFILL_FALLBACK_MODE=mode, TTFT_PREFILL_MEDIANS=str(medians).lower())
    j.provider("box", 30, prefill_tps=static, slots=[slot(GPT_OSS, prefill=observed)])
    for v in samples:
        j.router.rings.prefill.record(GPT_OSS, "M3|Max", v)  # direct: 30,000 would be zeroed at ingest
    got = est.resolve_prefill(j.p("box"), GPT_OSS, j.slot("box"), j.config, j.router.rings,
                              recalibrate=(mode == "enforce"))
    assert got == (value, source)


@pytest.mark.parametrize("mode", ["off", "enforce"])
def test_D6_recalibration_table(mode):
    enforce = mode == "enforce"
    j = Journal(PREFILL_FALLBACK_MODE=mode)
    c, rings = j.config, j.router.rings
    j.provider("observed", 0, slots=[slot(GPT_OSS, prefill=1_800)])
    j.provider("static", 0)                               # bandwidth 400 ⇒ 20 × 12 = 240
    j.provider("legacy", 0, hb={"legacy": True})
    j.provider("fast-static", 0, prefill_tps=9_000)

    def resolve(pid, s="slot"):
        s = j.slot(pid) if s == "slot" else s
        return est.resolve_prefill(j.p(pid), GPT_OSS, s, c, rings, recalibrate=enforce)[0]

    assert resolve("observed") == 1_800
    assert resolve("static") == (6_500 if enforce else 240)
    assert resolve("legacy") == 240
    assert resolve("fast-static") == 9_000
    over = dataclasses.replace(j.slot("observed"), observed_prefill_tps=25_000)
    assert resolve("observed", over) == 20_000


@pytest.mark.parametrize("ceiling, value, kept", [
    ("20000", 6_500, True), ("20000", 15_000, True), ("20000", 17_700, True), ("20000", 25_000, False),
    ("5000", 6_500, False)])
def test_D7_prefill_ingest_zeroes_values_above_the_ceiling(ceiling, value, kept):
    j = Journal(MAX_PREFILL_TPS=ceiling)
    j.provider("box", 30, slots=[slot(GPT_OSS, prefill=value)])
    assert j.slot("box").observed_prefill_tps == (value if kept else 0)
    assert j.router.rings.prefill.stats(GPT_OSS, "M3|Max") == ((value, 1) if kept else (0, 0))


def test_D8_prefill_recorded_through_heartbeats_without_solo_gating():
    j = Journal()
    j.provider("box", 30, models=[GPT_OSS, GEMMA], slots=[])
    ring = lambda: j.router.rings.prefill.stats(GPT_OSS, "M3|Max")[1]  # noqa: E731
    j.beat("box", [slot(GPT_OSS, running=1, prefill=6_500)])
    assert ring() == 1
    j.beat("box", [slot(GPT_OSS, running=2, waiting=1, prefill=7_000), slot(GEMMA, running=3)])
    assert ring() == 2
    j.beat("box", [slot(GPT_OSS, running=1, prefill=25_000)])
    assert ring() == 2
    j.beat("box", [slot(GPT_OSS, running=1, prefill=0)])
    assert ring() == 2


def test_D9_resent_prefill_ewma_is_recorded_once_per_change():
    j = Journal()
    j.provider("box", 30, models=[GPT_OSS, GEMMA], slots=[])
    count = lambda m: j.router.rings.prefill.stats(m, "M3|Max")[1]  # noqa: E731
    for _ in range(5):
        j.beat("box", [slot(GPT_OSS, prefill=6_500)])
    assert count(GPT_OSS) == 1
    j.beat("box", [slot(GPT_OSS, prefill=7_000)])
    assert count(GPT_OSS) == 2
    j.beat("box", [slot(GPT_OSS, prefill=6_500)])
    assert count(GPT_OSS) == 3
    j.beat("box", [slot(GPT_OSS, prefill=6_500), slot(GEMMA, prefill=6_500)])
    assert (count(GPT_OSS), count(GEMMA)) == (3, 1)


def test_D10_shared_median_converges_across_boxes():
    j = Journal()
    for pid, d in (("d20", 20), ("d30", 30), ("d90", 90)):
        j.provider(pid, d)
    peers_measured_prefill(j, 6_500, 5)
    for pid, d in (("d20", 20), ("d30", 30), ("d90", 90)):
        dec = j.decide(long_request(f"for-{pid}", allowed_provider_ids=[pid]))
        assert routed_to(dec, pid) and dec["estimated_ttft_ms"] < 5_000
        assert dec["estimated_ttft_ms"] == pytest.approx(LONG_PROMPT / 6_500 * 1000 + 1000 / d, abs=TOL)


def train(cal: TtftCalibrator, ratios, model=GPT_OSS, family="M3", source="static", start=0):
    for i, r in enumerate(ratios):
        key = (f"t{start + i}", 0)
        cal.note_prediction(key, model, family, source, 1_000.0, 0, start + i)
        assert cal.observe(key, 1_000.0 * r, 1)


def test_D11_calibrator_ratios_and_application():
    cal = TtftCalibrator()
    train(cal, [0.30] * 50)
    ratio = cal.ratio(GPT_OSS, "M3", "static")
    assert ratio == pytest.approx(0.30)
    assert cal.apply(3_303, 0, ratio) == pytest.approx(990.9, abs=TOL)         # ≈ 991
    assert cal.apply(33_000, 30_000, ratio) == pytest.approx(30_900, abs=TOL)  # penalty never scaled
    low, high, young = TtftCalibrator(), TtftCalibrator(), TtftCalibrator()
    train(low, [0.1] * 50)
    train(high, [2.0] * 50)
    train(young, [0.3] * 49)
    assert low.ratio(GPT_OSS, "M3", "static") == 0.2
    assert high.ratio(GPT_OSS, "M3", "static") == 1.5
    assert young.ratio(GPT_OSS, "M3", "static") == 1.0


def test_D11_model_window_used_when_family_window_is_warming_up():
    cal = TtftCalibrator()
    train(cal, [0.5] * 30, family="M1")
    train(cal, [0.5] * 30, family="M2", start=100)
    assert cal.ratio(GPT_OSS, "M3", "static") == pytest.approx(0.5)   # (model) window has 60
    assert cal.ratio(GPT_OSS, "M1", "static") == pytest.approx(0.5)
    assert cal.ratio(GPT_OSS, "M3", "median") == 1.0                  # other prefill source: untouched


def test_D11_calibration_learned_from_completions_and_kill_switch():
    j = Journal()
    j.provider("box", 30)
    raw = 100 / 360 * 1000 + 1000 / 30
    for i in range(50):
        d = j.route(f"r{i}")
        assert d["estimated_ttft_ms"] == pytest.approx(raw, abs=TOL)
        j.release(d, ttft_ms=0.3 * d["estimated_ttft_ms"])
    assert j.router.calibrator.observations == 50
    d = j.route("calibrated")
    assert d["estimated_ttft_ms"] == pytest.approx(0.3 * raw, abs=TOL)
    j.release(d)
    j.apply(config_change({"TTFT_CALIBRATION": "off"}))
    assert j.route("switched-off")["estimated_ttft_ms"] == pytest.approx(raw, abs=TOL)


def test_D11_ratios_learned_on_static_do_not_scale_a_newly_trusted_median():
    j = Journal()
    j.provider("box", 30)
    for i in range(50):
        d = j.route(f"r{i}")
        j.release(d, ttft_ms=0.3 * d["estimated_ttft_ms"])
    peers_measured_prefill(j, 6_500, 5)
    d = j.route("median-now")
    assert d["prefill_source"] == "median"
    assert d["estimated_ttft_ms"] == pytest.approx(100 / 6_500 * 1000 + 1000 / 30, abs=TOL)


def test_shadow_mode_reports_what_the_anchor_would_do_without_changing_routing():
    """Domain §2.14: in shadow mode a request whose live estimate misses its deadline gets a
    PrefillShadow verdict computed with the anchor; the live decision is unchanged."""
    j = Journal(PREFILL_FALLBACK_MODE="shadow")
    j.provider("box", 30)
    out = j.apply(request("long", GPT_OSS, LONG_PROMPT, 256))
    assert [r for t, r in out if t == "PrefillShadow"] == [{"decision": "would_admit", "gate": "soft", "model": GPT_OSS}]
    [d] = Journal.decisions_in(out)
    assert routed_to(d, "box") and d["prefill_source"] == "static"
    assert d["estimated_ttft_ms"] == pytest.approx(LONG_PROMPT / 360 * 1000 + 1000 / 30, abs=TOL)
    j.release(d)
    assert [t for t, _ in j.apply(request("short", GPT_OSS, 100, 256))] == ["RouteDecision", "Reservation"]


@pytest.mark.parametrize("medians, resolved", [("true", 6_500), ("false", 360)])
def test_long_prompt_bias_uses_the_resolved_prefill(medians, resolved):
    """Domain §2.11: with LONG_PROMPT_TOKENS set, cost += (weight − 1)·prompt/resolvedPrefill·1000
    (warm slot); the base `thisReqMs` keeps the static chain."""
    j = Journal(LONG_PROMPT_TOKENS="10000", TTFT_PREFILL_MEDIANS=medians)
    j.provider("box", 30)
    peers_measured_prefill(j, 6_500, 5)
    d = j.decide(request("long", GPT_OSS, LONG_PROMPT, 256))
    base = LONG_PROMPT / 360 * 1000 + 256 / 30 * 1000 + 550
    assert d["cost_ms"] == pytest.approx(base + (2.0 - 1) * (LONG_PROMPT / resolved * 1000), abs=TOL)


def d12_fleet(ratio: str, hard: bool) -> Journal:
    j = Journal(PREFILL_DECODE_RATIO=ratio, TTFT_HARD_REJECT="true" if hard else "false")
    for i in range(70):
        j.provider(f"sim-{i:02d}", 23 + i % 5)
    return j


def served(j: Journal, rid: str, prompt: int) -> bool:
    d = j.route(rid, GPT_OSS, prompt, 512)
    if d["outcome"] == "routed":
        j.release(d)
        return True
    assert d["reason"] == "ttft_too_slow", d
    return False


def cliff(j: Journal, lo: int, hi: int) -> int:
    """Largest served prompt, by bisection (served(lo), not served(hi))."""
    n = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n += 1
        if served(j, f"bisect-{n}", mid):
            lo = mid
        else:
            hi = mid
    return lo


def test_D12_reduced_routing_sim_legacy_ratio_4_cliff_near_601():
    j = d12_fleet("4", hard=True)
    assert all(served(j, f"small-{p}", p) for p in (64, 200, 350, 499))
    assert not any(served(j, f"big-{p}", p) for p in (750, 1_000, 4_000, 8_000))
    c = cliff(j, 499, 750)
    assert 550 <= c <= 650 and abs(c - 601) <= 5


def test_D12_reduced_routing_sim_ratio_12_moves_the_cliff_and_soft_gate_serves_all():
    j = d12_fleet("12", hard=True)
    c = cliff(j, 499, 8_000)
    assert c == pytest.approx(2_384, rel=0.01)
    soft = d12_fleet("4", hard=False)
    assert all(served(soft, f"soft-{p}", p) for p in (64, 750, 4_000, 8_000))


# =================================================================================================
# E. Selection: cheapest-cost and the satisficing band (#526)
# =================================================================================================
BAND_BOXES = (("fast", 100), ("mid", 40), ("slow", 20))
BAND_COST = {"fast": 500 / 1200 * 1000 + 2000 / 100 * 1000 + 550,
             "mid": 500 / 480 * 1000 + 2000 / 40 * 1000 + 550,
             "slow": 500 / 240 * 1000 + 2000 / 20 * 1000 + 550}
BAND_TTFT = {"fast": 500 / 1200 * 1000 + 1000 / 100, "mid": 500 / 480 * 1000 + 1000 / 40,
             "slow": 500 / 240 * 1000 + 1000 / 20}


def band_fleet(**short) -> Journal:
    j = Journal(**short)
    for pid, d in BAND_BOXES:
        j.provider(pid, d)
    return j


def band_route(j: Journal, rid: str, release: bool = True, **kw) -> dict:
    j.apply(tick(j.router.now + 100))  # time moves (serve counters decay), providers stay fresh
    d = j.route(rid, GPT_OSS, 500, 2_000, max_ttft_ms=10_000, min_decode_tps=15, **kw)
    if release and d["outcome"] == "routed":
        j.release(d)
    return d


def test_E_band_fixture_costs_ttft_and_projected_decode():
    assert BAND_COST["fast"] == pytest.approx(20_967, abs=1)
    assert BAND_COST["mid"] == pytest.approx(51_592, abs=1)
    assert BAND_COST["slow"] == pytest.approx(102_633, abs=1)
    j = band_fleet()
    for pid, d in BAND_BOXES:
        dec = band_route(j, f"only-{pid}", allowed_provider_ids=[pid])
        assert routed_to(dec, pid)
        assert dec["cost_ms"] == pytest.approx(BAND_COST[pid], abs=TOL)
        assert dec["estimated_ttft_ms"] == pytest.approx(BAND_TTFT[pid], abs=TOL)
        assert est.projected_decode_tps(j.p(pid), j.slot(pid), j.config) == pytest.approx(d / 1.27, abs=1e-9)
    assert [round(d / 1.27, 1) for _, d in BAND_BOXES] == [78.7, 31.5, 15.7]


@pytest.mark.parametrize("extra_ms, near_tie", [(2_900, True), (3_100, False)])
def test_near_tie_window_is_3000_ms(extra_ms, near_tie):
    """Domain §2.16: candidates within 3,000 ms of the cheapest are near ties (random among
    equivalents); beyond it the cheapest always wins. The gap is set through the memory-pressure
    health term (4,000 ms per unit)."""
    j = Journal()
    j.provider("cheap", 30)
    j.provider("dear", 30, hb={"memory_pressure": 0.1 + extra_ms / 4_000})
    costs = {pid: j.route(f"only-{pid}", allowed_provider_ids=[pid])["cost_ms"] for pid in ("cheap", "dear")}
    for d in j.decisions[-2:]:
        j.release(d)
    assert costs["dear"] - costs["cheap"] == pytest.approx(extra_ms, abs=TOL)
    winners = Counter()
    for i in range(40):
        d = j.route(f"r{i}")
        winners[d["provider_id"]] += 1
        if near_tie:
            assert d["provider_id"] == near_tie_pick(f"r{i}", ["cheap", "dear"])
        j.release(d)
    assert (len(winners) == 2) is near_tie


def test_an_idle_near_tie_beats_a_cheaper_box_with_a_request():
    """Domain §2.16 example: within 3,000 ms the lower effective queue wins over the lower cost."""
    j = Journal()
    j.provider("fast", 100)
    j.provider("idle", 25)
    assert routed_to(j.route("hold", allowed_provider_ids=["fast"]), "fast")
    fast_cost = j.route("probe", allowed_provider_ids=["fast"])["cost_ms"]
    j.release(j.decisions[-1])
    idle_cost = 100 / 300 * 1000 + 256 / 25 * 1000 + 550
    assert fast_cost < idle_cost < fast_cost + 3_000
    d = j.route("r")
    assert routed_to(d, "idle") and d["selected_by"] == "cheapest"


def test_E1_band_off_pins_the_cheapest_box():
    j = band_fleet()
    winners = Counter(band_route(j, f"t{i}")["provider_id"] for i in range(50))
    assert winners == {"fast": 50}
    assert j.decisions[-2]["selected_by"] == "cheapest"


def test_E2_band_spreads_across_members():
    j = band_fleet(SATISFICING_BAND="true")
    decisions = [band_route(j, f"t{i}") for i in range(300)]
    winners = Counter(d["provider_id"] for d in decisions)
    assert set(winners) == {"fast", "mid", "slow"} and winners["fast"] < 300
    assert all(d["selected_by"] == "band" and d["band_members"] == 3 for d in decisions)


def test_E3_empty_band_falls_back_to_cheapest():
    j = Journal(SATISFICING_BAND="true", SATISFICING_TTFT_MARGIN_MS="2500", MIN_DECODE_TPS="0")
    for pid, d in (("fast", 60), ("mid", 30), ("slow", 15)):
        j.provider(pid, d)
    for pid, ttft in (("fast", 711), ("mid", 1_422), ("slow", 2_844)):
        dec = j.route(f"only-{pid}", GPT_OSS, 500, 2_000, max_ttft_ms=3_000, allowed_provider_ids=[pid])
        assert dec["estimated_ttft_ms"] == pytest.approx(ttft, abs=1)
        j.release(dec)
    for i in range(30):
        dec = j.route(f"t{i}", GPT_OSS, 500, 2_000, max_ttft_ms=3_000)
        assert routed_to(dec, "fast") and dec["band_members"] == 0 and dec["selected_by"] == "cheapest"
        j.release(dec)


def test_E5_band_weights_shift_with_recent_serves():
    j = Journal(SATISFICING_BAND="true")
    for pid in ("box-a", "box-b", "box-c"):
        j.provider(pid, 40)
    hot = "box-b"
    counts = Counter()
    for i in range(2_100):
        j.router.serves.entries = {hot: (9.0, j.router.now)}  # hot: 9 recent serves ⇒ weight 0.1
        d = j.route(f"pick-{i}", GPT_OSS, 500, 2_000, max_ttft_ms=10_000)
        assert d["selected_by"] == "band" and d["band_members"] == 3
        counts[d["provider_id"]] += 1
        j.release(d)
    assert counts[hot] > 0
    assert counts[hot] * 4 < min(counts["box-a"], counts["box-c"])
    assert counts[hot] / 2_100 == pytest.approx(0.1 / 2.1, abs=0.02)


def test_E6_recent_serve_counter_decay():
    c = ServeCounter()
    t0 = 1_000_000
    c.record("box", t0)
    c.record("box", t0)
    assert c.read("box", t0) == pytest.approx(2.0, abs=1e-12)
    assert c.read("box", t0 + 5 * 60_000) == pytest.approx(1.0, abs=1e-9)
    assert c.read("box", t0 + 50 * 60_000) < 0.01
    assert c.read("unknown", t0) == 0


def test_E7_serve_counter_fed_with_band_off():
    j = band_fleet()
    d = band_route(j, "one", release=False)
    assert j.router.serves.read(d["provider_id"], j.router.now) == pytest.approx(1.0)


def test_E8_cache_affinity_pinned_within_band():
    j = band_fleet(SATISFICING_BAND="true")
    key = {"consumer_key": "consumer-1", "cache_affinity_key": "prefix-abc"}
    assert routed_to(band_route(j, "pin", allowed_provider_ids=["mid"], **key), "mid")
    for i in range(40):
        d = band_route(j, f"t{i}", **key)
        assert routed_to(d, "mid") and d["selected_by"] == "affinity"


def test_E10_warm_slot_beats_idle_shutdown_peer():
    j = Journal()
    j.provider("box-a", 60, slots=[slot(GPT_OSS, state="idle_shutdown")])
    j.provider("box-b", 60)
    d = j.route("r")
    assert routed_to(d, "box-b")
    cold = j.route("cold", allowed_provider_ids=["box-a"])
    assert cold["cost_ms"] - d["cost_ms"] == pytest.approx(20_000, abs=TOL)


def test_E10_crashed_slot_never_selected_even_if_fastest():
    j = Journal()
    j.provider("crashed", 100, slots=[slot(GPT_OSS, state="crashed")])
    j.provider("slow", 20)
    for i in range(5):
        d = j.route(f"r{i}")
        assert routed_to(d, "slow")
        j.release(d)


def test_E10_self_signed_provider_never_selected_with_hardware_floor():
    j = Journal()
    j.provider("self-signed", 100, trust="self_signed")
    j.provider("hardware", 20)
    for i in range(5):
        d = j.route(f"r{i}")
        assert routed_to(d, "hardware") and d["candidates"] == 1
        j.release(d)


def test_E11_load_distributes_across_idle_near_tie_providers():
    j = Journal()
    j.provider("ultra", 80, family="M2", tier="Ultra", memory_gb=192, bandwidth=800,
               hb={"total_memory_gb": 192})
    j.provider("max", 60)
    j.provider("pro", 20, tier="Pro", memory_gb=36, bandwidth=150, hb={"total_memory_gb": 36})
    winners = Counter()
    for i in range(100):
        d = j.route(f"r{i}")
        winners[d["provider_id"]] += 1
        j.release(d)
    assert max(winners.values()) <= 70
    assert set(winners) == {"ultra", "max"}  # the Pro is > 3,000 ms behind


# =================================================================================================
# F. API outcomes
# =================================================================================================
def capped_fleet(j: Journal, model=GEMMA):
    for pid in ("box-a", "box-b"):
        j.provider(pid, 23, models=[model], slots=[slot(model, budget_max=100_000)])
    for i in range(4):
        assert j.route(f"busy-{i}", model)["outcome"] == "routed"


def test_F1_all_at_cap_queues_then_times_out():
    j = Journal()
    capped_fleet(j)
    d = j.route("waiting", GEMMA)
    assert (d["outcome"], d["http_status"], d["retry_after_s"], d["capacity_rejections"]) == ("queued", 202, None, 2)
    out = j.apply(tick(j.router.now + 30_001))
    [timeout] = Journal.decisions_in(out)
    assert (timeout["request_id"], timeout["reason"], timeout["http_status"], timeout["retry_after_s"]) == \
        ("waiting", "queue_timeout", 429, 2)


@pytest.mark.parametrize("how", ["dedicated", "queue_before_shed_off"])
def test_F2_machine_busy_with_retry_after_2_on_an_empty_queue(how):
    j = Journal(DEDICATED_MODELS="gemma-4") if how == "dedicated" else Journal(QUEUE_BEFORE_SHED="false")
    capped_fleet(j)
    d = j.route("shed", GEMMA)
    assert (d["outcome"], d["reason"], d["http_status"], d["retry_after_s"]) == ("rejected", "machine_busy", 429, 2)


@pytest.mark.parametrize("queued, retry", [(4, 12), (20, 30)])
def test_F2_retry_after_grows_with_queue_depth(queued, retry):
    j = Journal(QUEUE_MAX_DEPTH="25")
    capped_fleet(j)
    for i in range(queued):
        assert j.route(f"q{i}", GEMMA)["outcome"] == "queued"
    j.apply(config_change({"QUEUE_BEFORE_SHED": "false"}, at_ms=j.router.now))
    d = j.route("shed", GEMMA)
    assert (d["reason"], d["http_status"], d["retry_after_s"]) == ("machine_busy", 429, retry)


def test_F3_hard_gate_ttft_too_slow_with_retry_after_20():
    j = Journal(TTFT_HARD_REJECT="true")
    j.provider("box", 30)
    d = j.decide(request("long", GPT_OSS, LONG_PROMPT, 256))
    assert (d["outcome"], d["reason"], d["http_status"]) == ("rejected", "ttft_too_slow", 429)
    best = LONG_PROMPT / 360 * 1000 + 1000 / 30
    assert d["estimated_ttft_ms"] == pytest.approx(best, abs=TOL)
    assert (best - (5_000 + LONG_PROMPT)) / 1000 == pytest.approx(19.4, abs=0.01)
    assert d["retry_after_s"] == 20


def test_F4_only_too_large_providers_is_model_unavailable():
    j = Journal()
    for pid in ("small-a", "small-b"):
        j.provider(pid, 30, models=[model_with_size(GEMMA, 15, min_ram_gb=36)], memory_gb=24,
                   slots=[], hb={"total_memory_gb": 24})
    d = j.route("big", GEMMA)
    assert (d["outcome"], d["reason"], d["http_status"], d["retry_after_s"]) == \
        ("rejected", "model_too_large", 503, None)
    assert (d["too_large"], d["candidates"], d["capacity_rejections"]) == (2, 0, 0)


def test_F5_no_structurally_eligible_provider_is_no_provider():
    j = Journal()
    j.provider("self-signed", 30, trust="self_signed")
    j.provider("draining", 30, hb={"status": "draining"})
    d = j.route("r")
    assert (d["outcome"], d["reason"], d["http_status"], d["retry_after_s"]) == ("rejected", "no_provider", 503, 2)
    assert d["estimated_ttft_ms"] == 0


# =================================================================================================
# Formulas of domain §2 that no numbered example pins on its own
# =================================================================================================
def test_effective_tps_prefers_observed_then_fleet_median_then_loaded_static():
    """Domain §2.11 resolveEffectiveTPS, seen through the TTFT first-decode term (1000/effTPS)."""
    prefill = 100 / 360 * 1000
    loaded = Journal()  # no observed rate anywhere in the family: static / (1 + k·running)
    loaded.provider("loaded", 30, slots=[slot(GPT_OSS, running=2)])
    d = loaded.route("b")
    assert d["estimated_ttft_ms"] == pytest.approx(prefill + 1000 / (30 / (1 + 0.27 * 2)), abs=TOL)
    j = Journal()
    j.provider("observed", 30, slots=[slot(GPT_OSS, decode=50)])
    j.provider("other", 30, slots=[slot(GPT_OSS, decode=40)])
    d = j.route("a", allowed_provider_ids=["observed"])  # own EWMA beats the fleet median (45)
    assert d["estimated_ttft_ms"] == pytest.approx(prefill + 1000 / 50, abs=TOL)
    k = Journal()
    k.provider("plain", 30)
    k.provider("peer", 30, family="M3", tier="Pro", slots=[slot(GPT_OSS, decode=45)])  # same family M3
    d = k.route("c", allowed_provider_ids=["plain"])
    assert k.router.rings.decode.stats(GPT_OSS, "M3") == (45, 1)
    assert d["estimated_ttft_ms"] == pytest.approx(prefill + 1000 / 45, abs=TOL)
    assert d["cost_ms"] == pytest.approx(prefill + 256 / 45 * 1000 + 550, abs=TOL)


@pytest.mark.parametrize("max_concurrency, admitted", [(4, False), (0, True)])
def test_pending_load_counts_engine_work_only_when_the_slot_reports_concurrency(max_concurrency, admitted):
    """Domain §2.6.5: with slot max_concurrency > 0 the load is max(pending for the model, running +
    waiting); otherwise it is the coordinator's total pending."""
    j = Journal()
    j.provider("box", 93, slots=[slot(GPT_OSS, max_concurrency=max_concurrency, running=3, waiting=1)])
    d = j.route("r")
    assert (d["outcome"] == "routed") is admitted


# =================================================================================================
# The example journals of spec/examples
# =================================================================================================
@pytest.mark.parametrize("name", ["dedicated-cap-sheds", "queue-timeout"])
def test_example_journal(name):
    got = run_journal_file(EXAMPLES / f"{name}.jsonl")
    expected = read_jsonl(EXAMPLES / f"{name}.expected.jsonl")
    assert len(got) == len(expected), got
    for g, e in zip(got, expected):
        for field, value in e.items():
            if field in ("estimated_ttft_ms", "cost_ms"):
                assert g[field] == pytest.approx(value, abs=TOL), (e["request_id"], field)
            else:
                assert g[field] == value, (e["request_id"], field, g[field])
