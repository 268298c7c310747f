"""Offline mode: a closed-loop discrete-event simulation in simulated time, routed by the real core.

A heap of events (registrations and lifecycle changes, provider phase changes, heartbeats, ticks,
arrivals; at equal times in that order, domain §6.4) drives `SimProvider`s. Every INPUT event the
simulation produces is applied to an in-process `Router` exactly as the journal would apply it
(`journal_offset` = its index, `journal_time_ms` = simulated time) and written as one JSON Lines
line, so `python -m replay run --journal FILE` reproduces every decision. Routed requests are served
by the chosen provider, whose Completion (with the real TTFT) comes back as an input event; its
heartbeats report what it really does. Deterministic from the seed: `random.Random` streams only,
no wall clock in anything written.

`--with-decisions` also writes each RouteDecision after the entry that caused it (for
`python -m replay audit --journal FILE`).
"""
from __future__ import annotations

import gc
import heapq
import json
import random
import sys
import time
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import IO

from ..config import DEFAULT
from ..jsonl import write_record
from ..router import Router
from .arrivals import Arrival, gateway_request
from .fleet import INF, Job, SimProvider
from .scenario import Scenario
from .stats import fmt, outcome_label, percentile, spread

T0_MS = 1_788_393_600_000      # 2026-09-03 00:00 UTC: the simulated day starts here
WARMUP_S = 6.0                 # registrations and first heartbeats before the first arrival
REGISTRATION_SPREAD_S = 5.0
RETRYABLE = {"machine_busy", "queue_full", "queue_timeout", "no_provider", "ttft_too_slow", "expired"}

# event classes: order at equal times (domain §6.4: join, completion, heartbeat, arrival)
LIFE, WAKE, BEAT, TICK, ARRIVE = range(5)


class JournalWriter:
    """JSON Lines lines as `streams.jsonl.write_record` writes them. The fast path dumps records
    the simulation builds in schema field order with schema types (tests check the bytes equal
    write_record's); `strict=True` goes through write_record (validation included)."""

    def __init__(self, fp: IO[str] | None, strict: bool = False):
        self.fp = fp
        self.strict = strict
        self.lines = 0
        self._dumps = json.JSONEncoder().encode

    def entry(self, type_name: str, record: dict, offset: int, time_ms: int) -> None:
        if self.fp is None:
            return
        if self.strict:
            write_record(self.fp, type_name, record, journal_offset=offset, journal_time_ms=time_ms)
        else:
            obj = {"type": type_name, "journal_offset": offset, "journal_time_ms": time_ms}
            obj.update(record)
            self.fp.write(self._dumps(obj) + "\n")
        self.lines += 1

    def output(self, type_name: str, record: dict) -> None:
        if self.fp is None:
            return
        if self.strict:
            write_record(self.fp, type_name, record)
        else:
            obj = {"type": type_name}
            obj.update(record)
            self.fp.write(self._dumps(obj) + "\n")
        self.lines += 1


@dataclass
class InFlight:
    arrival: Arrival
    attempt: int
    sent: float                 # simulated seconds
    queued_at: float | None = None
    estimated_ttft_ms: float = 0.0


@dataclass
class Result:
    scenario: Scenario
    entries: Counter = field(default_factory=Counter)     # journal entries by type
    first: Counter = field(default_factory=Counter)       # first decision of an attempt, by label
    second: Counter = field(default_factory=Counter)      # queue follow-ups, by label
    completions: Counter = field(default_factory=Counter)
    sent: int = 0                                         # requests (attempt 0)
    attempts: int = 0
    retries: int = 0
    lost_on_disconnect: int = 0
    still_queued: int = 0
    in_flight_at_end: int = 0
    served: Counter = field(default_factory=Counter)      # machine -> routed requests
    served_by_group: Counter = field(default_factory=Counter)
    ttft_ms: array = field(default_factory=lambda: array("d"))
    ttft_ratio: array = field(default_factory=lambda: array("d"))
    ttft_by_group: dict = field(default_factory=lambda: defaultdict(lambda: array("d")))
    queue_wait_ms: array = field(default_factory=lambda: array("d"))
    decide_us: array = field(default_factory=lambda: array("d"))
    decode_by_model: dict = field(default_factory=lambda: defaultdict(lambda: array("d")))
    decode_by_group_model: dict = field(default_factory=lambda: defaultdict(lambda: array("d")))
    unfinished_by_group_model: dict = field(default_factory=lambda: defaultdict(lambda: array("d")))
    max_load: dict = field(default_factory=dict)          # (group, model) -> most requests at once on one box
    tripwires: Counter = field(default_factory=Counter)
    router_counters: Counter = field(default_factory=Counter)
    router_rejected: Counter = field(default_factory=Counter)
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    specs: list = field(default_factory=list)

    # --- derived ----------------------------------------------------------------------------
    @property
    def total_entries(self) -> int:
        return sum(self.entries.values())

    @property
    def decisions(self) -> int:
        return sum(self.first.values()) + sum(self.second.values())

    @property
    def routed(self) -> int:
        return self.first.get("routed", 0) + self.second.get("routed", 0)

    def decode_rates(self, model: str, group: str | None = None, unfinished: bool = True) -> list:
        """Per-request decode rates of the model's routed requests (optionally one group's): the
        completed ones, plus (by default) those still running at the end, at their rate so far
        (0 before their first token) — so a run that ends with a backlog of crawling requests does
        not look better than it is."""
        out = []
        for (g, m), xs in self.decode_by_group_model.items():
            if m == model and (group is None or g == group):
                out.extend(xs)
        if unfinished:
            for (g, m), xs in self.unfinished_by_group_model.items():
                if m == model and (group is None or g == group):
                    out.extend(xs)
        return out

    def below_floor_share(self, model: str, group: str | None = None, floor: float = 15.0,
                          unfinished: bool = True) -> float:
        xs = self.decode_rates(model, group, unfinished)
        if not xs:
            return float("nan")
        return sum(1 for x in xs if x < floor) / len(xs)

    def figures(self) -> dict:
        scn = self.scenario
        sp = spread(self.served, self.specs)
        floor = scn.min_decode_tps or 15.0
        models = sorted(self.decode_by_model)
        return {
            "scenario": scn.describe(),
            "entries": dict(self.entries), "total_entries": self.total_entries,
            "sim_seconds": round(self.sim_seconds, 3), "wall_seconds": round(self.wall_seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "entries_per_wall_s": round(self.total_entries / self.wall_seconds, 1) if self.wall_seconds else None,
            "entries_per_cpu_s": round(self.total_entries / self.cpu_seconds, 1) if self.cpu_seconds else None,
            "sent": self.sent, "attempts": self.attempts, "retries": self.retries,
            "decisions": self.decisions, "routed": self.routed,
            "decisions_per_sim_s": round(self.decisions / self.sim_seconds, 3) if self.sim_seconds else 0.0,
            "first_decisions": dict(sorted(self.first.items())), "queue_followups": dict(sorted(self.second.items())),
            "completions": dict(sorted(self.completions.items())),
            "lost_on_disconnect": self.lost_on_disconnect, "still_queued": self.still_queued,
            "in_flight_at_end": self.in_flight_at_end,
            "ttft_ms": {str(q): percentile(self.ttft_ms, q) for q in (50, 90, 99)},
            "ttft_measured_over_estimated": {str(q): percentile(self.ttft_ratio, q) for q in (50, 90)},
            "queue_wait_ms": {str(q): percentile(self.queue_wait_ms, q) for q in (50, 99)},
            "router_decide_us": {str(q): percentile(self.decide_us, q) for q in (50, 99)},
            "decode_tps": {m: {"p50": percentile(self.decode_rates(m), 50),
                               "below_floor_share": self.below_floor_share(m, floor=floor),
                               "n": len(self.decode_rates(m)), "completed": len(self.decode_by_model[m])}
                           for m in models},
            "decode_by_group": {f"{g}/{m}": {"p50": percentile(self.decode_rates(m, g), 50),
                                             "n": len(self.decode_rates(m, g)),
                                             "below_floor_share": self.below_floor_share(m, g, floor)}
                                for (g, m) in sorted(self.decode_by_group_model) if self.decode_rates(m, g)},
            "max_load": {f"{g}/{m}": v for (g, m), v in sorted(self.max_load.items())},
            "ttft_ms_by_group": {g: {str(q): percentile(xs, q) for q in (50, 90, 99)}
                                 for g, xs in sorted(self.ttft_by_group.items())},
            "served_by_group": dict(sorted(self.served_by_group.items())),
            "spread": sp, "tripwires": dict(self.tripwires),
            "router_counters": {k: v for k, v in sorted(self.router_counters.items())
                                if not k.startswith("decisions_")},
            "router_rejected_events": dict(self.router_rejected),
        }

    def summary(self) -> str:
        f = self.figures()
        scn = self.scenario
        sp = f["spread"]
        outcomes = Counter(self.first)
        outcomes.update({f"queue→{k}": v for k, v in self.second.items()})
        total_first = sum(self.first.values()) or 1
        lines = [
            f"Switchyard simulator — offline, preset {scn.preset.name}: {scn.providers} providers, "
            f"{scn.rate:g} req/s for {scn.duration_s:g} s (simulated), seed {scn.seed}"
            + (f", trace {scn.trace}" if scn.trace else ""),
            f"journal       {self.total_entries:,} entries in {self.wall_seconds:.1f} s wall, {self.cpu_seconds:.1f} s CPU "
            f"({f['entries_per_wall_s'] or 0:,.0f} entries/s wall, {f['entries_per_cpu_s'] or 0:,.0f}/s CPU): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(self.entries.items())),
            f"decisions     {self.decisions:,} ({f['decisions_per_sim_s']:.2f}/s simulated); requests {self.sent:,}, "
            f"attempts {self.attempts:,}; router decide p50 {fmt(f['router_decide_us']['50'], 0)} µs "
            f"p99 {fmt(f['router_decide_us']['99'], 0)} µs (wall)",
            "outcomes      " + "  ".join(f"{k} {v:,} ({v / total_first:.0%})" if not k.startswith("queue→")
                                         else f"{k} {v:,}" for k, v in sorted(outcomes.items())),
            "completions   " + ("  ".join(f"{k} {v:,}" for k, v in sorted(self.completions.items())) or "-")
            + f"   lost on disconnect {self.lost_on_disconnect}, still queued {self.still_queued}, "
              f"in flight at end {self.in_flight_at_end}",
            f"TTFT          p50 {fmt(f['ttft_ms']['50'], 0)} ms  p90 {fmt(f['ttft_ms']['90'], 0)} ms  "
            f"p99 {fmt(f['ttft_ms']['99'], 0)} ms (measured / estimated p50 "
            f"{fmt(f['ttft_measured_over_estimated']['50'], 2)})   queue wait p50 "
            f"{fmt(f['queue_wait_ms']['50'], 0)} ms p99 {fmt(f['queue_wait_ms']['99'], 0)} ms",
            "decode        " + "  ".join(f"{m} p50 {fmt(v['p50'])} tok/s, {v['below_floor_share']:.0%} < floor"
                                         for m, v in f["decode_tps"].items())
            + "  (per request; unfinished ones at their rate so far)",
            f"spread        top 10 % of machines ({sp['top_n']}) took {sp['top10_share']:.0%} of routed requests "
            f"(routable: {sp['routable_top10_share']:.0%}, Gini {sp['gini']:.2f}); served nothing "
            f"{sp['served_nothing']}/{sp['machines']} ({sp['routable_served_nothing']} of {sp['routable']} "
            f"hardware-trusted)",
        ]
        for g in scn.preset.watch:
            parts = [f"{m}: max {v} at once" for (gg, m), v in sorted(self.max_load.items()) if gg == g]
            for key, v in f["decode_by_group"].items():
                gg, _, m = key.partition("/")
                if gg == g:
                    parts.append(f"{m} decode p50 {v['p50']:.1f} tok/s ({v['below_floor_share']:.0%} < floor)")
            tt = f["ttft_ms_by_group"].get(g)
            if tt:
                parts.append(f"TTFT p50 {fmt(tt['50'], 0)} ms p90 {fmt(tt['90'], 0)} ms")
            lines.append(f"group {g:14s}" + ("; ".join(parts) or "-") + f"; served {self.served_by_group.get(g, 0):,}")
        if self.tripwires:
            lines.append("tripwires     " + "  ".join(f"{m} {v:,}" for m, v in sorted(self.tripwires.items())))
        if self.router_rejected:
            lines.append(f"REFUSED EVENTS {dict(self.router_rejected)}")
        return "\n".join(lines)


class OfflineSim:
    def __init__(self, scenario: Scenario, out: IO[str] | None = None, *, with_decisions: bool = False,
                 strict: bool = False, drain_s: float = 120.0, progress: IO[str] | None = None):
        self.scn = scenario
        self.writer = JournalWriter(out, strict)
        self.with_decisions = with_decisions and out is not None
        self.drain_s = drain_s
        self.progress = progress
        self.router = Router(DEFAULT)   # as `replay run` starts: defaults, then the journal's ConfigChange
        self.specs = scenario.fleet()
        self.providers = [SimProvider(s) for s in self.specs]
        self.by_pid: dict[str, SimProvider] = {p.pid: p for p in self.providers}
        self.heap: list = []
        self.seq = 0
        self.t = 0.0
        self.now_ms = T0_MS
        self.offset = 0
        self.inflight: dict[tuple[str, int], InFlight] = {}
        self.deferred: list[tuple[SimProvider, Job]] = []
        self.hb_seq: dict[str, int] = {}
        self.wake_at: dict[int, float] = {}
        self.res = Result(scenario=scenario, specs=self.specs)
        self.hard_ttft = scenario.hard_ttft
        self.min_decode = scenario.min_decode_tps
        self.deadline_base = scenario.deadline_base_ms
        self.arrivals = iter(())
        self.arrivals_done = False
        self.end_traffic = WARMUP_S + scenario.duration_s

    # --- the heap ---------------------------------------------------------------------------
    def push(self, t: float, cls: int, kind, obj) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, cls, self.seq, kind, obj))

    def schedule_wake(self, p: SimProvider) -> None:
        nt = p.next_t
        if nt < INF and self.wake_at.get(id(p)) != nt:
            self.wake_at[id(p)] = nt
            self.push(nt, WAKE, "wake", (p, nt))

    # --- journal entries --------------------------------------------------------------------
    def emit(self, type_name: str, record: dict) -> list:
        off = self.offset
        self.offset += 1
        self.writer.entry(type_name, record, off, self.now_ms)
        self.res.entries[type_name] += 1
        if type_name == "RouteRequest":
            c0 = time.perf_counter()
            outputs = self.router.apply(off, self.now_ms, type_name, record)
            self.res.decide_us.append((time.perf_counter() - c0) * 1e6)
        else:
            outputs = self.router.apply(off, self.now_ms, type_name, record)
        if outputs:
            self.handle(outputs)
        return outputs

    def handle(self, outputs: list) -> None:
        res = self.res
        for kind, rec in outputs:
            if kind == "RouteDecision":
                if self.with_decisions:
                    self.writer.output("RouteDecision", rec)
                self.on_decision(rec)
            elif kind == "Tripwire":
                res.tripwires[rec["model"]] += 1
            elif kind == "Rejected":
                res.router_rejected[rec["reason"]] += 1

    # --- decisions and the gateway ----------------------------------------------------------
    def on_decision(self, d: dict) -> None:
        key = (d["request_id"], d["attempt"])
        info = self.inflight.get(key)
        if info is None:
            return
        label = outcome_label(d)
        if info.queued_at is None:
            self.res.first[label] += 1
        else:
            self.res.second[label] += 1
            self.res.queue_wait_ms.append((self.t - info.queued_at) * 1000.0)
        outcome = d["outcome"]
        if outcome == "queued":
            info.queued_at = self.t
            return
        if outcome == "routed":
            p = self.by_pid.get(d["provider_id"])
            if p is None:
                return
            a = info.arrival
            info.estimated_ttft_ms = d["estimated_ttft_ms"]
            self.res.served[p.machine] += 1
            self.res.served_by_group[p.spec.group] += 1
            for j in p.advance(self.t):
                self.deferred.append((p, j))
            job = Job(a.request_id, info.attempt, a.model, a.prompt, a.max_tokens, a.out_tokens, a.affinity_key,
                      d["estimated_ttft_ms"], tag=info)
            p.reserve(job, self.t)
            self.schedule_wake(p)
            return
        del self.inflight[key]  # rejected
        reason = d["reason"]
        if self.scn.retries and info.attempt < self.scn.retries and reason in RETRYABLE:
            delay = float(d["retry_after_s"] or 2)
            self.res.retries += 1
            self.push(self.t + delay, ARRIVE, "retry", (info.arrival, info.attempt + 1))

    def send(self, a: Arrival, attempt: int) -> None:
        self.inflight[(a.request_id, attempt)] = InFlight(a, attempt, self.t)
        self.res.attempts += 1
        if attempt == 0:
            self.res.sent += 1
        self.emit("RouteRequest", gateway_request(a, self.now_ms, hard_ttft=self.hard_ttft,
                                                  min_decode_tps=self.min_decode,
                                                  deadline_base_ms=self.deadline_base, attempt=attempt))

    def complete(self, p: SimProvider, job: Job) -> None:
        info: InFlight = job.tag
        self.inflight.pop((job.request_id, job.attempt), None)
        res = self.res
        res.completions[job.status] += 1
        if job.status == "ok":
            ttft = p.measured_ttft_ms(job)
            res.ttft_ms.append(ttft)
            res.ttft_by_group[p.spec.group].append(ttft)
            if info.estimated_ttft_ms > 0:
                res.ttft_ratio.append(ttft / info.estimated_ttft_ms)
            dtps = job.decode_tps
            if dtps > 0:
                res.decode_by_model[job.model].append(dtps)
                res.decode_by_group_model[(p.spec.group, job.model)].append(dtps)
        self.emit("Completion", p.completion(job, self.now_ms))

    def run_deferred(self) -> None:
        while self.deferred:
            p, job = self.deferred.pop(0)
            self.complete(p, job)

    # --- providers ------------------------------------------------------------------------------
    def register(self, p: SimProvider) -> None:
        self.by_pid[p.pid] = p
        self.hb_seq[p.pid] = 0
        self.emit("ProviderRegistered", p.registration(self.now_ms, event_id=f"reg-{p.pid}"))
        self.beat(p)

    def beat(self, p: SimProvider) -> None:
        for j in p.advance(self.t):
            self.deferred.append((p, j))
        self.run_deferred()
        seq = self.hb_seq[p.pid] + 1
        self.hb_seq[p.pid] = seq
        self.emit("Heartbeat", p.heartbeat(self.t, seq, self.now_ms))
        self.schedule_wake(p)

    def lifecycle(self, p: SimProvider) -> None:
        old = p.pid
        what, jobs = p.change(self.t)
        if what in ("disconnect", "silent"):
            for j in jobs:
                self.inflight.pop((j.request_id, j.attempt), None)
            self.res.lost_on_disconnect += len(jobs)
            if what == "disconnect":
                self.emit("ProviderDisconnected", {"event_id": f"dc-{old}", "provider_id": old,
                                                   "at_ms": self.now_ms, "reason": "connection closed"})
        elif what == "reconnect":
            self.register(p)
        elif what == "crash":
            for j in jobs:
                self.deferred.append((p, j))
            self.run_deferred()
            self.schedule_wake(p)
        if p.next_change_t < INF:
            self.push(p.next_change_t, LIFE, "life", p)

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> Result:
        # Millions of short-lived records: collect young garbage less often (the state itself is
        # long-lived and acyclic); restored on the way out.
        thresholds = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(thresholds[0], 50_000), thresholds[1], thresholds[2])
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()

    def _run(self) -> Result:
        scn, res = self.scn, self.res
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        settings = dict(sorted(scn.settings.items()))
        self.emit("ConfigChange", {"config_id": "", "settings": settings, "changed_at_ms": self.now_ms,
                                   "author": f"streams.sim preset {scn.preset.name}"})
        rng = random.Random(f"phases-{scn.seed}")
        n = len(self.providers)
        for i, p in enumerate(self.providers):
            t_reg = REGISTRATION_SPREAD_S * i / max(1, n)
            self.push(t_reg, LIFE, "register", p)
            first_beat = t_reg + scn.heartbeat_s * rng.random()
            self.push(first_beat, BEAT, "beat", p)
            if p.next_change_t < INF:
                self.push(WARMUP_S + p.next_change_t, LIFE, "life", p)
                p.next_change_t += WARMUP_S
        if scn.tick_ms > 0:
            self.push(scn.tick_ms / 1000.0, TICK, "tick", None)
        self.arrivals = scn.arrivals()
        self._next_arrival()
        end = INF
        last_report = wall0
        heap = self.heap
        while heap:
            t, cls, _, kind, obj = heapq.heappop(heap)
            if t > end:
                break
            if t > self.t:
                self.t = t
                self.now_ms = T0_MS + int(t * 1000.0)
            if kind == "wake":
                p, at = obj
                if self.wake_at.get(id(p)) != at:
                    continue
                del self.wake_at[id(p)]
                for j in p.advance(t):
                    self.deferred.append((p, j))
                self.run_deferred()
                self.schedule_wake(p)
            elif kind == "beat":
                p = obj
                self.push(t + scn.heartbeat_s, BEAT, "beat", p)
                if p.online:
                    self.beat(p)
            elif kind == "arrive":
                self.send(obj, 0)
                self.run_deferred()
                self._next_arrival()
            elif kind == "retry":
                a, attempt = obj
                self.send(a, attempt)
                self.run_deferred()
            elif kind == "tick":
                self.emit("Tick", {"at_ms": self.now_ms})
                self.run_deferred()
                self.push(t + scn.tick_ms / 1000.0, TICK, "tick", None)
            elif kind == "register":
                self.register(obj)
            elif kind == "life":
                if obj.next_change_t <= t:
                    self.lifecycle(obj)
            if self.arrivals_done and end == INF and t >= self.end_traffic:
                end = self.end_traffic + self.drain_s
            if end < INF and not self.inflight and t >= self.end_traffic:
                break
            if self.progress is not None and self.offset % 100_000 == 0:
                now = time.perf_counter()
                if now - last_report > 10:
                    last_report = now
                    self.progress.write(f"  t={t:,.0f} s simulated, {self.offset:,} entries, "
                                        f"{self.offset / (now - wall0):,.0f} entries/s\n")
                    self.progress.flush()
        res.sim_seconds = self.t
        res.wall_seconds = time.perf_counter() - wall0
        res.cpu_seconds = time.process_time() - cpu0
        res.still_queued = sum(1 for i in self.inflight.values() if i.queued_at is not None)
        res.in_flight_at_end = len(self.inflight)
        for p in self.providers:
            for s in p._slot_list:
                key = (p.spec.group, s.model)
                res.max_load[key] = max(res.max_load.get(key, 0), s.max_load)
        for p in self.providers:
            for s in p._slot_list:
                for j in s.running + list(s.waiting):
                    rate = 0.0
                    if j.first_token is not None and self.t > j.first_token:
                        rate = (j.out_tokens - j.decode_left) / (self.t - j.first_token)
                    res.unfinished_by_group_model[(p.spec.group, j.model)].append(rate)
        res.tripwires = Counter(self.router.tripwires)
        res.router_counters = Counter(self.router.counters)
        return res

    def _next_arrival(self) -> None:
        a = next(self.arrivals, None)
        if a is None:
            self.arrivals_done = True
            return
        self.push(WARMUP_S + a.t, ARRIVE, "arrive", a)


def run(scenario: Scenario, out_path: str | None = None, *, with_decisions: bool = False, strict: bool = False,
        drain_s: float = 120.0, progress: IO[str] | None = None) -> Result:
    if out_path is None:
        return OfflineSim(scenario, None, drain_s=drain_s, progress=progress).run()
    with open(out_path, "w", buffering=1 << 20) as fp:
        return OfflineSim(scenario, fp, with_decisions=with_decisions, strict=strict, drain_s=drain_s,
                          progress=progress).run()


if __name__ == "__main__":  # pragma: no cover - use `python -m streams.sim offline`
    sys.exit("use: python -m streams.sim offline --help")
