"""Core benchmark: µs per decide+release and per heartbeat apply, at the fleet shapes of the issue,
next to a same-run baseline (a bare Python loop touching each candidate once).

    .venv/bin/python benchmarks/bench_core.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fleet import fleet_events, heartbeat, model_names, request  # noqa: E402
from streams.router import Router  # noqa: E402

SHAPES = [(350, 2, 2), (1260, 15, 2), (1260, 15, 15), (10_000, 15, 2)]


def build(n, models, per_box):
    r = Router()
    for off, (name, rec) in enumerate(fleet_events(n, models, per_box)):
        r.apply(off, None, name, rec)
    return r


def bench(n, models, per_box, reps):
    tracemalloc.start()
    r = build(n, models, per_box)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    names = model_names(models)
    off = 10**6
    t_now = 10_000
    # baseline: touch every candidate of the model once (dict lookup + one float op)
    ids = r.by_model[names[0]]
    t0 = time.perf_counter()
    for _ in range(reps):
        acc = 0.0
        for pid in ids:
            acc += r.providers[pid].decode_tps * 1.0001
    base = (time.perf_counter() - t0) / reps * 1e6
    # decide + release
    t0 = time.perf_counter()
    for i in range(reps):
        model = names[i % models]
        off += 1
        out = r.apply(off, t_now, "RouteRequest", request(f"r{i}", model, t_now))
        res = [rec for kind, rec in out if kind == "Reservation"]
        if res:
            off += 1
            r.apply(off, t_now, "Completion", {
                "event_id": f"c{i}", "request_id": f"r{i}", "attempt": 0, "provider_id": res[0]["provider_id"],
                "model": model, "status": "ok", "prompt_tokens": 1200, "completion_tokens": 100,
                "ttft_ms": 0.0, "completed_at_ms": t_now})
    decide = (time.perf_counter() - t0) / reps * 1e6
    # heartbeat apply
    hb_reps = min(reps * 2, n)
    t0 = time.perf_counter()
    for i in range(hb_reps):
        j = i % n
        pid = f"p{j:05d}"
        mine = sorted(r.providers[pid].models)
        off += 1
        r.apply(off, t_now, "Heartbeat", heartbeat(pid, j, mine, 2 + i // n, t_now))
    hb = (time.perf_counter() - t0) / hb_reps * 1e6
    cands = len(ids)
    return dict(shape=f"{n}x{models} ({per_box}/box)", candidates=cands, decide_us=decide,
                heartbeat_us=hb, baseline_loop_us=base, ratio=decide / base, peak_mb=peak / 2**20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 200 if args.quick else 1000
    print(f"{'shape':<24}{'cands/model':>12}{'decide+release µs':>19}{'heartbeat µs':>14}"
          f"{'bare loop µs':>14}{'ratio':>8}{'peak MiB':>10}")
    for n, m, per in SHAPES:
        row = bench(n, m, per, reps)
        print(f"{row['shape']:<24}{row['candidates']:>12}{row['decide_us']:>19.1f}{row['heartbeat_us']:>14.1f}"
              f"{row['baseline_loop_us']:>14.1f}{row['ratio']:>8.1f}{row['peak_mb']:>10.1f}")


if __name__ == "__main__":
    main()
