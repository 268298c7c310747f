"""Scenario presets: a fleet recipe, worker settings and traffic, each runnable in one command.

    python -m streams.sim presets                      # the list
    python -m streams.sim offline --preset postmortem  # one of them, offline
    python -m streams.sim live --preset hotspot        # or against a broker and a worker

Every preset names the pathology it reproduces and the setting that is its what-if (`whatif`), so
`--setting` (or an EIGENINFERENCE_* variable) flips it and the two summaries compare.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..versions import compare_versions
from .fleet import GEMMA, GPT_OSS, QWEN35, QWEN36, Group

G, O, Q6, Q5 = GEMMA.id, GPT_OSS.id, QWEN36.id, QWEN35.id
PRODUCTION_SEED = {"EIGENINFERENCE_MODEL_SOLO_TPS_SEED": "gemma-4-26b-qat-4bit=14,gpt-oss-20b=30"}

BIG = {"m1max": 3, "m2max": 3, "m3max": 4, "m4max": 4, "m1ultra": 1, "m2ultra": 2, "m3ultra": 1,
       "m4pro": 3, "m3pro": 1}
ANY = dict(BIG, m1pro=1, m2pro=1)
SMALL = {"m2": 1, "m3": 1, "m4": 2, "m5": 1}
VERSIONS = {"0.6.8": 6, "0.7.2": 8, "0.7.4": 40, "0.7.5": 18, "0.7.6": 12, "0.7.15": 16}
MISBEHAVING = {"black_hole": 1, "fast_liar": 1, "flapping": 1, "wedged": 1, "crashy": 1}
PRODUCTION_MIX = {G: 0.55, O: 0.38, Q6: 0.06, Q5: 0.01}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    pathology: str            # what it reproduces
    whatif: str               # the setting that changes it
    groups: tuple
    settings: dict
    mix: dict
    providers: int = 60       # default fleet size
    rate_per_provider: float = 0.04   # arrivals per second per provider (model time)
    heartbeat_s: float = 30.0
    traffic: dict = field(default_factory=dict)   # Traffic overrides
    watch: tuple = ()         # groups the summary details


def _production_groups(prefill: bool | None = None, versions: dict | None = None,
                       benchmark: float = 0.7, prefill_benchmark: float = 0.2) -> tuple:
    v = versions or VERSIONS
    kw = dict(reports_prefill=prefill, benchmark_share=benchmark, prefill_benchmark_share=prefill_benchmark)
    def new(k: str) -> bool:
        return compare_versions(k, "0.7.5") >= 0
    old = {k: w for k, w in v.items() if compare_versions(k, "0.7.2") >= 0 and not new(k)} or v
    return (
        Group("gemma-only", 19, BIG, (((G,), 1.0),), v, min_memory_gb=36, **kw),
        Group("mixed", 27, BIG, (((O, G), 1.0),), dict(old, **{k: w / 3 for k, w in v.items() if new(k)}),
              min_memory_gb=48, **kw),
        Group("gpt-oss", 22, ANY, (((O,), 1.0),), v, **kw),
        Group("qwen", 6, BIG, (((Q6,), 3.0), ((O, Q6), 2.0), ((Q5,), 1.0)), v, min_memory_gb=48, **kw),
        Group("self-signed", 14, ANY, (((O,), 2.0), ((G,), 1.0), ((O, G), 1.0)), v,
              trust={"self_signed": 1.0}, **kw),
        Group("small-24gb", 7, SMALL, (((O,), 1.0),), v, max_memory_gb=24,
              behaviours={"failing": 0.7, "normal": 0.3}, **kw),
        Group("misbehaving", 3, BIG, (((O,), 1.0), ((G,), 1.0)), v, behaviours=MISBEHAVING, **kw),
        Group("mc-liars", 1, BIG, (((O,), 1.0), ((G,), 1.0)), {"0.7.5": 1, "0.7.6": 1},
              behaviours={"mc_liar": 1.0}, **kw),
    )


PRESETS = {p.name: p for p in (
    Preset(
        "default",
        "the production mix of domain §6.1: gemma-only, mixed gemma+gpt-oss, gpt-oss and qwen boxes, "
        "self-signed, failing 24 GB boxes, a few hostile or broken ones; versions 0.6.8-0.7.15",
        "none in particular: production-like load (≈ 46 req/s per 1,260 providers)",
        "any setting",
        _production_groups(), dict(PRODUCTION_SEED), PRODUCTION_MIX, providers=60,
        rate_per_provider=46 / 1260, watch=("mixed", "gemma-only")),
    Preset(
        "postmortem",
        "mixed gemma+gpt-oss boxes on the legacy engine, benchmarked fast (gpt-oss) but slow on gemma "
        "(10-18 tok/s solo, collapsing under batch), beside a few fast CBv2 gemma boxes; gemma 63 % of traffic",
        "over-admission of gemma onto the slow mixed boxes: per-request decode below the 15 tok/s floor",
        "EIGENINFERENCE_QUALITY_CONCURRENCY_CAP=false (the pre-#524 behaviour) vs the default cap",
        (Group("mixed-slow", 55, {"m1max": 2, "m2max": 2, "m3max": 3, "m1ultra": 1, "m2ultra": 2},
               (((O, G), 1.0),), {"0.7.4": 1.0}, min_memory_gb=48, benchmark_share=1.0),
         Group("gemma-fast", 20, {"m4max": 3, "m3ultra": 1}, (((G,), 1.0),), {"0.7.6": 1.0}),
         Group("gpt-oss", 25, {"m1max": 1, "m3max": 1, "m4pro": 1, "m4max": 1}, (((O,), 1.0),),
               {"0.7.4": 1.0, "0.7.6": 1.0})),
        dict(PRODUCTION_SEED), {G: 0.63, O: 0.37}, providers=60, rate_per_provider=0.12, heartbeat_s=5.0,
        watch=("mixed-slow", "gemma-fast")),
    Preset(
        "prefill-starved",
        "no provider reports prefill (binaries before 0.7.14, no registration benchmarks): the router only "
        "has the static chain sqrt(bandwidth)·ratio; June 2026 settings: ratio 4 (≈ 80 tok/s against real "
        "400-2,300), hard TTFT gate on, no calibrator",
        "TTFT over-estimated 5-20×: most requests above a few hundred tokens shed as ttft_too_slow although "
        "a box could serve them (production: ~71 % 429s)",
        "EIGENINFERENCE_PREFILL_FALLBACK_MODE=enforce (the 6,500 tok/s anchor); or the #453 ratio 12 and the "
        "calibrator (EIGENINFERENCE_PREFILL_DECODE_RATIO=12, EIGENINFERENCE_TTFT_CALIBRATION=on)",
        _production_groups(prefill=False, versions={"0.7.2": 10, "0.7.4": 50, "0.7.5": 25, "0.7.6": 15},
                           benchmark=0.0, prefill_benchmark=0.0),
        dict(PRODUCTION_SEED, EIGENINFERENCE_TTFT_HARD_REJECT="true", EIGENINFERENCE_PREFILL_DECODE_RATIO="4",
             EIGENINFERENCE_TTFT_CALIBRATION="off"), PRODUCTION_MIX, providers=60,
        rate_per_provider=46 / 1260, watch=("gpt-oss",)),
    Preset(
        "hotspot",
        "many slow-but-adequate Pro boxes (gpt-oss 36-50 tok/s) beside a few fast Max/Ultra ones (85-96); "
        "every box honest and reporting",
        "concentration: cheapest-cost sends most traffic to the few fast boxes, and the decode-floor "
        "narrowing, projecting a never-served box from its sqrt(bandwidth) proxy (Pro: 14-17 tok/s → below "
        "15 at batch 1), locks most Pro boxes out for good (production: top 10 % of boxes took 79 %)",
        "EIGENINFERENCE_SATISFICING_BAND=true (alone: some spread) together with EIGENINFERENCE_MIN_DECODE_TPS=0 "
        "(the lockout gone: spread over every box)",
        (Group("slow-adequate", 90, {"m1pro": 1, "m2pro": 1, "m3pro": 1, "m4pro": 2}, (((O,), 1.0),),
               {"0.7.15": 1.0}),
         Group("fast", 10, {"m4max": 2, "m3ultra": 1, "m2ultra": 1}, (((O,), 1.0),), {"0.7.15": 1.0})),
        {}, {O: 1.0}, providers=60, rate_per_provider=0.04, watch=("fast", "slow-adequate"),
        traffic={"omitted_max_share": 0.0}),
    Preset(
        "v2-migration",
        "half the fleet upgraded to 0.7.5/0.7.6 (CBv2 engine, private KV grants, engine batch 4); "
        "some upgraded boxes report max_concurrency 24 while their engine runs 4",
        "lying boxes over-admitted (requests wait inside the engine, TTFT balloons); the v2 tripwire counts them",
        "EIGENINFERENCE_V2_VERSION_FLOOR= (empty: clamp and tripwire off) vs 0.7.5",
        (Group("legacy", 50, BIG, (((O,), 1.0), ((G,), 1.0), ((O, G), 1.0)), {"0.7.4": 1.0}, min_memory_gb=36),
         Group("v2-honest", 35, BIG, (((O,), 1.0), ((G,), 1.0)), {"0.7.5": 1.0, "0.7.6": 1.0}),
         Group("v2-liars", 15, BIG, (((O,), 1.0), ((G,), 1.0)), {"0.7.5": 1.0, "0.7.6": 1.0},
               behaviours={"mc_liar": 1.0})),
        dict(PRODUCTION_SEED, EIGENINFERENCE_V2_VERSION_FLOOR="0.7.5"), {G: 0.5, O: 0.5}, providers=60,
        rate_per_provider=0.1, watch=("v2-liars", "v2-honest")),
)}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise SystemExit(f"unknown preset {name!r}; one of: {', '.join(PRESETS)}") from None


def listing() -> str:
    lines = []
    for p in PRESETS.values():
        lines.append(f"{p.name:16s} {p.description}")
        lines.append(f"{'':16s}   reproduces: {p.pathology}")
        lines.append(f"{'':16s}   what-if:    {p.whatif}")
        lines.append(f"{'':16s}   defaults:   {p.providers} providers, {p.rate_per_provider * p.providers:.2f} req/s, "
                     f"heartbeat {p.heartbeat_s:g} s, settings {p.settings or '-'}")
    return "\n".join(lines)
