"""Table writes per request: what saving the core's state costs the worker's table, by key kind.

    .venv/bin/python benchmarks/state_writes.py [--requests 40000] [--providers 1260] [--models 15]

Drives the pure core with the mix of the latency benchmark's 1000/s phase (a request, its
completion, a quarter of a heartbeat) and saves it as the worker does (`CoreStore.save_batch`,
one delta per ~25 entries, checkpoints every FLUSH_EVERY entries), into a dict that counts the
writes and deletions by key kind (each is a RocksDB write and a changelog message in the worker).
Reports them per request, with the CPU time of the saves next to that of the whole loop (its
baseline: the core's apply). No Kafka involved.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_core import Driver, build  # noqa: E402
from streams.core_store import CoreStore  # noqa: E402
from streams.persistence import SEP  # noqa: E402

ENTRIES_PER_SAVE = 25


def kind(k: str) -> str:
    return "delta" if k.startswith("d" + SEP) else k.split(SEP)[0]


class CountingTable(dict):
    def __init__(self):
        super().__init__()
        self.writes, self.deletes = Counter(), Counter()

    def __setitem__(self, k, v):
        self.writes[kind(k)] += 1
        super().__setitem__(k, v)

    def __delitem__(self, k):
        self.deletes[kind(k)] += 1
        super().__delitem__(k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--providers", type=int, default=1260)
    ap.add_argument("--models", type=int, default=15)
    args = ap.parse_args()

    router = build(args.providers, args.models, 2)
    driver = Driver(router, args.providers, args.models)
    for model in driver.names:
        driver.decide_release(model)
    router.take_dirty()
    table = CountingTable()
    store = CoreStore.of_json(table)
    rng = random.Random(1)
    start, beats, saving = driver.off, 0, 0.0
    first = start + 1
    started = time.process_time()
    for _ in range(args.requests):
        driver.decide_release(rng.choice(driver.names))
        if rng.random() < 0.25:
            driver.beat(beats % args.providers)
            beats += 1
        if driver.off - first + 1 >= ENTRIES_PER_SAVE:
            t = time.process_time()
            store.save_batch(router, first, driver.off, [], {})
            saving += time.process_time() - t
            first = driver.off + 1
    total = time.process_time() - started
    n = args.requests
    print(f"{n} requests, {driver.off - start} entries; CPU µs per request: saves {1e6 * saving / n:.1f}, "
          f"everything {1e6 * total / n:.1f}")
    for label, counts in (("writes", table.writes), ("deletes", table.deletes)):
        other = sum(v for k, v in counts.items() if k != "delta")
        print(f"{label} per request: checkpoint {other / n:.3f}, deltas {counts['delta'] / n:.3f}; by kind",
              {k: round(v / n, 3) for k, v in counts.most_common()})


if __name__ == "__main__":
    main()
