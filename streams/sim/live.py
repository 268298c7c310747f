"""Live mode: the simulated fleet and gateway against a real Kafka broker and a real worker.

The fleet (`SimProvider`s from a preset) registers and heartbeats through `ProviderPublisher`; the
gateway (`GatewayClient`) publishes each arrival's RouteRequest, waits for its decision (and the
queue follow-up of a queued one), dispatches routed requests to the chosen provider and publishes
the Completion with the measured TTFT once the provider is done. Hostile and broken behaviours run
too (flapping machines disconnect and come back as new sessions, wedged ones go silent, ...).

Provider time runs `time_scale` times faster than wall time (default 20): a request that would
decode for 20 s on a real Mac takes 1 s here, so a few wall minutes carry real traffic. The scenario
(arrivals, rates, heartbeat interval) is in model time; arrivals are replayed `time_scale` times
faster, so `--rate` is in wall arrivals per second. TTFTs and decode rates are reported in model
time; decision latency, queue waits and the router's clock (journal time) are wall time.

`LiveRun` is the engine of `python -m streams.demo` and `python -m streams.sim live`: a one-screen
summary every 2 s (decisions per second, outcomes by reason, latency p50/p99, traffic spread, queue
depth) and a Markdown report plus a JSON twin at the end.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from ..client import GatewayClient, ProviderPublisher, make_producer
from .arrivals import Arrival, gateway_request
from .fleet import GATEWAY_TIMEOUT_S, Job, SimProvider
from .scenario import Scenario
from .stats import fmt, outcome_label, percentile, spread

SUMMARY_S = 2.0            # wall seconds between live summaries
SIM_TICK_S = 0.02          # wall seconds between simulation steps
MIN_HEARTBEAT_S = 1.0      # wall: never heartbeat faster than this


@dataclass
class LiveOptions:
    duration: float = 120.0          # wall seconds of arrivals
    time_scale: float = 20.0
    route_timeout: float = 10.0
    queue_timeout: float = 45.0
    drain: float = 45.0
    title: str = "Switchyard demo"


@dataclass
class Stats:
    sent: int = 0
    first: Counter = field(default_factory=Counter)        # first decisions by label
    second: Counter = field(default_factory=Counter)       # queue follow-ups by label
    lost: int = 0                                          # no first decision in time
    abandoned: int = 0                                     # still in flight when the run ended
    errors: Counter = field(default_factory=Counter)       # exceptions in the gateway, by type
    followup_lost: int = 0                                 # queued, no second decision in time
    latencies_ms: list = field(default_factory=list)       # publish → first decision
    queue_wait_ms: list = field(default_factory=list)      # queued → follow-up
    served: Counter = field(default_factory=Counter)       # machine → routed requests
    completed: Counter = field(default_factory=Counter)    # completion status → count
    ttft_ms: list = field(default_factory=list)            # measured, model time
    predicted_ratio: list = field(default_factory=list)    # measured / estimated TTFT
    decode_tps: list = field(default_factory=list)
    by_model: Counter = field(default_factory=Counter)
    window: deque = field(default_factory=deque)           # (wall time, latency ms) per decision

    def decision(self, latency_ms: float | None) -> None:
        self.window.append((time.monotonic(), latency_ms))

    def recent(self, seconds: float) -> list:
        cutoff = time.monotonic() - seconds
        while self.window and self.window[0][0] < cutoff - 60:
            self.window.popleft()
        return [x for x in self.window if x[0] >= cutoff]


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("switchyard_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def queue_depth(metrics: dict[str, float]) -> dict[str, int]:
    out = {}
    for name, v in metrics.items():
        m = re.match(r'switchyard_queue_depth\{model="([^"]*)"\}', name)
        if m:
            out[m.group(1)] = int(v)
    return out


class LiveRun:
    def __init__(self, scenario: Scenario, options: LiveOptions, bootstrap: str, prefix: str, worker):
        self.scn, self.args = scenario, options
        self.bootstrap, self.prefix, self.worker = bootstrap, prefix, worker
        self.specs = scenario.fleet()
        self.fleet = [SimProvider(s) for s in self.specs]
        self.by_pid: dict[str, SimProvider] = {p.pid: p for p in self.fleet}
        self.stats = Stats()
        self.scale = options.time_scale
        self.heartbeat_wall_s = max(MIN_HEARTBEAT_S, scenario.heartbeat_s / self.scale)
        self.t_start = time.monotonic()
        self.stop = asyncio.Event()        # no more arrivals
        self.abort = asyncio.Event()       # a second Ctrl-C: skip the drain
        self.interrupted = False
        self.inflight: set[asyncio.Task] = set()
        self.awaiting_first = 0
        self.awaiting_queue = 0
        self.serving = 0
        self.metrics: dict[str, float] = {}
        self.metrics_text = ""
        self.load_seconds = 0.0
        self.load_start: float | None = None
        self.tty = sys.stdout.isatty()
        self.pubs: dict[int, ProviderPublisher] = {}
        self.producer = None
        self.disconnects = 0
        self.reconnects = 0

    def model_now(self) -> float:
        return (time.monotonic() - self.t_start) * self.scale

    # --- signals --------------------------------------------------------------------------------
    def on_signal(self) -> None:
        if self.stop.is_set():
            self.abort.set()
        self.interrupted = True
        self.stop.set()

    # --- the fleet ------------------------------------------------------------------------------
    def _settle(self, jobs) -> None:
        for j in jobs:
            fut = j.tag
            if fut is not None and not fut.done():
                fut.set_result(j)

    async def simulate(self) -> None:
        while True:
            await asyncio.sleep(SIM_TICK_S)
            now = self.model_now()
            for p in self.fleet:
                if p.next_change_t <= now:
                    await self.lifecycle(p, now)
                self._settle(p.advance(now))

    async def lifecycle(self, p: SimProvider, now: float) -> None:
        old = p.pid
        what, jobs = p.change(now)
        self._settle(jobs)
        try:
            if what == "disconnect":
                self.disconnects += 1
                await self.pubs[id(p)].disconnect("connection closed")
            elif what == "reconnect":
                self.reconnects += 1
                pub = ProviderPublisher(self.bootstrap, p.pid, topic_prefix=self.prefix, producer=self.producer)
                self.pubs[id(p)] = pub
                self.by_pid[p.pid] = p
                await pub.register(p.registration(0, event_id=uuid.uuid4().hex))
                await self.beat(p)
        except Exception as e:  # noqa: BLE001 - survivable; say so
            print(f"lifecycle {what} of {old} failed: {e!r}", file=sys.stderr)

    async def beat(self, p: SimProvider) -> None:
        now = self.model_now()
        self._settle(p.advance(now))
        rec = p.heartbeat(now, 0, 0)
        for k in ("event_id", "provider_id", "seq", "sent_at_ms"):
            rec.pop(k)
        await self.pubs[id(p)].heartbeat(rec)

    async def heartbeats(self, p: SimProvider, offset: float) -> None:
        await asyncio.sleep(offset)
        while True:
            if p.online:
                try:
                    await self.beat(p)
                except Exception as e:  # noqa: BLE001 - a lost heartbeat is survivable; say so
                    print(f"heartbeat of {p.pid} failed: {e!r}", file=sys.stderr)
            await asyncio.sleep(self.heartbeat_wall_s)

    # --- the gateway ----------------------------------------------------------------------------
    async def arrivals(self, gw: GatewayClient) -> None:
        t0 = self.load_start = time.monotonic()
        for a in self.scn.arrivals():
            if self.stop.is_set():
                break
            at = a.t / self.scale
            if at >= self.args.duration:
                break
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, t0 + at - time.monotonic()))
                break
            except asyncio.TimeoutError:
                pass
            task = asyncio.create_task(self.request(gw, a))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
        else:  # the arrivals ran out before the duration: keep the clock honest
            rest = t0 + self.args.duration - time.monotonic()
            if rest > 0 and not self.stop.is_set():
                try:
                    await asyncio.wait_for(self.stop.wait(), timeout=rest)
                except asyncio.TimeoutError:
                    pass
        self.load_seconds = time.monotonic() - t0

    async def request(self, gw: GatewayClient, a: Arrival) -> None:
        st = self.stats
        st.sent += 1
        st.by_model[a.model] += 1
        try:
            await self._request(gw, st, a)
        except asyncio.CancelledError:
            st.abandoned += 1
            raise
        except Exception as e:  # noqa: BLE001 - count it and keep the run going
            if not st.errors:
                print(f"request {a.request_id} failed: {e!r}", file=sys.stderr)
            st.errors[type(e).__name__] += 1

    async def _request(self, gw: GatewayClient, st: Stats, a: Arrival) -> None:
        scn = self.scn
        req = gateway_request(a, 0, hard_ttft=scn.hard_ttft, min_decode_tps=scn.min_decode_tps,
                              deadline_base_ms=scn.deadline_base_ms)
        req["reply_to"] = ""  # the client fills reply_to and sent_at_ms
        self.awaiting_first += 1
        t0 = time.perf_counter()
        try:
            d = await gw.route(req, timeout=self.args.route_timeout)
        except asyncio.TimeoutError:
            st.lost += 1
            return
        finally:
            self.awaiting_first -= 1
        latency = (time.perf_counter() - t0) * 1000
        st.latencies_ms.append(latency)
        st.decision(latency)
        st.first[outcome_label(d)] += 1
        if d["outcome"] == "queued":
            self.awaiting_queue += 1
            tq = time.perf_counter()
            try:
                d = await gw.follow_up(a.request_id, d["attempt"], timeout=self.args.queue_timeout)
            except asyncio.TimeoutError:
                st.followup_lost += 1
                return
            finally:
                self.awaiting_queue -= 1
            st.queue_wait_ms.append((time.perf_counter() - tq) * 1000)
            st.decision(None)
            st.second[outcome_label(d)] += 1
        if d["outcome"] != "routed":
            return
        provider = self.by_pid.get(d["provider_id"])
        if provider is None:  # routed somewhere this run does not simulate: release it
            st.served[d["provider_id"]] += 1
            await gw.complete({"request_id": a.request_id, "attempt": d["attempt"],
                               "provider_id": d["provider_id"], "model": a.model, "status": "error"})
            return
        st.served[provider.machine] += 1
        fut = asyncio.get_running_loop().create_future()
        job = Job(a.request_id, d["attempt"], a.model, a.prompt, a.max_tokens, a.out_tokens, a.affinity_key,
                  d["estimated_ttft_ms"], tag=fut)
        self.serving += 1
        try:
            now = self.model_now()
            self._settle(provider.advance(now))
            provider.reserve(job, now)
            done: Job = await asyncio.wait_for(fut, timeout=(GATEWAY_TIMEOUT_S * 4 / self.scale) + 60)
        except asyncio.TimeoutError:
            done = job
            job.status = "error"
        finally:
            self.serving -= 1
        status = "error" if done.status == "lost" else done.status
        st.completed[done.status] += 1
        ttft = 0.0
        if done.status == "ok":
            ttft = provider.measured_ttft_ms(done)
            st.ttft_ms.append(ttft)
            st.decode_tps.append(done.decode_tps)
            if d["estimated_ttft_ms"] > 0:
                st.predicted_ratio.append(ttft / d["estimated_ttft_ms"])
        await gw.complete({"request_id": a.request_id, "attempt": d["attempt"], "provider_id": done.provider_id,
                           "model": a.model, "status": status, "prompt_tokens": a.prompt,
                           "completion_tokens": done.out_tokens if status == "ok" else 0, "ttft_ms": ttft})

    # --- the screen -----------------------------------------------------------------------------
    async def refresh_metrics(self) -> None:
        try:
            self.metrics_text = await asyncio.to_thread(self.worker.metrics)
            self.metrics = parse_metrics(self.metrics_text)
        except Exception:  # noqa: BLE001 - the summary shows the last good figures
            pass

    def elapsed(self) -> float:
        return time.monotonic() - self.load_start if self.load_start is not None else 0.0

    def summary(self, final: bool = False) -> str:
        st, a, scn = self.stats, self.args, self.scn
        elapsed = self.elapsed()
        if final:
            window = self.load_seconds or elapsed or 1.0
            rate = (sum(st.first.values()) + sum(st.second.values())) / window
            lat, span = st.latencies_ms, "all"
        else:
            recent = st.recent(SUMMARY_S)
            rate = len(recent) / SUMMARY_S
            lat, span = [x[1] for x in recent if x[1] is not None], f"last {SUMMARY_S:g}s"
        sp = spread(st.served, self.specs)
        outcomes = Counter(st.first)
        outcomes.update({f"queue→{k}": v for k, v in st.second.items()})
        qd = queue_depth(self.metrics)
        lines = [
            f"{a.title}  {elapsed:5.0f}s / {a.duration:.0f}s   preset {scn.preset.name}   "
            f"arrivals {scn.rate * self.scale:g}/s   {len(self.fleet)} providers   provider time ×{self.scale:g}",
            f"decisions/s   {rate:6.1f}{' (mean)' if final else ''}   sent {st.sent}   decided {sum(st.first.values())}   "
            f"lost {st.lost}",
            "outcomes      " + ("  ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "-"),
            f"latency       {span} p50 {percentile(lat, 50):6.1f} ms  p99 {percentile(lat, 99):6.1f} ms"
            + ("" if final else f"   all p50 {percentile(st.latencies_ms, 50):6.1f} ms  "
                                f"p99 {percentile(st.latencies_ms, 99):6.1f} ms"),
            f"spread        top {sp['top_n']} providers (10%) {sp['top10_share']:.0%} of traffic   "
            f"served nothing {sp['served_nothing']}/{len(self.fleet)} "
            f"({sp['routable_served_nothing']} of {sp['routable']} hardware-trusted)",
            f"queue depth   router {sum(qd.values())} "
            f"({', '.join(f'{m} {v}' for m, v in sorted(qd.items())) or '-'})   "
            f"gateway waiting {self.awaiting_queue}   routing {self.awaiting_first}   serving {self.serving}",
            "completions   " + ("  ".join(f"{k} {v}" for k, v in sorted(st.completed.items())) or "-")
            + f"   TTFT p50 {fmt(percentile(st.ttft_ms, 50), 0)} ms p99 {fmt(percentile(st.ttft_ms, 99), 0)} ms "
              f"(model time)",
        ]
        if self.stop.is_set() and not final:
            lines.append("stopping: waiting for in-flight requests" +
                         (" (Ctrl-C again to skip)" if self.interrupted else ""))
        return "\n".join(lines)

    def one_line(self) -> str:
        st = self.stats
        recent = st.recent(SUMMARY_S)
        lat = [x[1] for x in recent if x[1] is not None]
        sp = spread(st.served, self.specs)
        outcomes = Counter(st.first)
        outcomes.update({f"queue→{k}": v for k, v in st.second.items()})
        return (f"[{self.elapsed():4.0f}s] {len(recent) / SUMMARY_S:5.1f} decisions/s | "
                + " ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
                + f" lost {st.lost} | latency p50 {percentile(lat, 50):.1f} p99 {percentile(lat, 99):.1f} ms"
                f" | top10% {sp['top10_share']:.0%}, idle {sp['served_nothing']}/{len(self.fleet)}"
                f" | queue {sum(queue_depth(self.metrics).values())}")

    async def screen(self) -> None:
        """Every 2 s: the summary redrawn in place on a terminal, else one appended line."""
        while True:
            await asyncio.sleep(SUMMARY_S)
            await self.refresh_metrics()
            if self.tty:
                sys.stdout.write("\x1b[H\x1b[2J" + self.summary() + "\n")
            else:
                sys.stdout.write(self.one_line() + "\n")
            sys.stdout.flush()

    # --- the whole run --------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal)
        background: list[asyncio.Task] = []
        self.producer = producer = make_producer(self.bootstrap)
        await producer.start()
        try:
            for p in self.fleet:
                self.pubs[id(p)] = ProviderPublisher(self.bootstrap, p.pid, topic_prefix=self.prefix,
                                                     producer=producer)
                await self.pubs[id(p)].register(p.registration(0, event_id=uuid.uuid4().hex))
            self.t_start = time.monotonic()
            background.append(asyncio.create_task(self.simulate()))
            for i, p in enumerate(self.fleet):
                offset = self.heartbeat_wall_s * ((i * 0.618034) % 1.0) * 0.5
                background.append(asyncio.create_task(self.heartbeats(p, offset)))
            await self.wait_online()
            async with GatewayClient(self.bootstrap, topic_prefix=self.prefix) as gw:
                background.append(asyncio.create_task(self.screen()))
                await self.arrivals(gw)
                self.stop.set()
                await self.drain()
                for task in list(self.inflight):
                    task.cancel()
                await asyncio.gather(*self.inflight, return_exceptions=True)
            await asyncio.sleep(0.5)  # let the last completions reach the journal
            await self.refresh_metrics()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            background.clear()
            for p in self.fleet:
                if p.online:
                    await self.pubs[id(p)].disconnect("run finished")
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await producer.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        sys.stdout.write(self.summary(final=True) + "\n")

    async def wait_online(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        want = len(self.fleet)
        while time.monotonic() < deadline and not self.stop.is_set():
            online = self.metrics.get("switchyard_providers_online", 0)
            if online >= want:
                return
            await asyncio.sleep(0.25)
            await self.refresh_metrics()
        if not self.stop.is_set():
            raise RuntimeError(f"providers not online after {timeout:.0f}s (worker log: {self.worker.log})")

    async def drain(self) -> None:
        """After the last arrival: let in-flight requests finish (queued ones included)."""
        limit = self.args.drain if not self.interrupted else min(self.args.drain, 10.0)
        deadline = time.monotonic() + limit
        while self.inflight and time.monotonic() < deadline and not self.abort.is_set():
            await asyncio.sleep(0.1)


# === the report ====================================================================================
def build_report(run: LiveRun, info: dict) -> tuple[str, dict]:
    st, a, scn = run.stats, run.args, run.scn
    sp = spread(st.served, run.specs)
    decided = sum(st.first.values())
    routed = st.first.get("routed", 0) + st.second.get("routed", 0)
    load_s = run.load_seconds or a.duration
    figures = {
        "run_id": info["run_id"], "preset": scn.preset.name, "sent": st.sent, "decided": decided, "lost": st.lost,
        "followups_missing": st.followup_lost, "abandoned": st.abandoned, "errors": dict(st.errors),
        "routed": routed, "first_decisions": dict(st.first),
        "queue_followups": dict(st.second), "completions": dict(st.completed),
        "decisions_per_s": (decided + sum(st.second.values())) / load_s if load_s else 0.0,
        "latency_ms": {q: percentile(st.latencies_ms, q) for q in (50, 90, 99)},
        "latency_max_ms": max(st.latencies_ms) if st.latencies_ms else float("nan"),
        "queue_wait_ms": {q: percentile(st.queue_wait_ms, q) for q in (50, 90, 99)},
        "ttft_ms": {q: percentile(st.ttft_ms, q) for q in (50, 90, 99)},
        "spread": sp, "served": {p.machine: st.served.get(p.machine, 0) for p in run.fleet},
        "interrupted": run.interrupted, "provider_refusals": sum(p.refused for p in run.fleet),
        "disconnects": run.disconnects, "reconnects": run.reconnects,
        "scenario": scn.describe(),
    }
    nan_free = json.loads(json.dumps(figures, default=str).replace("NaN", "null"))

    L = []
    L.append(f"# {a.title} report — run {info['run_id']}\n")
    L.append(f"{info['started']} · {'ended early by Ctrl-C · ' if run.interrupted else ''}"
             f"load for {load_s:.0f} s · preset **{scn.preset.name}**\n")
    L.append("A real Kafka broker and a real Switchyard worker (`faust -A app worker`) routed the requests of "
             "a simulated fleet (`streams.sim`). **Provider time is scaled ×{:g}**: a request that would run 20 s "
             "on a real Mac takes {:.1f} s here, so the run carries real traffic in little time. TTFTs and decode "
             "rates below are in model time (what a provider would measure); decision latency, queue "
             "waits and the router's clock are wall time.\n".format(run.scale, 20 / run.scale))
    L.append(f"Preset: {scn.preset.description}.\n")
    L.append("## Settings\n")
    L.append("| setting | value |\n|---|---|")
    tm = scn.traffic_model()
    for k, v in [("duration (s)", a.duration), ("arrival rate (req/s, wall)", round(scn.rate * run.scale, 3)),
                 ("providers", len(run.fleet)), ("seed", scn.seed), ("time scale", run.scale),
                 ("arrivals", f"trace {scn.trace}" if scn.trace else
                  "Poisson; prompts p50 ≈ 1k, p90 ≈ 10k, p99.9 ≈ 74k tokens (domain §6.3); "
                  f"{tm.followup_share:.0%} follow-up turns with cache-affinity keys"),
                 ("max_tokens", f"client 256–4,096, or the gateway default {tm.default_max_tokens:,} "
                                f"({tm.omitted_max_share:.0%}); generated lognormal, median 300"),
                 ("models", ", ".join(f"{m} {s:.0%}" for m, s in scn.preset.mix.items())),
                 ("decode slowdown", "solo / (1 + k·(batch − 1)), k per engine (legacy gemma 1.1, CBv2 0.27–0.39)"),
                 ("heartbeat", f"every {run.heartbeat_wall_s:g} s (wall)"),
                 ("broker", info["broker"]), ("topic prefix", f"`{run.prefix}`"), ("worker app id", info["app_id"]),
                 ("worker data dir", f"`{info['datadir']}`")]:
        L.append(f"| {k} | {v} |")
    for k, v in sorted(info["worker_settings"].items()):
        L.append(f"| worker `{k}` | `{v}` |")
    L.append("")

    L.append("## Outcomes\n")
    L.append(f"- Requests sent: **{st.sent}**; decided: **{decided}**; "
             f"**lost requests (no decision within {a.route_timeout:g} s): {st.lost}**")
    L.append(f"- Routed (first decision or from the queue): **{routed}**; decisions/s: "
             f"**{figures['decisions_per_s']:.1f}**")
    L.append(f"- Queued requests whose second decision did not come in time: {st.followup_lost}; "
             f"requests still in flight when the run ended: {st.abandoned}; gateway errors: "
             f"{dict(st.errors) or 0}")
    L.append(f"- Completions published: {dict(st.completed) or '-'}; requests a provider refused: "
             f"{figures['provider_refusals']}; provider disconnects {run.disconnects}, reconnects {run.reconnects}\n")
    L.append("| first decision | count |\n|---|---|")
    for k, v in sorted(st.first.items()):
        L.append(f"| {k} | {v} |")
    if st.second:
        L.append("\n| queued request's second decision | count |\n|---|---|")
        for k, v in sorted(st.second.items()):
            L.append(f"| {k} | {v} |")
    L.append("")

    L.append("## Latency\n")
    L.append("| measure | p50 | p90 | p99 |\n|---|---|---|---|")
    for name, values in [("decision latency, ms (request publish → decision received)", st.latencies_ms),
                         ("queue wait, ms (queued → second decision)", st.queue_wait_ms),
                         ("TTFT measured, ms (model time)", st.ttft_ms),
                         ("TTFT measured / estimated", st.predicted_ratio),
                         ("per-request decode, tok/s (model time)", st.decode_tps)]:
        L.append(f"| {name} | " + " | ".join(fmt(percentile(values, q)) for q in (50, 90, 99)) + " |")
    L.append("")

    L.append("## Traffic spread\n")
    L.append(f"- Top 10 % of providers ({sp['top_n']}) took **{sp['top10_share']:.0%}** of routed requests")
    L.append(f"- Providers that served nothing: **{sp['served_nothing']} of {len(run.fleet)}** "
             f"({sp['routable_served_nothing']} of the {sp['routable']} hardware-trusted; self-signed boxes are "
             f"below the default trust floor)\n")

    L.append("## Fleet\n")
    L.append("| provider | group | chip | GB | version | trust | behaviour | models | solo decode tok/s | "
             "prefill tok/s | engine batch | KV budget (tokens) | served | observed decode EWMA |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in run.fleet:
        slots = list(p.slots.values())
        s = p.spec
        L.append("| {} | {} | {} | {:g} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            p.machine, s.group, s.chip.name.replace("Apple ", ""), s.memory_gb, s.version, s.trust, s.behaviour,
            ", ".join(x.model for x in slots), " / ".join(f"{x.solo:.0f}" for x in slots),
            " / ".join(f"{x.prefill:,.0f}" for x in slots), " / ".join(str(x.engine_batch) for x in slots),
            " / ".join(f"{int((p.kv_bytes if p.shared_pool else x.grant_bytes) // x.kv_rate):,}"
                       + (" shared" if p.shared_pool and len(slots) > 1 else "") for x in slots),
            st.served.get(p.machine, 0), " / ".join(f"{x.decode_ewma:.1f}" for x in slots)))
    L.append("")

    L.append("## Worker /metrics at the end (switchyard_*, histogram buckets omitted)\n")
    L.append("```")
    lines = [ln for ln in run.metrics_text.splitlines()
             if ln.startswith("switchyard_") and "_bucket{" not in ln and "_created" not in ln]
    L.extend(lines or ["(not available)"])
    L.append("```\n")
    L.append(f"Worker log: `{info['worker_log']}`\n")
    return "\n".join(L), nan_free


def write_report(run: LiveRun, info: dict, path: Path) -> Path:
    text, figures = build_report(run, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


# === running it with a broker and a worker =========================================================
def main_live(scenario: Scenario, options: LiveOptions, report: str, workdir: str, label: str = "demo") -> int:
    """Start a LocalKafka (unless $KAFKA_BOOTSTRAP_SERVERS is set) and a worker with the scenario's
    settings, run the fleet and gateway, write the report. Returns the exit code."""
    from ..broker import LocalKafka
    from ..worker_process import Worker

    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    tag = run_id.replace("-", "")
    prefix, app_id = f"{label}{tag}.", f"switchyard-{label}-{tag}"
    rundir = Path(workdir).resolve() / run_id
    settings = dict(scenario.settings)
    report_path = Path(report)
    info = {"run_id": run_id, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "app_id": app_id,
            "datadir": str(rundir / "worker"), "worker_log": str(rundir / "worker.log"),
            "worker_settings": settings}

    broker = worker = run = None
    code = 0
    try:
        external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if external:
            bootstrap = external
            info["broker"] = f"external, {external}"
        else:
            print("starting a local Kafka broker (first run fetches its jars with Maven) …", flush=True)
            broker = LocalKafka().start()
            bootstrap = broker.bootstrap
            info["broker"] = f"LocalKafka at {bootstrap}, ready in {broker.start_seconds:.1f} s"
        print(f"starting a worker (app {app_id}, log {info['worker_log']}) …", flush=True)
        t0 = time.monotonic()
        # the worker reads EIGENINFERENCE_* from its environment: pass the scenario's, and blank
        # out any other inherited one so the run's settings are exactly the scenario's
        env = {k: "" for k in os.environ if k.startswith("EIGENINFERENCE_")}
        env.update(settings)
        worker = Worker(bootstrap, rundir / "worker", app_id, prefix, env=env).start()
        info["app_id"] += f" (ready in {time.monotonic() - t0:.1f} s)"
        run = LiveRun(scenario, options, bootstrap, prefix, worker)
        print(f"preset {scenario.preset.name}: fleet of {len(run.fleet)} providers; "
              f"{scenario.rate * options.time_scale:g} req/s for {options.duration:g} s", flush=True)
        asyncio.run(run.run())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        if run is not None:
            run.interrupted = True
        code = 130 if run is None else 0
    except Exception as e:  # noqa: BLE001 - report what we have, then fail
        print(f"{label} failed: {e!r}", file=sys.stderr)
        code = 1
    finally:
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()
    if run is not None:
        write_report(run, info, report_path)
        print(f"report: {report_path}")
    return code
