"""What-if: re-run a journal under changed settings, with the provider side corrected for the
requests that now go elsewhere (issue "what-if"; method and limits in docs/whatif.md).

Method ("correct the recorded dynamics"):
1. The recorded run is a replay of the journal as it is (its decisions equal the live ones when the
   audit passes). From it we know, per request, where it was reserved and when, and from the
   journal when its Completion arrived, with which TTFT.
2. The what-if run replays the same inputs with the settings patched (the patch is re-applied after
   every recorded ConfigChange, so it stays in force), except that recorded Completions are not
   replayed as they are: each request the what-if routes gets a completion on the provider the
   what-if chose, timed from its own reservation with the recorded duration and TTFT rescaled by
   the two providers' static decode and prefill rates; a request that was not served in the
   recorded run gets a synthetic one (prompt / prefill + max_tokens / decode of its provider); one
   that was served but never completed in the journal stays in flight in the what-if too.
3. Heartbeats still carry the recorded providers' counts, which reflect the recorded routing: each
   slot's `num_running` and `active_token_budget_used` are shifted by (what-if in flight − recorded
   in flight) on that provider and model at the heartbeat's time.
Limits: observed decode/prefill EWMAs and memory figures in heartbeats stay as recorded; engine-side
queueing and batch slowdown of the moved load are not modelled (the simulator's provider model,
`streams/sim`, regenerates them for synthetic fleets); cancelled and errored completions keep their
status and rescaled timing.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from streams.config import Config
from streams.jsonl import JournalEntry
from streams.router import Router

METHOD_NOTE = ("Completions moved to the provider the what-if chose and rescaled by static decode/prefill "
               "rates; heartbeat running counts and budgets corrected by the difference in requests in "
               "flight; observed EWMAs as recorded (see docs/whatif.md).")


@dataclass
class Run:
    decisions: list = field(default_factory=list)
    reservations: list = field(default_factory=list)


@dataclass
class WhatIf:
    recorded: Run
    whatif: Run
    settings: dict
    entries: int
    providers: dict          # provider id -> set of advertised models (every session seen)
    method: str = METHOD_NOTE


def _time(entry: JournalEntry) -> int:
    if entry.journal_time_ms is not None:
        return entry.journal_time_ms
    for name in ("sent_at_ms", "registered_at_ms", "completed_at_ms", "changed_at_ms", "at_ms"):
        if name in entry.record:
            return entry.record[name] or 0
    return 0


def _rates(record: dict) -> tuple[float, float]:
    decode = record.get("decode_tps") or 0.0
    bandwidth = (record.get("hardware") or {}).get("memory_bandwidth_gbs") or 0.0
    if not decode > 0:
        decode = math.sqrt(bandwidth) if bandwidth > 0 else 1.0
    prefill = record.get("prefill_tps") or 0.0
    return decode, prefill if prefill > 0 else decode * 12


def recorded_run(entries: list[JournalEntry], progress=None) -> Run:
    router, run = Router(track_changes=False), Run()
    for e in entries:
        for kind, rec in router.apply(e.journal_offset, e.journal_time_ms, e.type, e.record):
            if kind == "RouteDecision":
                run.decisions.append(rec)
            elif kind == "Reservation":
                run.reservations.append(rec)
        if progress:
            progress.update(1)
    return run


def what_if(entries: Iterable[JournalEntry], settings: dict[str, str], progress=None) -> WhatIf:
    entries = list(entries)
    Config().patched(settings)  # reject a bad patch before any work
    recorded = recorded_run(entries, progress)

    rates: dict[str, tuple[float, float]] = {}
    advertised: dict[str, set] = defaultdict(set)
    completions: dict[tuple, dict] = {}
    requests: dict[tuple, dict] = {}
    for e in entries:
        r = e.record
        if e.type == "ProviderRegistered":
            rates[r["provider_id"]] = _rates(r)
            advertised[r["provider_id"]].update(m["id"] for m in r.get("models") or [])
        elif e.type == "Completion":
            completions.setdefault((r["request_id"], r["attempt"]), r)
        elif e.type == "RouteRequest":
            requests[(r["request_id"], r["attempt"])] = r

    # Recorded requests in flight per (provider, model): +1 at reservation, −1 at its completion.
    changes: list[tuple[int, int, str, str, int, int]] = []
    for i, res in enumerate(recorded.reservations):
        k = (res["request_id"], res["attempt"])
        changes.append((res["reserved_at_ms"], 2 * i, res["provider_id"], res["model"], 1, res["tokens"]))
        done = completions.get(k)
        if done is not None:
            changes.append((max(done["completed_at_ms"], res["reserved_at_ms"]), 2 * i + 1,
                            res["provider_id"], res["model"], -1, -res["tokens"]))
    changes.sort()
    reserved_at = {(r["request_id"], r["attempt"]): r for r in recorded.reservations}

    router, run = Router(track_changes=False), Run()
    inflight: dict[tuple, list] = defaultdict(lambda: [0, 0])   # (pid, model) -> [what-if − recorded, tokens]
    pending: list = []                                          # heap of (time, seq, completion)
    seq, ci, offset = 0, 0, 0

    def advance(t: int) -> None:
        nonlocal ci
        while ci < len(changes) and changes[ci][0] <= t:
            _, _, pid, model, n, tokens = changes[ci]
            inflight[(pid, model)][0] -= n
            inflight[(pid, model)][1] -= tokens
            ci += 1

    def apply(kind: str, record: dict, time_ms: int) -> None:
        nonlocal offset, seq
        for out_kind, rec in router.apply(offset, time_ms, kind, record):
            if out_kind == "RouteDecision":
                run.decisions.append(rec)
            elif out_kind == "Reservation":
                run.reservations.append(rec)
                k = (rec["request_id"], rec["attempt"])
                inflight[(rec["provider_id"], rec["model"])][0] += 1
                inflight[(rec["provider_id"], rec["model"])][1] += rec["tokens"]
                if k in reserved_at and k not in completions:
                    continue  # still in flight at the end of the recorded journal: same here
                done = _moved_completion(rec, completions.get(k), reserved_at.get(k), requests.get(k), rates)
                seq += 1
                heapq.heappush(pending, (done["completed_at_ms"], seq, done, rec))
        offset += 1

    patch = {"config_id": "what-if", "settings": dict(settings), "author": "what-if"}
    if entries:
        apply("ConfigChange", dict(patch, changed_at_ms=_time(entries[0])), _time(entries[0]))
    for e in entries:
        t = _time(e)
        while pending and pending[0][0] <= t:
            at, _, done, rec = heapq.heappop(pending)
            advance(at)
            inflight[(rec["provider_id"], rec["model"])][0] -= 1
            inflight[(rec["provider_id"], rec["model"])][1] -= rec["tokens"]
            apply("Completion", done, at)
        advance(t)
        if e.type == "Completion":
            if e.record.get("status") == "cancelled":  # a cancel of a queued request still applies
                apply("Completion", dict(e.record, event_id=f"whatif-{e.record.get('event_id')}"), t)
        elif e.type == "Heartbeat":
            apply("Heartbeat", _corrected(e.record, inflight), t)
        else:
            apply(e.type, e.record, t)
            if e.type == "ConfigChange":  # keep the what-if settings in force
                apply("ConfigChange", dict(patch, changed_at_ms=t), t)
        if progress:
            progress.update(1)
    return WhatIf(recorded, run, dict(settings), len(entries), dict(advertised))


def _moved_completion(res: dict, done: dict | None, rec_res: dict | None, request: dict | None,
                      rates: dict) -> dict:
    """The what-if completion of a reservation: the recorded one moved and rescaled, or synthetic."""
    decode_q, prefill_q = rates.get(res["provider_id"], (1.0, 12.0))
    base = {"event_id": f"whatif-{res['request_id']}-{res['attempt']}", "request_id": res["request_id"],
            "attempt": res["attempt"], "provider_id": res["provider_id"], "model": res["model"]}
    if done is not None and rec_res is not None:
        decode_p, prefill_p = rates.get(rec_res["provider_id"], (decode_q, prefill_q))
        duration = max(0, done["completed_at_ms"] - rec_res["reserved_at_ms"]) * (decode_p / decode_q)
        ttft = (done.get("ttft_ms") or 0.0) * (prefill_p / prefill_q)
        return dict(base, status=done.get("status") or "ok", prompt_tokens=done.get("prompt_tokens", 0),
                    completion_tokens=done.get("completion_tokens", 0), ttft_ms=ttft,
                    completed_at_ms=res["reserved_at_ms"] + int(duration))
    prompt = max(0, (request or {}).get("prompt_tokens") or 0)
    max_tokens = (request or {}).get("max_tokens") or 256
    ttft = prompt / prefill_q * 1000
    duration = ttft + max_tokens / decode_q * 1000
    return dict(base, status="ok", prompt_tokens=prompt, completion_tokens=max_tokens, ttft_ms=ttft,
                completed_at_ms=res["reserved_at_ms"] + int(duration))


def _corrected(hb: dict, inflight: dict) -> dict:
    bc = hb.get("backend_capacity")
    if not bc or not bc.get("slots"):
        return hb
    pid = hb.get("provider_id")
    slots = []
    for s in bc["slots"]:
        n, tokens = inflight.get((pid, s.get("model")), (0, 0))
        if n or tokens:
            s = dict(s, num_running=max(0, (s.get("num_running") or 0) + n),
                     active_token_budget_used=max(0, (s.get("active_token_budget_used") or 0) + tokens)
                     if (s.get("active_token_budget_max") or 0) > 0 else s.get("active_token_budget_used", 0))
        slots.append(s)
    return dict(hb, backend_capacity=dict(bc, slots=slots))
