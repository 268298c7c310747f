"""The precise rules of spec/rules.md §1–§7, through `Router.apply` with real events.

Each test names the behaviour it pins; the rule is quoted in its docstring where it is not obvious.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from streams.calibration import TtftCalibrator
from streams.config import Config, ConfigError

from .helpers import (GEMMA, GPT_OSS, Journal, completion, config_change, disconnected, heartbeat, model_entry,
                      near_tie_pick, registered, request, settings, slot, tick, u)

TOL = 0.01
ROOT = Path(__file__).resolve().parents[2]


def gemma_box(j: Journal, pid: str, **reg) -> None:
    """A D = 23 gemma box with a budget slot: quality cap 2 (domain §2.6)."""
    j.provider(pid, 23, models=[GEMMA], slots=[slot(GEMMA, budget_max=100_000)], **reg)


def fill(j: Journal, n: int, model: str = GEMMA, prefix: str = "busy") -> list[dict]:
    ds = [j.route(f"{prefix}-{i}", model) for i in range(n)]
    assert all(d["outcome"] == "routed" for d in ds), ds
    return ds


# =================================================================================================
# §1 Position and time
# =================================================================================================
def test_now_comes_from_journal_time_when_present_and_never_goes_backwards():
    j = Journal()
    j.provider("box", 30)
    d1 = j.decide({**request("r1", at_ms=1_000), "journal_time_ms": 5_000})
    assert d1["decided_at_ms"] == 5_000
    d2 = j.decide({**request("r2", at_ms=9_000), "journal_time_ms": 6_000})   # record time ignored
    assert d2["decided_at_ms"] == 6_000
    d3 = j.decide({**request("r3", at_ms=1), "journal_time_ms": 2_000})        # earlier: time holds
    assert d3["decided_at_ms"] == 6_000
    d4 = j.decide(request("r4", at_ms=7_500))                                   # no journal time
    assert d4["decided_at_ms"] == 7_500
    d5 = j.decide(request("r5", at_ms=7_000))
    assert d5["decided_at_ms"] == 7_500


@pytest.mark.parametrize("line, field", [
    (registered("p", 30, at_ms=1_234), "registered_at_ms"),
    (heartbeat("nobody", 1, at_ms=1_234), "sent_at_ms"),
    (disconnected("nobody", at_ms=1_234), "at_ms"),
    (request("r", at_ms=1_234), "sent_at_ms"),
    (completion("r", at_ms=1_234), "completed_at_ms"),
    (config_change({}, at_ms=1_234), "changed_at_ms"),
    (tick(1_234), "at_ms"),
])
def test_each_record_type_advances_now_by_its_own_time_field(line, field):
    assert line[field] == 1_234
    j = Journal()
    j.apply(line)
    assert j.router.now == 1_234


def test_journal_offset_comes_from_the_entry():
    j = Journal()
    j.provider("box", 30)
    d = j.decide({**request("r1"), "journal_offset": 4242})
    assert d["journal_offset"] == 4242


def test_queue_timeouts_run_before_the_entry():
    """A completion arriving after the wait has expired cannot rescue the queued request."""
    j = Journal()
    gemma_box(j, "box")
    busy = fill(j, 2)
    j.apply(request("late", GEMMA, at_ms=3_000))
    assert j.decisions[-1]["outcome"] == "queued"
    out = j.apply(completion(busy[0]["request_id"], "box", GEMMA, at_ms=33_001))
    decisions = Journal.decisions_in(out)
    assert [(d["request_id"], d["reason"]) for d in decisions] == [("late", "queue_timeout")]


def test_provider_staleness_runs_before_queue_timeouts():
    """At one entry both a provider goes stale and a queued request's wait expires: the staleness
    release drains the queue first, so the request is routed rather than timed out."""
    j = Journal(PROVIDER_STALE_MS="40000")
    gemma_box(j, "box-x")
    gemma_box(j, "box-y")
    fill(j, 4)
    assert j.decide(request("q", GEMMA, at_ms=3_000))["outcome"] == "queued"
    j.apply(heartbeat("box-y", 2, [slot(GEMMA, budget_max=100_000)], at_ms=30_000))  # drain: still full
    j.apply(config_change({"QUALITY_CONCURRENCY_CAP": "false"}, at_ms=31_000))       # no drain
    assert j.router.queues[GEMMA][0].request.request_id == "q"
    out = j.apply(tick(45_000))  # box-x stale (45,000 − 0 > 40,000) and q expired (42,000 > 30,000)
    [d] = Journal.decisions_in(out)
    assert (d["request_id"], d["outcome"], d["provider_id"], d["selected_by"]) == \
        ("q", "routed", "box-y", "queue_drain")
    assert "box-x" not in j.router.providers


def test_ticks_only_advance_time_and_nothing_is_synthesised_at_the_end():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    j.route("waiting", GEMMA)
    assert j.apply(tick(10_000)) == []
    assert [d["request_id"] for d in j.decisions].count("waiting") == 1


# =================================================================================================
# §2 Order and randomness
# =================================================================================================
def test_draw_formula_matches_the_core():
    from streams.router import draw
    for rid, attempt, k in (("r1", 0, 0), ("r1", 0, 1), ("x", 3, 0), ("é-ü", 1, 7)):
        assert draw(rid, attempt, k) == u(rid, attempt, k)
        assert 0 <= u(rid, attempt, k) < 1


def test_near_tie_pick_uses_u0_over_equivalents_in_ascending_code_point_order():
    j = Journal()
    for pid in ("box-b", "Box-z", "box-a"):  # registration order is not scan order
        j.provider(pid, 30)
    order = sorted(["box-b", "Box-z", "box-a"])
    assert order == ["Box-z", "box-a", "box-b"]
    seen = set()
    for i in range(24):
        rid = f"req-{i}"
        d = j.route(rid)
        assert d["selected_by"] == "near_tie_random"
        assert d["provider_id"] == near_tie_pick(rid, order)
        seen.add(d["provider_id"])
        j.release(d)
    assert seen == set(order)


def test_near_tie_equivalents_exclude_a_busier_near_tie():
    """Domain §2.16: a faster box with one request is within 3,000 ms but has a higher effective
    queue, so the draw is over the three idle boxes only."""
    j = Journal()
    j.provider("fast-busy", 100)
    for pid in ("idle-1", "idle-2", "idle-3"):
        j.provider(pid, 30)
    assert j.route("hold", allowed_provider_ids=["fast-busy"])["provider_id"] == "fast-busy"
    busy_cost = j.route("probe", allowed_provider_ids=["fast-busy"], max_tokens=256)["cost_ms"]
    j.release(j.decisions[-1])
    idle_cost = 100 / 360 * 1000 + 256 / 30 * 1000 + 550
    assert abs(busy_cost - idle_cost) <= 3_000  # a near tie, but not equivalent
    for i in range(12):
        rid = f"r{i}"
        d = j.route(rid)
        assert d["provider_id"] == near_tie_pick(rid, ["idle-1", "idle-2", "idle-3"])
        assert d["cost_ms"] == pytest.approx(idle_cost, abs=TOL)
        j.release(d)


def test_band_pick_uses_u1_with_serve_count_weights_in_scan_order():
    j = Journal(SATISFICING_BAND="true")
    for pid in ("box-c", "box-a", "box-b"):
        j.provider(pid, 40)
    members = ["box-a", "box-b", "box-c"]
    for i in range(30):
        rid = f"band-{i}"
        now = j.router.now
        weights = [1.0 / (1.0 + j.router.serves.read(pid, now)) for pid in members]
        x = u(rid, 0, 1) * sum(weights)
        expected = members[-1]
        for pid, w in zip(members, weights):
            x -= w
            if x < 0:
                expected = pid
                break
        d = j.route(rid, GPT_OSS, 500, 2_000, max_ttft_ms=10_000)
        assert (d["selected_by"], d["band_members"], d["provider_id"]) == ("band", 3, expected)
        j.release(d)


def test_a_request_redecided_from_the_queue_uses_the_same_draws():
    j = Journal()
    for pid in ("box-a", "box-b", "box-c"):
        gemma_box(j, pid)
    fill(j, 6)
    assert j.route("queued-one", GEMMA)["outcome"] == "queued"
    j.apply(config_change({"QUALITY_CONCURRENCY_CAP": "false"}))
    out = j.apply(heartbeat("box-b", 2, [slot(GEMMA, budget_max=100_000)]))
    [d] = Journal.decisions_in(out)
    assert d["selected_by"] == "queue_drain"
    assert d["provider_id"] == near_tie_pick("queued-one", ["box-a", "box-b", "box-c"])


# =================================================================================================
# §3 Settings
# =================================================================================================
def test_config_change_is_a_patch():
    j = Journal()
    j.apply(config_change({"SATISFICING_BAND": "true", "MIN_DECODE_TPS": "20"}))
    assert j.config.band is True and j.config.min_decode_tps == 20
    j.apply(config_change({"MIN_DECODE_TPS": "25"}))             # absent keys unchanged
    assert j.config.band is True and j.config.min_decode_tps == 25
    j.apply(config_change({"SATISFICING_BAND": ""}))             # "" resets to the default
    assert j.config.band is False and j.config.min_decode_tps == 25


@pytest.mark.parametrize("bad", [
    {"EIGENINFERENCE_MIN_DECODE_TPS": "abc"},
    {"EIGENINFERENCE_MIN_DECODE_TPS": "NaN"},
    {"EIGENINFERENCE_SATISFICING_TTFT_MARGIN_MS": "Inf"},
    {"EIGENINFERENCE_MAX_PREFILL_TPS": "-Infinity"},
    {"EIGENINFERENCE_NO_SUCH_SETTING": "1"},
    {"SATISFICING_BAND_WITHOUT_PREFIX": "true"},
    {"EIGENINFERENCE_TTFT_HARD_REJECT": "maybe"},
    {"EIGENINFERENCE_QUEUE_MAX_WAIT": "ten seconds"},
    {"EIGENINFERENCE_QUEUE_MAX_DEPTH": "2.5"},
], ids=lambda b: f"{next(iter(b))}={next(iter(b.values()))}")
def test_an_invalid_setting_rejects_the_whole_change(bad):
    j = Journal()
    before = j.config
    out = j.router.apply(0, None, "ConfigChange",
                         {"settings": {"EIGENINFERENCE_SATISFICING_BAND": "true", **bad}, "changed_at_ms": 0})
    assert [t for t, _ in out] == ["Rejected"]
    assert j.config is before and j.config.band is False
    assert j.router.counters["rejected_bad_config"] == 1


@pytest.mark.parametrize("value", ["t", "y"])
def test_booleans_outside_the_listed_spellings_are_unparseable(value):
    with pytest.raises(ConfigError):
        Config(settings(SATISFICING_BAND=value))


@pytest.mark.parametrize("value, expected", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
    ("false", False), ("False", False), ("0", False), ("NO", False), ("off", False)])
def test_boolean_spellings(value, expected):
    assert Config(settings(SATISFICING_BAND=value)).band is expected


@pytest.mark.parametrize("value, ms", [("45000", 45_000), ("30s", 30_000), ("10m", 600_000),
                                       ("1h30m", 5_400_000), ("1500ms", 1_500)])
def test_durations_are_milliseconds_or_go_strings(value, ms):
    assert Config(settings(QUEUE_MAX_WAIT=value)).queue_max_wait_ms == ms


@pytest.mark.parametrize("short, value, attr, expected", [
    ("PREFILL_DECODE_RATIO", "-5", "prefill_decode_ratio", 12.0),
    ("PREFILL_FALLBACK_MODE", "bogus", "prefill_fallback_mode", "off"),
    ("PREFILL_FALLBACK_MODE", " Enforce ", "prefill_fallback_mode", "enforce"),
    ("V2_MAX_CONCURRENCY_CEILING", "0", "v2_ceiling", 4),
    ("SATISFICING_TTFT_MARGIN_MS", "-3", "band_margin_ms", 0.0),
    ("LONG_PROMPT_PREFILL_WEIGHT", "0.5", "long_prompt_weight", 1.0),
    ("QUALITY_CONCURRENCY_OVERCOMMIT", "0", "overcommit", 1.0),
    ("QUALITY_CAP_SOLO_MIN_SAMPLES", "0", "solo_min_samples", 1),
    ("TTFT_PREFILL_MIN_SAMPLES", "-2", "prefill_min_samples", 1),
])
def test_out_of_range_values_are_normalised_not_rejected(short, value, attr, expected):
    j = Journal()
    out = j.apply(config_change({short: value}))
    assert out == []
    assert getattr(j.config, attr) == expected


def test_config_id_is_stable_and_changes_with_a_setting():
    a, b = Config(), Config({})
    assert a.config_id == b.config_id and len(a.config_id) == 16
    int(a.config_id, 16)
    changed = a.patched(settings(SATISFICING_BAND="true"))
    assert changed.config_id != a.config_id
    assert changed.patched(settings(SATISFICING_BAND="")).config_id == a.config_id
    assert Config(settings(SATISFICING_BAND="true")).config_id == changed.config_id
    j = Journal()
    j.provider("box", 30)
    assert j.route("r1")["config_id"] == a.config_id
    j.apply(config_change({"SATISFICING_BAND": "true"}))
    assert j.route("r2")["config_id"] == changed.config_id


def test_added_settings_have_their_defaults():
    c = Config()
    assert (c.k, c.provider_stale_ms, c.tick_interval_ms, c.route_wait_budget_ms) == (0.27, 90_000, 1_000, 0)
    assert (c.queue_max_depth, c.queue_max_wait_ms, c.band_respect_health) == (10, 30_000, False)
    assert c.dedicated == () and c.decode_floor_fleet_median is False


# =================================================================================================
# §4 Providers
# =================================================================================================
def test_reregistration_with_a_new_event_id_starts_a_fresh_session():
    j = Journal()
    j.apply(registered("box", 30, event_id="reg-1"),
            heartbeat("box", 5, [slot(GPT_OSS, prefill=6_500)]))
    first = j.route("r1")
    assert j.p("box").pending and j.router.rings.prefill.stats(GPT_OSS, "M3|Max")[1] == 1
    j.apply(registered("box", 30, event_id="reg-2"))
    p = j.p("box")
    assert p.pending == {} and p.last_seq == 0 and p.last_prefill == {}
    j.apply(heartbeat("box", 1, [slot(GPT_OSS, prefill=6_500, state="idle")]))  # seq 1 applies again
    assert j.slot("box").state == "idle"
    assert j.router.rings.prefill.stats(GPT_OSS, "M3|Max")[1] == 2  # same value, new session: recorded
    j.release(first)
    assert j.router.counters["completions_unmatched"] == 1


def test_a_repeated_registration_event_is_ignored():
    j = Journal()
    reg = registered("box", 30, event_id="reg-1")
    j.apply(reg, heartbeat("box", 1))
    j.route("r1")
    j.apply(reg)
    assert len(j.p("box").pending) == 1 and j.p("box").backend is not None


def test_duplicate_heartbeat_and_completion_event_ids_are_ignored():
    j = Journal()
    j.provider("box", 30)
    hb = heartbeat("box", 0, [slot(GPT_OSS, decode=50)], event_id="hb-dup")
    j.apply(hb, hb)
    assert j.router.rings.decode.stats(GPT_OSS, "M3")[1] == 1
    j.route("r1"), j.route("r2")
    done = completion("r1", "box", event_id="done-dup")
    j.apply(done, done)
    assert list(j.p("box").pending) == [("r2", 0)]
    assert j.router.counters["completions_unmatched"] == 0 and j.router.counters["duplicate_events"] >= 2


def test_a_stale_seq_heartbeat_does_not_replace_capacity_but_refreshes_liveness():
    j = Journal()
    j.provider("box", 30)
    j.apply(heartbeat("box", 2, [slot(GPT_OSS)], at_ms=0))
    out = j.apply(heartbeat("box", 2, [slot(GPT_OSS, state="crashed")], at_ms=80_000),
                  heartbeat("box", 1, [slot(GPT_OSS, state="crashed")], at_ms=80_000))
    assert out == [] and j.slot("box").state == "running"
    assert j.router.counters["heartbeats_stale_seq"] == 2
    d = j.route("r", at_ms=150_000)  # 150,000 − 80,000 ≤ 90,000: still live
    assert d["outcome"] == "routed"


def test_a_stale_seq_heartbeat_does_not_change_status_or_metrics():
    j = Journal()
    j.provider("box", 30)
    j.apply(heartbeat("box", 3, [slot(GPT_OSS)]))
    j.apply(heartbeat("box", 2, [slot(GPT_OSS)], status="draining", thermal="critical", memory_pressure=1.0))
    p = j.p("box")
    assert (p.status, p.thermal, p.memory_pressure) == ("idle", "nominal", 0.1)
    assert j.route("r")["outcome"] == "routed"


def test_an_unsequenced_heartbeat_is_always_applied():
    j = Journal()
    j.provider("box", 30)
    j.apply(heartbeat("box", 7, [slot(GPT_OSS)]))
    j.apply(heartbeat("box", 0, [slot(GPT_OSS, state="idle")]))
    assert j.slot("box").state == "idle"


def test_heartbeats_for_unknown_or_disconnected_providers_are_skipped_and_counted():
    j = Journal()
    assert j.apply(heartbeat("ghost", 1)) == []
    j.provider("box", 30)
    j.apply(disconnected("box"))
    assert j.apply(heartbeat("box", 2)) == []
    assert j.router.counters["heartbeats_unknown_provider"] == 2
    assert "box" not in j.router.providers


def test_draining_provider_is_not_routable_nor_a_queue_drain_target():
    j = Journal()
    gemma_box(j, "box-a")
    fill(j, 2)
    gemma_box(j, "box-b", hb={"status": "draining"})
    q = j.route("q", GEMMA)
    assert q["outcome"] == "queued" and q["candidates"] == 0
    out = j.apply(heartbeat("box-b", 2, [slot(GEMMA, budget_max=100_000)], status="draining"))
    assert Journal.decisions_in(out) == []
    out = j.apply(heartbeat("box-b", 3, [slot(GEMMA, budget_max=100_000)], status="idle"))
    assert [(d["request_id"], d["provider_id"]) for d in Journal.decisions_in(out)] == [("q", "box-b")]


def test_staleness_boundary_takes_the_provider_offline_and_drops_its_pending():
    j = Journal()
    j.apply(registered("box", 30, at_ms=1_000), heartbeat("box", 1, at_ms=1_000))
    on_time = j.decide(request("on-time", at_ms=91_000))       # now − last_seen = 90,000 ≤ 90,000
    assert on_time["outcome"] == "routed"
    late = j.decide(request("late", at_ms=91_001))
    assert (late["outcome"], late["reason"]) == ("rejected", "no_provider")
    assert j.router.counters["providers_stale"] == 1
    j.release(on_time)
    assert j.router.counters["completions_unmatched"] == 1


def test_a_new_registration_alone_does_not_drain_the_queue():
    j = Journal()
    gemma_box(j, "box-a")
    fill(j, 2)
    assert j.route("q", GEMMA)["outcome"] == "queued"
    out = j.apply(registered("box-b", 23, models=[GEMMA]))
    assert Journal.decisions_in(out) == []
    out = j.apply(heartbeat("box-b", 1, [slot(GEMMA, budget_max=100_000)]))
    assert [(d["request_id"], d["provider_id"]) for d in Journal.decisions_in(out)] == [("q", "box-b")]


def test_legacy_provider_without_backend_is_cold_with_unreliable_ttft():
    j = Journal()
    j.provider("legacy", 30, hb={"legacy": True})
    d = j.route("r")
    assert d["outcome"] == "routed" and d["estimated_ttft_ms"] == 0 and d["prefill_source"] == "none"
    assert d["cost_ms"] == pytest.approx(30_000 + 100 / 360 * 1000 + 256 / 30 * 1000 + 550, abs=TOL)
    j.release(d)
    j.provider("warm", 30)
    assert j.route("r2")["provider_id"] == "warm"
    band = Journal(SATISFICING_BAND="true")
    band.provider("legacy", 30, hb={"legacy": True})
    assert band.route("r")["band_members"] == 0  # not warm ⇒ not a band member without a deadline


def test_model_match_is_exact_and_case_sensitive():
    j = Journal()
    j.provider("box", 30)
    assert j.route("r", "GPT-OSS-20B")["reason"] == "no_provider"
    assert j.route("r2", "gpt-oss")["reason"] == "no_provider"


def test_a_slot_for_an_unadvertised_model_counts_in_pool_and_rings_but_is_never_routable():
    j = Journal()
    j.provider("box", 30, models=[GPT_OSS],
               slots=[slot(GPT_OSS, budget_max=10_000), slot(GEMMA, budget_max=10_000, budget_used=8_000,
                                                             running=1, decode=20)])
    assert j.p("box").backend.pool.used == 8_000
    assert j.router.rings.decode.stats(GEMMA, "M3") == (20, 1)
    assert j.route("g", GEMMA)["reason"] == "no_provider"


def test_vision_requires_a_vision_build():
    j = Journal()
    j.provider("text", 90)
    j.provider("vision", 30, models=[model_entry(GPT_OSS, is_vision=True)])
    for i in range(3):
        d = j.route(f"v{i}", requires_vision=True)
        assert d["provider_id"] == "vision" and d["candidates"] == 1
        j.release(d)
    only_text = Journal()
    only_text.provider("text", 90)
    assert only_text.route("v", requires_vision=True)["reason"] == "no_provider"


def test_chip_class_of_an_empty_tier():
    j = Journal()
    j.provider("base", 30, family="M3", tier="")
    assert j.p("base").chip_class == "M3|"


@pytest.mark.parametrize("what", ["slots", "models", "string"])
def test_events_beyond_the_limits_are_rejected(what):
    j = Journal()
    if what == "models":
        out = j.apply(registered("box", 30, models=[f"m{i}" for i in range(257)]))
        assert "box" not in j.router.providers
    else:
        j.provider("box", 30)
        slots = [slot(f"m{i}") for i in range(65)] if what == "slots" else [slot("x" * 257)]
        out = j.apply(heartbeat("box", 2, slots))
        assert j.slot("box") is not None and j.slot("box").model == GPT_OSS
    assert [t for t, _ in out] == ["Rejected"]


def test_catalog_size_gates_hardware_fit_and_zero_disables_it():
    j = Journal()
    j.provider("small", 30, models=[model_entry(GEMMA, size_gb=20)], memory_gb=32, slots=[],
               hb={"total_memory_gb": 32})
    assert j.route("big", GEMMA)["reason"] == "model_too_large"  # 20 GB × 2 > 32 GB
    k = Journal()
    k.provider("small", 30, models=[model_entry(GEMMA, size_gb=0)], memory_gb=32, slots=[],
               hb={"total_memory_gb": 32})
    assert k.route("big", GEMMA)["outcome"] == "routed"


# =================================================================================================
# §5 Requests and decisions
# =================================================================================================
def _routed():
    j = Journal()
    j.provider("box", 30)
    return j.route("r"), (200, None, 100 / 360 * 1000 + 1000 / 30)


def _queued():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    return j.route("r", GEMMA), (202, None, 0)


def _machine_busy():
    j = Journal(DEDICATED_MODELS="gemma-4")
    gemma_box(j, "box")
    fill(j, 2)
    return j.route("r", GEMMA), (429, 2, 0)


def _queue_full():
    j = Journal(QUEUE_MAX_DEPTH="2")
    gemma_box(j, "box")
    fill(j, 2)
    j.route("q1", GEMMA), j.route("q2", GEMMA)
    return j.route("r", GEMMA), (429, 6, 0)  # depth 2 (the answered request not counted) ⇒ 3 × 2


def _queue_timeout():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    j.apply(request("r", GEMMA, at_ms=1_000), request("later", GEMMA, at_ms=20_000))
    [d] = Journal.decisions_in(j.apply(tick(31_001)))
    return d, (429, 3, 0)  # one other request still queued ⇒ 3 × 1


def _ttft_too_slow():
    j = Journal(TTFT_HARD_REJECT="true")
    j.provider("box", 30)
    return j.decide(request("r", GPT_OSS, 13_711, 256)), (429, 20, 13_711 / 360 * 1000 + 1000 / 30)


def _model_too_large():
    j = Journal()
    j.provider("box", 30, models=[model_entry(GEMMA, min_ram_gb=128)], slots=[])
    return j.route("r", GEMMA), (503, None, 0)


def _no_provider():
    j = Journal()
    return j.route("r"), (503, 2, 0)


def _expired():
    j = Journal(ROUTE_WAIT_BUDGET_MS="1000")
    j.provider("box", 30)
    return j.decide({**request("r", at_ms=1_000), "journal_time_ms": 2_001}), (503, 2, 0)


def _invalid():
    j = Journal()
    j.provider("box", 30)
    return j.route("r", ""), (400, None, 0)


OUTCOMES = {
    ("routed", None): _routed, ("queued", None): _queued, ("rejected", "machine_busy"): _machine_busy,
    ("rejected", "queue_full"): _queue_full, ("rejected", "queue_timeout"): _queue_timeout,
    ("rejected", "ttft_too_slow"): _ttft_too_slow, ("rejected", "model_too_large"): _model_too_large,
    ("rejected", "no_provider"): _no_provider, ("rejected", "expired"): _expired,
    ("rejected", "invalid_request"): _invalid,
}


@pytest.mark.parametrize("outcome, reason", OUTCOMES.keys(), ids=[r or o for o, r in OUTCOMES])
def test_outcome_table(outcome, reason):
    d, (status, retry, ttft) = OUTCOMES[(outcome, reason)]()
    assert (d["outcome"], d["reason"]) == (outcome, reason)
    assert d["http_status"] == status and d["retry_after_s"] == retry
    assert d["estimated_ttft_ms"] == pytest.approx(ttft, abs=TOL)


def test_no_provider_retry_after_reads_the_queue_depth():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    for i in range(3):
        j.route(f"q{i}", GEMMA)
    j.apply(disconnected("box"))
    d = j.route("r", GEMMA)
    assert (d["reason"], d["retry_after_s"]) == ("no_provider", 9)


@pytest.mark.parametrize("fields", [
    {"model": ""}, {"attempt": -1}, {"prompt_tokens": -1}, {"max_tokens": -5},
    {"self_route_only": True}, {"prefer_owner": True},
], ids=["empty-model", "negative-attempt", "negative-prompt", "negative-max", "self-route-no-account",
        "prefer-owner-no-account"])
def test_invalid_requests(fields):
    j = Journal()
    j.provider("box", 30)
    d = j.decide({**request("bad"), **fields})
    assert (d["outcome"], d["reason"], d["http_status"], d["retry_after_s"]) == \
        ("rejected", "invalid_request", 400, None)
    assert j.p("box").pending == {}


def test_a_repeated_identity_gets_nothing_and_a_later_attempt_does_not_cancel_the_earlier():
    j = Journal()
    j.provider("box", 30)
    j.route("r")
    assert j.apply(request("r")) == []
    d1 = j.route("r", attempt=1)
    assert d1["outcome"] == "routed" and set(j.p("box").pending) == {("r", 0), ("r", 1)}


def slow_cheap_and_fast_hot(j: Journal) -> None:
    """'slow' (D 12, projected 9.4 tok/s) is > 3 s cheaper than 'fast' (D 100, thermal serious)."""
    j.provider("fast", 100, hb={"thermal": "serious"})
    j.provider("slow", 12)


@pytest.mark.parametrize("config_floor, request_floor, winner", [
    ("15", 0, "fast"),     # stamped from EIGENINFERENCE_MIN_DECODE_TPS (15): slow box narrowed away
    ("0", 0, "slow"),      # floor off: cheapest
    ("15", 5, "slow"),     # the request's own value wins when > 0
])
def test_min_decode_tps_stamping(config_floor, request_floor, winner):
    j = Journal(MIN_DECODE_TPS=config_floor)
    slow_cheap_and_fast_hot(j)
    assert j.route("r", max_tokens=16, min_decode_tps=request_floor)["provider_id"] == winner


def test_max_ttft_stamping_hard_gate_public_only():
    j = Journal(TTFT_HARD_REJECT="true")
    j.provider("box", 30, account_id="acct-1")
    owner = {"account_id": "acct-1"}

    def outcome(rid, prompt, **kw):
        d = j.route(rid, GPT_OSS, prompt, **kw)
        if d["outcome"] == "routed":
            j.release(d)
        return d["outcome"], d["reason"]

    assert outcome("public", 13_711) == ("rejected", "ttft_too_slow")      # 38,119 ms > 18,711 ms
    assert outcome("own-ceiling", 13_711, max_ttft_ms=50_000) == ("routed", None)
    assert outcome("self", 13_711, self_route_only=True, **owner) == ("routed", None)
    assert outcome("prefer", 13_711, prefer_owner=True, **owner) == ("routed", None)
    assert outcome("short", 1_000) == ("routed", None)                      # 2,811 ms ≤ 6,000 ms


def test_ttft_too_slow_retry_after_uses_the_stamped_ceiling():
    j = Journal()
    j.provider("box", 30)
    d = j.route("r", GPT_OSS, 13_711, max_ttft_ms=30_000)  # best 38,119 ⇒ ceil(8.1) = 9
    assert (d["reason"], d["retry_after_s"]) == ("ttft_too_slow", 9)


def test_zero_prompt_counts_as_zero_in_costs_and_500_in_the_capacity_feed():
    j = Journal()
    j.provider("box", 30)
    assert j.router.capacity(GPT_OSS)["estimated_ttft_ms"] == pytest.approx(500 / 360 * 1000 + 1000 / 30, abs=TOL)
    d = j.route("r", GPT_OSS, 0, 0)
    assert d["estimated_ttft_ms"] == pytest.approx(1000 / 30, abs=TOL)
    assert d["cost_ms"] == pytest.approx(256 / 30 * 1000 + 550, abs=TOL)  # max_tokens 0 ⇒ 256


def test_allowed_and_excluded_providers_are_hard_filters_and_avoid_version_is_soft():
    j = Journal()
    j.provider("old", 90, version="0.7.4")
    j.provider("new", 30, version="0.7.5")
    assert j.route("a", allowed_provider_ids=["new"])["provider_id"] == "new"
    j.release(j.decisions[-1])
    assert j.route("e", excluded_provider_ids=["old"])["provider_id"] == "new"
    j.release(j.decisions[-1])
    assert j.route("none", allowed_provider_ids=["old"], excluded_provider_ids=["old"])["reason"] == "no_provider"
    assert j.route("avoid", avoid_version="0.7.4")["provider_id"] == "new"
    j.release(j.decisions[-1])
    assert j.route("plain")["provider_id"] == "old"
    j.release(j.decisions[-1])
    only_old = Journal()
    only_old.provider("old", 90, version="0.7.4")
    assert only_old.route("avoid", avoid_version="0.7.4")["provider_id"] == "old"  # never fails closed


def test_thermal_critical_provider_is_dropped_without_counting():
    j = Journal()
    j.provider("hot", 90, hb={"thermal": "critical"})
    d = j.route("r")
    assert (d["reason"], d["candidates"], d["capacity_rejections"], d["too_large"]) == ("no_provider", 0, 0, 0)


def test_a_routed_decision_comes_with_its_reservation():
    j = Journal()
    j.provider("box", 30, slots=[slot(GPT_OSS, budget_max=100_000, kv=50_000)])
    out = j.apply({**request("r", GPT_OSS, 100, 400, at_ms=7_000), "journal_offset": 77})
    assert [t for t, _ in out] == ["RouteDecision", "Reservation"]
    assert out[1][1] == {"request_id": "r", "attempt": 0, "provider_id": "box", "model": GPT_OSS, "tokens": 500,
                         "kv_bytes": 500 * 50_000, "reserved_at_ms": 7_000, "journal_offset": 77}


def test_cache_affinity_wins_among_near_ties_until_its_ttl():
    j = Journal(CACHE_AFFINITY_TTL="1m")
    for pid in ("box-a", "box-b", "box-c"):
        j.provider(pid, 30)
    key = {"consumer_key": "c1", "cache_affinity_key": "prefix"}
    j.release(j.route("pin", allowed_provider_ids=["box-c"], **key))
    for i in range(5):
        j.apply(tick(j.router.now + 1_000))
        d = j.route(f"r{i}", **key)
        assert (d["provider_id"], d["selected_by"]) == ("box-c", "affinity")
        j.release(d)
    j.apply(tick(j.router.now + 60_000))  # last use 60 s ago: expired (now − t < TTL fails)
    d = j.route("expired", **key)
    assert d["selected_by"] == "near_tie_random"
    assert d["provider_id"] == near_tie_pick("expired", ["box-a", "box-b", "box-c"])


def test_owner_relation_self_route_prefer_owner_and_private_only():
    j = Journal()
    j.provider("owned-private", 30, account_id="acct-1", private_only=True, trust="self_signed")
    j.provider("public", 90)
    own = {"account_id": "acct-1"}
    assert j.route("self", self_route_only=True, **own)["provider_id"] == "owned-private"
    assert j.route("other", self_route_only=True, account_id="acct-2")["reason"] == "no_provider"
    assert j.route("public-req")["provider_id"] == "public"   # private-only and self-signed: gated
    prefer = j.route("prefer", prefer_owner=True, **own)
    assert prefer["provider_id"] == "public"  # private-only is admitted only for owner self-route
    k = Journal()
    k.provider("owned", 30, account_id="acct-1")
    k.provider("public", 90)
    assert k.route("prefer", prefer_owner=True, **own)["provider_id"] == "owned"


# =================================================================================================
# §6 Queue
# =================================================================================================
def test_queue_drains_in_fifo_order_as_completions_free_capacity():
    j = Journal()
    gemma_box(j, "box")
    busy = fill(j, 2)
    for rid in ("q1", "q2", "q3"):
        assert j.route(rid, GEMMA)["outcome"] == "queued"
    drained = Journal.decisions_in(j.release(busy[0]))
    assert [(d["request_id"], d["selected_by"], d["http_status"]) for d in drained] == \
        [("q1", "queue_drain", 200)]
    assert [q.request.request_id for q in j.router.queues[GEMMA]] == ["q2", "q3"]
    assert [d["request_id"] for d in Journal.decisions_in(j.release(busy[1]))] == ["q2"]


def test_queue_full_at_depth():
    j = Journal(QUEUE_MAX_DEPTH="3")
    gemma_box(j, "box")
    fill(j, 2)
    assert [j.route(f"q{i}", GEMMA)["outcome"] for i in range(4)] == ["queued"] * 3 + ["rejected"]
    assert j.decisions[-1]["reason"] == "queue_full"


def test_queue_timeout_fires_strictly_after_the_max_wait():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    j.apply(request("q", GEMMA, at_ms=1_000))
    assert Journal.decisions_in(j.apply(tick(31_000))) == []
    [d] = Journal.decisions_in(j.apply(tick(31_001)))
    assert (d["request_id"], d["reason"], d["decided_at_ms"]) == ("q", "queue_timeout", 31_001)


def test_a_cancelled_completion_removes_a_queued_request_without_a_decision():
    j = Journal()
    gemma_box(j, "box")
    busy = fill(j, 2)
    j.route("q1", GEMMA), j.route("q2", GEMMA)
    out = j.apply(completion("q1", "", GEMMA, "cancelled"))
    assert Journal.decisions_in(out) == [] and j.router.counters["queue_cancelled"] == 1
    assert [d["request_id"] for d in Journal.decisions_in(j.release(busy[0]))] == ["q2"]
    assert all(d["request_id"] != "q1" or d["outcome"] == "queued" for d in j.decisions)


def test_a_heartbeat_drains_the_queue():
    j = Journal()
    j.provider("box", 93, slots=[slot(GPT_OSS, budget_max=1_000, budget_used=900)])
    assert j.route("q", GPT_OSS, 100, 256)["outcome"] == "queued"
    out = j.apply(heartbeat("box", 2, [slot(GPT_OSS, budget_max=1_000, budget_used=0)]))
    assert [(d["request_id"], d["selected_by"]) for d in Journal.decisions_in(out)] == [("q", "queue_drain")]


def test_drain_visits_models_in_sorted_order_then_fifo():
    """One box advertising two models; its pending counts against both caps (no reported slot
    concurrency), so one release frees room for one request: the 'a-…' model's, though queued later."""
    j = Journal()
    j.provider("box", 23, models=["b-model", "a-model"],
               slots=[slot("b-model", budget_max=100_000), slot("a-model", budget_max=100_000)])
    busy = fill(j, 2, "a-model")
    assert j.route("b-first", "b-model")["outcome"] == "queued"
    assert j.route("a-second", "a-model")["outcome"] == "queued"
    drained = Journal.decisions_in(j.release(busy[0]))
    assert [d["request_id"] for d in drained] == ["a-second"]


def test_a_queued_request_that_still_does_not_fit_keeps_its_place():
    j = Journal()
    gemma_box(j, "box")
    fill(j, 2)
    j.route("q1", GEMMA), j.route("q2", GEMMA)
    assert Journal.decisions_in(j.apply(heartbeat("box", 2, [slot(GEMMA, budget_max=100_000)]))) == []
    assert [q.request.request_id for q in j.router.queues[GEMMA]] == ["q1", "q2"]


def test_self_route_requests_queue_and_time_out():
    j = Journal()
    gemma_box(j, "box", account_id="acct-1")
    own = {"account_id": "acct-1", "self_route_only": True}
    fill(j, 2)
    assert j.route("mine", GEMMA, **own)["outcome"] == "queued"
    [d] = Journal.decisions_in(j.apply(tick(j.router.now + 30_001)))
    assert (d["request_id"], d["reason"]) == ("mine", "queue_timeout")


# =================================================================================================
# §7 Completions
# =================================================================================================
def test_a_completion_naming_another_provider_still_releases_and_counts_a_mismatch():
    j = Journal()
    j.provider("box", 30)
    j.route("r")
    j.apply(completion("r", "someone-else"))
    assert j.p("box").pending == {} and j.router.counters["completions_provider_mismatch"] == 1


def test_a_completion_without_provider_id_releases_by_identity():
    j = Journal()
    j.provider("box", 30)
    j.route("r")
    j.apply(completion("r", ""))
    assert j.p("box").pending == {} and j.router.counters["completions_provider_mismatch"] == 0


def test_unknown_and_second_completions_are_counted_and_ignored():
    j = Journal()
    j.provider("box", 30)
    j.route("r1"), j.route("r2")
    j.apply(completion("nope", "box"))
    j.apply(completion("r1", "box"))
    j.apply(completion("r1", "box"))  # a second completion (new event id) for the same reservation
    assert list(j.p("box").pending) == [("r2", 0)]
    assert j.p("box").pending_tokens_all == 356
    assert j.router.counters["completions_unmatched"] == 2


@pytest.mark.parametrize("status, ttft, age_ms, fed", [
    ("ok", 120.0, 0, True),
    ("ok", 0.0, 0, False),
    ("error", 120.0, 0, False),
    ("cancelled", 120.0, 0, False),
    ("capacity_rejected", 120.0, 0, False),
    ("ok", 120.0, 599_999, True),
    ("ok", 120.0, 600_000, False),   # a prediction is live while under 10 minutes old
])
def test_calibrator_fed_only_by_ok_with_ttft_and_a_live_prediction(status, ttft, age_ms, fed):
    j = Journal(PROVIDER_STALE_MS="1h")
    j.provider("box", 30)
    d = j.route("r")
    j.apply(completion("r", "box", status=status, ttft_ms=ttft, at_ms=age_ms))
    assert j.router.calibrator.observations == (1 if fed else 0)
    assert j.p("box").pending == {}  # every status releases
    assert d["outcome"] == "routed"


def test_no_prediction_for_a_cold_reservation():
    j = Journal()
    j.provider("cold", 30, slots=[])
    j.route("r")
    j.apply(completion("r", "cold", ttft_ms=500))
    assert j.router.calibrator.observations == 0


def test_calibrator_keeps_at_most_8192_predictions_oldest_dropped():
    cal = TtftCalibrator()
    for i in range(8_193):
        cal.note_prediction((f"r{i}", 0), GPT_OSS, "M3", "static", 1_000, 0, i)
    assert len(cal.predictions) == 8_192
    assert not cal.observe(("r0", 0), 500, 1)
    assert cal.observe(("r8192", 0), 500, 1)


def test_even_calibration_window_median_is_the_mean_of_the_middle_two():
    cal = TtftCalibrator()
    for i, r in enumerate([0.4] * 25 + [0.6] * 25):
        cal.note_prediction((f"r{i}", 0), GPT_OSS, "M3", "static", 1_000, 0, i)
        cal.observe((f"r{i}", 0), 1_000 * r, 1)
    assert cal.ratio(GPT_OSS, "M3", "static") == pytest.approx(0.5)


# =================================================================================================
# Determinism
# =================================================================================================
def build_journal(seed: int = 7) -> list[dict]:
    """A mixed journal (providers, heartbeats, band flips, queueing, completions, ticks); the
    completions are taken from the decisions of a recording run, so the journal is fixed."""
    rnd = random.Random(seed)
    j = Journal()
    lines: list[dict] = []

    def emit(line):
        lines.append(line)
        return j.apply(line)

    t = 0
    for i, (d, models) in enumerate([(23, [GEMMA]), (30, [GPT_OSS, GEMMA]), (30, [GPT_OSS]), (60, [GPT_OSS]),
                                      (93, [GPT_OSS, GEMMA]), (40, [GPT_OSS])]):
        pid = f"p{i}"
        emit(registered(pid, d, models=models, at_ms=t))
        emit(heartbeat(pid, 1, [slot(m, budget_max=20_000) for m in models], at_ms=t))
    routed: list[dict] = []
    for n in range(400):
        t += rnd.randint(0, 400)
        r = rnd.random()
        if r < 0.55:
            out = emit(request(f"r{n}", rnd.choice([GPT_OSS, GEMMA]), rnd.choice([0, 100, 900, 5_000]),
                               rnd.choice([0, 256, 2_000]), at_ms=t,
                               consumer_key=rnd.choice([None, "c1"]), cache_affinity_key="k"))
            routed += [d for d in Journal.decisions_in(out) if d["outcome"] == "routed"]
        elif r < 0.8 and routed:
            d = routed.pop(rnd.randrange(len(routed)))
            out = emit(completion(d["request_id"], d["provider_id"], d["model"], rnd.choice(["ok", "ok", "error"]),
                                  ttft_ms=rnd.choice([0, 150, 900]), at_ms=t))
            routed += [x for x in Journal.decisions_in(out) if x["outcome"] == "routed"]
        elif r < 0.9:
            pid = f"p{rnd.randrange(6)}"
            j.seqs[pid] = j.seqs.get(pid, 1) + 1
            models = list(j.p(pid).models)
            out = emit(heartbeat(pid, j.seqs[pid], [slot(m, budget_max=20_000, decode=rnd.choice([0, 25, 50]),
                                                         prefill=rnd.choice([0, 6_500, 7_000])) for m in models],
                                 at_ms=t))
            routed += [x for x in Journal.decisions_in(out) if x["outcome"] == "routed"]
        elif r < 0.95:
            emit(config_change({"SATISFICING_BAND": rnd.choice(["true", "false"])}, at_ms=t))
        else:
            out = emit(tick(t))
            routed += [x for x in Journal.decisions_in(out) if x["outcome"] == "routed"]
    return lines


def replay(lines: list[dict]) -> list:
    j = Journal()
    j.apply(*lines)
    return j.outputs


def test_two_fresh_routers_fed_the_same_journal_decide_identically():
    lines = build_journal()
    first, second = replay(lines), replay(lines)
    assert first == second
    kinds = {(r["outcome"], r["selected_by"]) for t, r in first if t == "RouteDecision"}
    assert {("routed", "band"), ("routed", "queue_drain"), ("routed", "near_tie_random")} <= kinds
    assert {"queued", "rejected"} <= {outcome for outcome, _ in kinds}


def test_a_json_lines_round_trip_replays_identically():
    lines = build_journal()
    text = "\n".join(json.dumps(line) for line in lines)
    again = [json.loads(line) for line in text.splitlines()]
    assert replay(again) == replay(lines)


def test_decisions_do_not_depend_on_the_hash_seed(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal.write_text("\n".join(json.dumps(line) for line in build_journal(seed=11)))
    script = ("import json,sys; from tests.core.helpers import run_journal_file; from pathlib import Path;"
              "print(json.dumps(run_journal_file(Path(sys.argv[1]))))")
    results = []
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", script, str(journal)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results.append(proc.stdout)
    assert results[0] == results[1] and json.loads(results[0])
