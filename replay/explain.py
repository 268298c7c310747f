"""Explain one request: the state the router saw for it and why the winner won (or why it was
rejected), from a replay of the journal up to the request. Human-readable text, or JSON.
"""
from __future__ import annotations

from typing import Iterable

from streams.config import DEFAULT, Config
from streams.jsonl import JournalEntry
from streams.router import Router

VERDICTS = {
    "gated": "failed a structural gate (trust, status, private-only, dedicated, version floor, vision)",
    "slot_crashed": "its slot for the model crashed", "slot_reloading": "its slot is reloading",
    "no_headroom": "at its concurrency cap (capacity rejection)",
    "thermal_critical": "thermal state critical",
    "too_large": "the model does not fit its memory (too large)",
    "kv_budget": "the KV budget (per-slot or pooled) cannot hold the request (capacity rejection)",
    "ttft_too_slow": "its TTFT exceeds the request's hard ceiling",
    "candidate": "candidate",
}


def explain(entries: Iterable[JournalEntry], request_id: str, attempt: int | None = None,
            config: Config = DEFAULT) -> dict | None:
    router = Router(config, track_changes=False)
    for entry in entries:
        rec = entry.record
        is_target = (entry.type == "RouteRequest" and rec.get("request_id") == request_id
                     and (attempt is None or rec.get("attempt") == attempt))
        if not is_target:
            router.apply(entry.journal_offset, entry.journal_time_ms, entry.type, rec)
            continue
        # Run the time-driven work due at this entry's "now" first (a same-time Tick does exactly
        # that), so the scan sees the state the decision saw.
        now = entry.journal_time_ms if entry.journal_time_ms is not None else rec.get("sent_at_ms")
        router.apply(entry.journal_offset, None, "Tick", {"at_ms": max(router.now, now or 0)})
        request, why = router._stamp(rec)
        trace: list = []
        if request is not None:
            scan = router.scan(request, trace=trace)
            band = {x.p.provider_id for x in router.band_members(request, scan.candidates)} \
                if router.config.band else set()
            for row in trace:
                row["in_band"] = row["provider_id"] in band
                row["recent_serves"] = router.serves.read(row["provider_id"], router.now)
        outputs = router.apply(entry.journal_offset, entry.journal_time_ms, entry.type, rec)
        decision = next((r for k, r in outputs if k == "RouteDecision" and r["request_id"] == request_id), None)
        return {"request": rec, "stamped": _stamped(request), "invalid": why or None,
                "config_id": router.config.config_id, "now_ms": router.now,
                "candidates": trace, "decision": decision}
    return None


def _stamped(request) -> dict | None:
    if request is None:
        return None
    return {"prompt_tokens": request.prompt, "max_tokens": request.max_tokens,
            "max_ttft_ms": request.max_ttft_ms, "min_decode_tps": request.min_decode_tps,
            "deadline_ms": request.deadline_ms}


def render(report: dict) -> str:
    d, req = report["decision"], report["request"]
    lines = [f"Request {req['request_id']}#{req['attempt']} for {req['model']}: "
             f"prompt {req['prompt_tokens']} tokens, max {req['max_tokens']}",
             f"  decided at {report['now_ms']} ms under config {report['config_id']}"]
    if report["stamped"]:
        s = report["stamped"]
        lines.append(f"  stamped: max_ttft_ms {s['max_ttft_ms']:.0f}, min_decode_tps {s['min_decode_tps']:g}, "
                     f"deadline {s['deadline_ms']:.0f} ms")
    if report["invalid"]:
        lines.append(f"  invalid request: {report['invalid']}")
    lines.append(f"  {len(report['candidates'])} providers advertise the model:")
    for row in report["candidates"]:
        verdict = VERDICTS.get(row["verdict"], row["verdict"])
        extra = []
        if "ttft_ms" in row:
            extra.append(f"TTFT {row['ttft_ms']:.0f} ms (raw {row['raw_ttft_ms']:.0f}, prefill "
                         f"{row['prefill_tps']:.0f} tok/s from {row['prefill_source']}, calibration "
                         f"×{row['calibration']:.2f})")
        if "cost_ms" in row:
            extra.append(f"cost {row['cost_ms']:.0f} ms")
        if "cap" in row:
            extra.append(f"load {row['load']} of cap {row['cap']}")
        if "pooled_remaining" in row:
            extra.append(f"pooled remaining {row['pooled_remaining']} tokens")
        if row.get("in_band"):
            extra.append(f"in band, recent serves {row['recent_serves']:.2f}")
        lines.append(f"    {row['provider_id']}: {verdict}" + (f"; {'; '.join(extra)}" if extra else ""))
    if d is None:
        lines.append("  no decision (duplicate request identity)")
    elif d["outcome"] == "routed":
        how = {"cheapest": "lowest cost", "near_tie_random": "random pick among near-equal candidates",
               "affinity": "cache affinity", "band": "satisficing band, weighted by recent serves",
               "queue_drain": "drained from the queue"}.get(d["selected_by"], d["selected_by"])
        lines.append(f"  ROUTED to {d['provider_id']} by {how}: TTFT {d['estimated_ttft_ms']:.0f} ms "
                     f"({d['prefill_source']}), cost {d['cost_ms']:.0f} ms, {d['candidates']} candidates")
    else:
        lines.append(f"  {d['outcome'].upper()} {d['reason'] or ''} (HTTP {d['http_status']}"
                     + (f", Retry-After {d['retry_after_s']} s" if d["retry_after_s"] is not None else "")
                     + f"): {d['capacity_rejections']} capacity, {d['too_large']} too large, "
                     f"{d['ttft_rejections']} TTFT rejections")
    return "\n".join(lines)
