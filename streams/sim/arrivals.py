"""Request arrivals: a synthetic generator with the production figures of domain §6.3, and replay of
the public traces in ../shared/traces/ (Azure LLM 2023 code and conversation, Mooncake FAST'25).

Both yield `Arrival`s in time order (seconds from the start of the run), lazily, deterministic from
the seed; `gateway_request` turns one into the RouteRequest a gateway publishes, stamped as the
production API stamps it (domain §2.1, §1.4): `min_decode_tps` = the decode floor on every route,
`max_ttft_ms` = deadline(prompt) = 5,000 + prompt ms when the hard TTFT gate is on, `max_tokens` =
the API's default when the client left it out.

Synthetic traffic:
* Poisson arrivals at a total rate, split over models by a share table (per-model rates);
  optionally a diurnal swing;
* prompt tokens from the July 2026 distribution (p50 979, p90 9,993, p95 16,919, p99.9 74,473,
  max 124,754): an inverse CDF through those anchors, log-tokens interpolated in normal-score space;
* max_tokens: the client's value (256–4,096) or, when omitted, the gateway's default (8,192);
  generated tokens lognormal (median 300), capped by max_tokens;
* multi-turn conversations: a share of arrivals are the next turn of a recent conversation (same
  consumer and cache-affinity key; the prompt carries the history), so affinity pins matter.

Trace replay keeps the trace's arrival times (divided by `scale`: scale 10 = ten times the trace's
rate) and token lengths; the model comes from the share table. Mooncake's `hash_ids` (512-token
prefix blocks) give the cache-affinity key: block 0 is shared by every request (a system prompt),
block 1 identifies the conversation. A trace shorter than the run is replayed again after its end.
"""
from __future__ import annotations

import bisect
import csv
import json
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from statistics import NormalDist
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


def traces_dir() -> Path:
    env = os.environ.get("SWITCHYARD_TRACES")
    if env:
        return Path(env)
    for p in (ROOT.parent / "shared" / "traces", Path("/work/shared/traces")):
        if p.exists():
            return p
    return ROOT.parent / "shared" / "traces"


TRACES = {
    "azure-code": ("azure-llm-2023", "AzureLLMInferenceTrace_code.csv"),
    "azure-conv": ("azure-llm-2023", "AzureLLMInferenceTrace_conv.csv"),
    "mooncake": ("mooncake-fast25", "conversation_trace.jsonl"),
}

DEFAULT_MAX_TOKENS = 8192           # what the API injects when the client omits max_tokens
DEADLINE_BASE_MS = 5000.0
DECODE_FLOOR_TPS = 15.0

# (quantile, prompt tokens) of the production prompts, domain §6.3 (p50, p90, p95, p99.9, max;
# p10 and p99 interpolated) — what trace-less single-turn traffic uses ...
PROMPT_ANCHORS = ((0.0, 8), (0.1, 96), (0.5, 979), (0.9, 9993), (0.95, 16919), (0.99, 42000),
                  (0.999, 74473), (1.0, 124754))
# ... and the first turns of synthetic traffic with follow-ups: follow-up turns carry their history,
# so first turns are shorter for the whole stream to match §6.3 (p50 ≈ 1.05k, p90 ≈ 10k, p99.9 ≈ 74k
# at the default 30 % follow-ups; tests/sim/test_arrivals.py checks it)
FIRST_TURN_ANCHORS = ((0.0, 8), (0.1, 66), (0.5, 690), (0.9, 10000), (0.95, 17500), (0.99, 43000),
                      (0.999, 74473), (1.0, 124754))
CLIENT_MAX_TOKENS = {256: 0.2, 512: 0.25, 1024: 0.25, 2048: 0.15, 4096: 0.15}


@dataclass(slots=True)
class Arrival:
    t: float                    # seconds from the start of the run
    request_id: str
    model: str
    prompt: int
    max_tokens: int             # as the gateway sends it (0 would mean the router's 256)
    out_tokens: int             # what the model will generate (≤ max_tokens)
    account_id: str | None = None
    consumer_key: str | None = None
    affinity_key: str | None = None
    attempt: int = 0


def gateway_request(a: Arrival, sent_at_ms: int, *, hard_ttft: bool = False,
                    min_decode_tps: float = DECODE_FLOOR_TPS, deadline_base_ms: float = DEADLINE_BASE_MS,
                    attempt: int | None = None, reply_to: str = "") -> dict:
    """The RouteRequest (fields in schema order) a gateway publishes for an arrival."""
    return {"request_id": a.request_id, "attempt": a.attempt if attempt is None else attempt,
            "model": a.model, "prompt_tokens": a.prompt, "max_tokens": a.max_tokens,
            "max_ttft_ms": deadline_base_ms + float(a.prompt) if hard_ttft else 0.0,
            "min_decode_tps": float(min_decode_tps), "account_id": a.account_id,
            "consumer_key": a.consumer_key, "cache_affinity_key": a.affinity_key,
            "self_route_only": False, "prefer_owner": False, "requires_vision": False,
            "allowed_provider_ids": [], "excluded_provider_ids": [], "avoid_version": None,
            "reply_to": reply_to, "sent_at_ms": sent_at_ms}


# === distributions =================================================================================
class PromptSampler:
    """Inverse CDF through PROMPT_ANCHORS (log tokens, normal-score interpolation inside)."""

    def __init__(self, anchors=PROMPT_ANCHORS, scale: float = 1.0):
        nd = NormalDist()
        self.q = [q for q, _ in anchors]
        self.z = [nd.inv_cdf(q) if 0 < q < 1 else None for q, _ in anchors]
        self.logv = [math.log(v * scale) for _, v in anchors]
        self.nd = nd

    def __call__(self, u: float) -> int:
        q = self.q
        i = max(1, min(len(q) - 1, bisect.bisect_right(q, u)))
        q0, q1 = q[i - 1], q[i]
        z0, z1 = self.z[i - 1], self.z[i]
        if z0 is not None and z1 is not None and 0 < u < 1:
            w = (self.nd.inv_cdf(u) - z0) / (z1 - z0)
        else:
            w = (u - q0) / (q1 - q0) if q1 > q0 else 0.0
        w = min(1.0, max(0.0, w))
        return max(1, int(round(math.exp(self.logv[i - 1] + w * (self.logv[i] - self.logv[i - 1])))))


def _pick(rng: random.Random, table: dict):
    keys = list(table)
    return rng.choices(keys, weights=[table[k] for k in keys])[0]


def _max_tokens(rng: random.Random, omitted_share: float, default_max: int) -> int:
    if rng.random() < omitted_share:
        return default_max
    return _pick(rng, CLIENT_MAX_TOKENS)


def _out_tokens(rng: random.Random, max_tokens: int, median: float = 300.0, sigma: float = 1.0) -> int:
    return max(1, min(max_tokens, int(round(rng.lognormvariate(math.log(median), sigma)))))


# === synthetic ====================================================================================
@dataclass
class Traffic:
    """What a synthetic generator produces (presets fill it)."""
    rate: float                           # arrivals per second (all models)
    mix: dict                             # model -> share
    followup_share: float = 0.3           # arrivals that continue a recent conversation
    conversation_ttl_s: float = 600.0
    max_turns: int = 8
    accounts: int = 500
    omitted_max_share: float = 0.45       # clients that leave max_tokens to the gateway
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    prompt_scale: float = 1.0
    diurnal: float = 0.0                  # rate × (1 + diurnal·sin(2π·t/day)), thinned


def synthetic(traffic: Traffic, duration_s: float, seed, id_prefix: str = "r") -> Iterator[Arrival]:
    rng = random.Random(f"arrivals-{seed}")
    anchors = FIRST_TURN_ANCHORS if traffic.followup_share > 0 else PROMPT_ANCHORS
    prompt = PromptSampler(anchors, scale=traffic.prompt_scale)
    peak = traffic.rate * (1 + max(0.0, traffic.diurnal))
    convs: list = []        # [last_t, consumer, key, model, prompt, out, turns, account]
    t, i, n_conv = 0.0, 0, 0
    ttl = traffic.conversation_ttl_s
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if traffic.diurnal > 0:
            level = traffic.rate * (1 + traffic.diurnal * math.sin(2 * math.pi * t / 86400.0))
            if rng.random() * peak > level:
                continue
        if i % 4096 == 0 and convs:
            convs = [c for c in convs if t - c[0] <= ttl]
        rid = f"{id_prefix}{i:08d}"
        i += 1
        c = None
        if convs and rng.random() < traffic.followup_share:
            while convs:  # a random live conversation (swap-remove; expired ones are dropped)
                j = rng.randrange(len(convs))
                c = convs[j]
                convs[j] = convs[-1]
                convs.pop()
                if t - c[0] <= ttl:
                    break
                c = None
        if c is not None:
            new = max(8, int(rng.lognormvariate(math.log(120), 1.0)))
            p = min(131_000, c[4] + c[5] + new)
            mt = _max_tokens(rng, traffic.omitted_max_share, traffic.default_max_tokens)
            out = _out_tokens(rng, mt)
            yield Arrival(t, rid, c[3], p, mt, out, c[7], c[1], c[2])
            if c[6] + 1 < traffic.max_turns:
                convs.append([t, c[1], c[2], c[3], p, out, c[6] + 1, c[7]])
            continue
        model = _pick(rng, traffic.mix)
        p = prompt(rng.random())
        mt = _max_tokens(rng, traffic.omitted_max_share, traffic.default_max_tokens)
        out = _out_tokens(rng, mt)
        acct = f"acct-{rng.randrange(traffic.accounts):04d}"
        key = f"conv-{n_conv:07d}"
        n_conv += 1
        yield Arrival(t, rid, model, p, mt, out, acct, acct, key)
        convs.append([t, acct, key, model, p, out, 1, acct])


# === traces =======================================================================================
@dataclass(slots=True)
class TraceRow:
    t: float            # seconds since the trace's first row
    prompt: int
    out: int
    affinity: str | None


def _azure_time(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than fromisoformat takes before 3.11
    date, _, frac = text.strip().partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def load_trace(kind: str, path: str | os.PathLike | None = None, limit: int | None = None) -> list[TraceRow]:
    """The rows of a trace file (times relative to its first row), in file order."""
    if kind not in TRACES:
        raise ValueError(f"unknown trace {kind!r} (one of {', '.join(TRACES)})")
    if path is None:
        folder, name = TRACES[kind]
        path = traces_dir() / folder / name
    rows: list[TraceRow] = []
    if kind.startswith("azure"):
        with open(path, newline="") as fp:
            t0 = None
            for rec in csv.DictReader(fp):
                t = _azure_time(rec["TIMESTAMP"])
                t0 = t if t0 is None else t0
                rows.append(TraceRow(t - t0, int(rec["ContextTokens"]), int(rec["GeneratedTokens"]), None))
                if limit is not None and len(rows) >= limit:
                    break
    else:
        with open(path) as fp:
            t0 = None
            for line in fp:
                if not line.strip():
                    continue
                rec = json.loads(line)
                t = rec["timestamp"] / 1000.0
                t0 = t if t0 is None else t0
                h = rec.get("hash_ids") or []
                rows.append(TraceRow(t - t0, int(rec["input_length"]), int(rec["output_length"]),
                                     f"mc-{h[0]}-{h[1]}" if len(h) >= 2 else None))
                if limit is not None and len(rows) >= limit:
                    break
    rows.sort(key=lambda r: r.t)  # stable: file order among equal times
    return rows


def trace_rate(rows: list[TraceRow]) -> float:
    span = rows[-1].t - rows[0].t if len(rows) > 1 else 0.0
    return len(rows) / span if span > 0 else float(len(rows))


def replay_trace(rows: list[TraceRow], duration_s: float, seed, mix: dict, *, scale: float = 1.0,
                 omitted_max_share: float = 0.45, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 consumer: str = "trace", id_prefix: str = "t") -> Iterator[Arrival]:
    """The trace's requests at t / scale, looped until duration_s; models drawn from `mix`."""
    if not rows:
        return
    if scale <= 0:
        raise ValueError("trace scale must be positive")
    rng = random.Random(f"trace-{seed}")
    span = rows[-1].t + (rows[-1].t / max(1, len(rows) - 1) if len(rows) > 1 else 1.0)
    i, lap = 0, 0
    while True:
        for r in rows:
            t = (lap * span + r.t) / scale
            if t >= duration_s:
                return
            model = _pick(rng, mix)
            mt = _max_tokens(rng, omitted_max_share, default_max_tokens)
            if r.out > mt:
                mt = default_max_tokens if r.out <= default_max_tokens else r.out
            key = None if r.affinity is None else (f"{r.affinity}~{lap}" if lap else r.affinity)
            yield Arrival(t, f"{id_prefix}{i:08d}", model, max(1, r.prompt), mt, max(1, min(r.out, mt)),
                          consumer if key else None, consumer if key else None, key)
            i += 1
        lap += 1
