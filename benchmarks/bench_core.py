"""Core benchmark: µs per decide+release and per heartbeat apply, at the fleet shapes of the issue,
next to a same-run baseline (a bare Python loop touching each candidate once).

    .venv/bin/python benchmarks/bench_core.py [--quick] [--no-scalar] [--profile SHAPE]

Columns:
- decide+release: one RouteRequest (fast path) and the Completion that releases it, steady state
  (every model decided once before timing; that first decision builds the model's candidate index,
  reported as "index build ms" for all models together);
- scalar: the same with `Router(fast=False)` (the reference scan `explain` uses), fewer reps;
- heartbeat: one sequenced heartbeat apply whose load differs from the provider's last report,
  with the rebuild of its rows (marked stale by the heartbeat, rebuilt when their index is next
  read: every index is read at the end of the timed loop, each provider beats once in it);
  "hb same": the report repeated (rows kept);
- hb+decide: a heartbeat to a provider of the model, then decide+release (ring medians move, so
  the index refreshes ring-dependent columns first);
- feed ms: one capacity feed (`Router.capacity` for every model, from the candidate indexes),
  next to "loop ms", the same feed by the scalar loop (`Router._capacity_scan`), its baseline;
- peak MiB: tracemalloc peak while registering the fleet and building the indexes.
Times are CPU time of this process (`time.process_time`): "µs on one core", and much less
sensitive to other tenants of the machine than wall time. A full garbage collection runs before
each timed section (not inside it), so a collection of an
earlier shape's garbage does not land in a later shape's figures.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fleet import fleet_events, heartbeat, model_names, request  # noqa: E402
from streams.router import Router  # noqa: E402

SHAPES = [(350, 2, 2), (1260, 15, 2), (1260, 15, 15), (10_000, 15, 2)]
T_NOW = 10_000


def build(n, models, per_box, fast=True):
    r = Router(fast=fast)
    for off, (name, rec) in enumerate(fleet_events(n, models, per_box)):
        r.apply(off, None, name, rec)
    return r


class Driver:
    """Feeds requests, completions and heartbeats with fresh ids and increasing offsets."""

    def __init__(self, r: Router, n: int, models: int):
        self.r, self.n, self.names = r, n, model_names(models)
        self.off = 10**6
        self.seq = 0
        self.hb_seq: dict[str, int] = {}

    def decide_release(self, model: str) -> None:
        r = self.r
        self.seq += 1
        rid = f"r{self.seq}"
        self.off += 1
        out = r.apply(self.off, T_NOW, "RouteRequest", request(rid, model, T_NOW))
        for kind, rec in out:
            if kind == "Reservation":
                self.off += 1
                r.apply(self.off, T_NOW, "Completion", {
                    "event_id": f"c{self.seq}", "request_id": rid, "attempt": 0,
                    "provider_id": rec["provider_id"], "model": model, "status": "ok", "prompt_tokens": 1200,
                    "completion_tokens": 100, "ttft_ms": 0.0, "completed_at_ms": T_NOW})
                break

    def beat(self, j: int, change: bool = True) -> None:
        """Provider j's next heartbeat: its load moves (change) or it repeats the last report."""
        pid = f"p{j:05d}"
        mine = sorted(self.r.providers[pid].models)
        seq = self.hb_seq[pid] = self.hb_seq.get(pid, 1) + 1
        self.off += 1
        shift = seq if change else seq - 1
        self.r.apply(self.off, T_NOW, "Heartbeat", heartbeat(pid, j, mine, seq, T_NOW, shift))


def peak_memory(n, models, per_box) -> float:
    """tracemalloc peak (bytes) while registering the fleet and building every model's index.
    Measured on its own router: stopping tracemalloc frees its large trace tables, and the
    allocator work that follows would otherwise land in the timings."""
    tracemalloc.start()
    r = build(n, models, per_box)
    d = Driver(r, n, models)
    for model in d.names:
        d.decide_release(model)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del r, d
    gc.collect()
    return peak


def bench(n, models, per_box, reps, scalar_reps):
    r = build(n, models, per_box)
    d = Driver(r, n, models)
    t0 = time.process_time()
    for model in d.names:  # the first decision per model builds its candidate index
        d.decide_release(model)
    index_ms = (time.process_time() - t0) * 1e3
    names = d.names
    for i in range(50):  # untimed warm-up
        d.decide_release(names[i % models])
    gc.collect()
    # baseline: touch every candidate of the model once (dict lookup + one float op)
    ids = r.by_model[names[0]]
    t0 = time.process_time()
    for _ in range(reps):
        acc = 0.0
        for pid in ids:
            acc += r.providers[pid].decode_tps * 1.0001
    base = (time.process_time() - t0) / reps * 1e6
    # decide + release (fast path)
    t0 = time.process_time()
    for i in range(reps):
        d.decide_release(names[i % models])
    decide = (time.process_time() - t0) / reps * 1e6
    # heartbeat apply: load changes, then the same report repeated
    gc.collect()
    hb_reps = min(reps * 2, n)
    t0 = time.process_time()
    for i in range(hb_reps):
        d.beat(i % n)
    for model in names:
        r.fast.index(model)
    hb = (time.process_time() - t0) / hb_reps * 1e6
    gc.collect()
    t0 = time.process_time()
    for i in range(hb_reps):
        d.beat(i % n, change=False)
    for model in names:
        r.fast.index(model)
    hb_same = (time.process_time() - t0) / hb_reps * 1e6
    # heartbeat + decide + release, interleaved
    gc.collect()
    t0 = time.process_time()
    for i in range(reps):
        d.beat((i * 7919) % n)
        d.decide_release(names[i % models])
    mixed = (time.process_time() - t0) / reps * 1e6
    # the capacity feed: from the indexes, then by the scalar loop (same figures: tests/core)
    feeds = []
    for feed in (r.capacity, r._capacity_scan):
        feed(names[0])  # untimed: the first call refreshes the index
        gc.collect()
        t0 = time.process_time()
        for _ in range(3):
            for model in r.models():
                feed(model)
        feeds.append((time.process_time() - t0) / 3 * 1e3)
    served = r.fast.stats["scans"]
    ids = list(ids)
    # scalar reference
    scalar = float("nan")
    if scalar_reps:
        del r, d
        rs = build(n, models, per_box, fast=False)
        ds = Driver(rs, n, models)
        for i in range(models + 5):
            ds.decide_release(names[i % models])
        gc.collect()
        t0 = time.process_time()
        for i in range(scalar_reps):
            ds.decide_release(names[i % models])
        scalar = (time.process_time() - t0) / scalar_reps * 1e6
        del rs, ds
    gc.collect()
    peak = peak_memory(n, models, per_box)
    return dict(shape=f"{n}x{models} ({per_box}/box)", candidates=len(ids), decide_us=decide,
                scalar_us=scalar, heartbeat_us=hb, heartbeat_same_us=hb_same, mixed_us=mixed, baseline_loop_us=base,
                feed_ms=feeds[0], feed_loop_ms=feeds[1],
                ratio=decide / base, peak_mb=peak / 2**20, index_ms=index_ms, fast_scans=served)


def profile(n, models, per_box, reps):
    r = build(n, models, per_box)
    d = Driver(r, n, models)
    for model in d.names:
        d.decide_release(model)
    gc.collect()
    pr = cProfile.Profile()
    pr.enable()
    for i in range(reps):
        d.decide_release(d.names[i % models])
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-scalar", action="store_true", help="skip the scalar-path column")
    ap.add_argument("--profile", metavar="N,MODELS,PER_BOX", help="cProfile decide+release at one shape")
    args = ap.parse_args()
    reps = 200 if args.quick else 1000
    if args.profile:
        profile(*(int(x) for x in args.profile.split(",")), reps)
        return
    scalar_reps = 0 if args.no_scalar else (20 if args.quick else 50)
    print(f"{'shape':<20}{'cands':>6}{'decide+rel µs':>14}{'scalar µs':>11}{'heartbeat µs':>13}"
          f"{'hb same µs':>11}{'hb+decide µs':>13}{'bare loop µs':>13}{'ratio':>7}{'feed ms':>8}{'loop ms':>8}"
          f"{'peak MiB':>9}{'index build ms':>15}")
    for n, m, per in SHAPES:
        row = bench(n, m, per, reps, scalar_reps)
        print(f"{row['shape']:<20}{row['candidates']:>6}{row['decide_us']:>14.1f}{row['scalar_us']:>11.0f}"
              f"{row['heartbeat_us']:>13.1f}{row['heartbeat_same_us']:>11.1f}{row['mixed_us']:>13.1f}"
              f"{row['baseline_loop_us']:>13.1f}{row['ratio']:>7.1f}{row['feed_ms']:>8.2f}{row['feed_loop_ms']:>8.1f}"
              f"{row['peak_mb']:>9.1f}{row['index_ms']:>15.0f}")


if __name__ == "__main__":
    main()
