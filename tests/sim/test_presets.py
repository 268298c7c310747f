"""Each preset reproduces the pathology it names, and its what-if setting changes it."""
from __future__ import annotations

import pytest

from streams.sim import offline, presets, scenario

GEMMA = "gemma-4-26b-qat-4bit"


def sim(preset: str, *settings: str, duration: float = 600.0, seed: int = 1, environ=None):
    scn = scenario.resolve(preset, duration_s=duration, seed=seed, environ=environ or {}, settings=list(settings))
    return offline.run(scn, None)


def first_share(res, label: str) -> float:
    return res.first.get(label, 0) / max(1, sum(res.first.values()))


def test_every_preset_is_listed_with_its_pathology_and_what_if():
    text = presets.listing()
    for name, p in presets.PRESETS.items():
        assert name in text and p.pathology and p.whatif


def test_postmortem_cap_off_over_admits_gemma_onto_slow_mixed_boxes():
    # the what-if through the environment, as a worker would read it
    off = sim("postmortem", environ={"EIGENINFERENCE_QUALITY_CONCURRENCY_CAP": "false"})
    on = sim("postmortem")
    assert off.max_load[("mixed-slow", GEMMA)] >= 8          # up to the box's flat cap (24)
    assert on.max_load[("mixed-slow", GEMMA)] <= 2           # the quality cap: ceil(1 × 1.2) = 2
    slow_off = sorted(off.decode_rates(GEMMA, "mixed-slow"))
    slow_on = sorted(on.decode_rates(GEMMA, "mixed-slow"))
    assert slow_off[len(slow_off) // 2] < 0.5 * slow_on[len(slow_on) // 2]   # collapse under batch
    assert off.below_floor_share(GEMMA) > on.below_floor_share(GEMMA) + 0.03
    assert on.max_load[("gemma-fast", GEMMA)] <= 4


def test_prefill_starved_sheds_on_static_prefill_and_the_anchor_fixes_it():
    starved = sim("prefill-starved")
    anchored = sim("prefill-starved", "EIGENINFERENCE_PREFILL_FALLBACK_MODE=enforce")
    assert first_share(starved, "rejected:ttft_too_slow") > 0.4
    assert first_share(anchored, "rejected:ttft_too_slow") < 0.05
    assert starved.router_counters["prefill_shadow_would_admit"] == 0   # mode off: no shadow telemetry


def test_hotspot_concentrates_and_the_band_spreads():
    hot = sim("hotspot")
    spread_on = sim("hotspot", "EIGENINFERENCE_SATISFICING_BAND=true", "EIGENINFERENCE_MIN_DECODE_TPS=0")
    sp, sp2 = hot.figures()["spread"], spread_on.figures()["spread"]
    assert sp["top10_share"] > 0.35 and sp["served_nothing"] >= sp["machines"] // 3
    assert sp2["top10_share"] < 0.6 * sp["top10_share"] and sp2["served_nothing"] < sp["served_nothing"] // 3
    assert sp2["gini"] < sp["gini"]


def test_v2_migration_trips_the_tripwire_and_the_floor_bounds_the_liars():
    floor = sim("v2-migration")
    no_floor = sim("v2-migration", "EIGENINFERENCE_V2_VERSION_FLOOR=")
    assert sum(floor.tripwires.values()) > 0 and sum(no_floor.tripwires.values()) == 0
    liars = [v for (g, _), v in floor.max_load.items() if g == "v2-liars"]
    liars_unbounded = [v for (g, _), v in no_floor.max_load.items() if g == "v2-liars"]
    assert max(liars) <= 4 < max(liars_unbounded)
    assert max(v for (g, _), v in floor.max_load.items() if g == "v2-honest") <= 4


@pytest.mark.parametrize("name", ["default"])
def test_default_preset_has_the_production_mix(name):
    scn = scenario.resolve(name, providers=300, duration_s=60, environ={})
    specs = scn.fleet()
    groups = {s.group.split("+")[0] for s in specs}
    assert {"gemma-only", "mixed", "gpt-oss", "qwen", "self-signed", "small-24gb", "misbehaving"} <= groups
    assert any(s.version == "0.6.8" for s in specs)          # legacy: no capacity reports
    assert {s.behaviour for s in specs} >= {"normal", "failing", "black_hole", "flapping"}
    assert min(s.memory_gb for s in specs) == 24 and max(s.memory_gb for s in specs) >= 256
