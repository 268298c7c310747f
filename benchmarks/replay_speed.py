"""Replay speed: journal entries per second through the routing core, next to a bare fastavro
decode of the same journal in the same run (an Avro object container file, as `replay export
--avro` writes).

    .venv/bin/python -m benchmarks.replay_speed [--hours 2] [--providers 1260] [--rate 46]

Generates the journal with the simulator (offline, deterministic), converts it to an Avro
container once, then times (a) fastavro reading every entry and (b) reading + Router.apply as the
command line does it (`JournalStream`: the file is decoded in a child process, on the other core).
The goal is a one-day journal (≈ 12 M entries) in under 15 minutes; the day figure is extrapolated
from the measured rate.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from fastavro import reader, writer

from replay.run import batch_gc, replay as run_journal
from replay.sources import AVRO_READ as READ, JournalStream, avro_entries, container_schema
from streams.jsonl import read_journal

DAY_ENTRIES = 12_000_000


def to_avro(jsonl: Path, out: Path) -> None:
    schema = container_schema()  # as `python -m replay export --avro` writes
    rows = ({"journal_offset": e.journal_offset, "journal_time_ms": e.journal_time_ms,
             "event": (f"switchyard.{e.type}", e.record)} for e in read_journal(jsonl))
    with out.open("wb") as fp:
        writer(fp, schema, rows)  # streamed: a day's journal does not fit in memory as dicts


def bare_decode(path: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    with path.open("rb") as fp:
        n = sum(1 for _ in reader(fp, **READ))
    return n, time.perf_counter() - t0


def same_entries(avro: Path, jsonl: Path) -> bool:
    """The container decodes to exactly the JSON Lines journal (else the timing replays another one)."""
    return all(a == e for a, e in zip(avro_entries(str(avro)), read_journal(jsonl), strict=True))


def replay(path: Path) -> tuple[int, float, Counter]:
    """Read + `Router.apply`, as `python -m replay run --journal FILE.avro` does (without writing)."""
    outcomes: Counter = Counter()
    t0 = time.perf_counter()
    n = 0
    for _, outputs in run_journal(JournalStream(str(path))):
        for kind, out in outputs:
            if kind == "RouteDecision":
                outcomes[out["reason"] or out["outcome"]] += 1
        n += 1
    return n, time.perf_counter() - t0, outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=2.0,
                    help="simulated hours of journal (default %(default)s: long enough that start-up "
                         "costs do not skew the day figure)")
    ap.add_argument("--providers", type=int, default=1260)
    ap.add_argument("--rate", type=float, default=46.0, help="requests per second")
    ap.add_argument("--workdir", default="out/bench/replay")
    args = ap.parse_args()
    batch_gc()  # as `python -m replay` does
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / f"journal-{args.providers}p-{args.hours}h.jsonl"
    if not jsonl.exists():
        subprocess.run([sys.executable, "-m", "streams.sim", "offline", "--preset", "default",
                        "--providers", str(args.providers), "--rate", str(args.rate),
                        "--duration", str(int(args.hours * 3600)), "--seed", "1", "--out", str(jsonl)],
                       check=True)
    avro = jsonl.with_suffix(".avro")
    if not avro.exists():
        to_avro(jsonl, avro)
    if not same_entries(avro, jsonl):
        sys.exit(f"{avro} does not decode to {jsonl}")
    n, bare = bare_decode(avro)
    _, core, outcomes = replay(avro)
    result = {"entries": n, "bare_decode_per_s": n / bare, "replay_per_s": n / core,
              "ratio": (n / core) / (n / bare), "day_minutes_extrapolated": DAY_ENTRIES / (n / core) / 60,
              "providers": args.providers, "rate": args.rate, "hours": args.hours,
              "decisions": dict(outcomes.most_common())}
    print(f"{n} entries: bare fastavro decode {result['bare_decode_per_s']:,.0f}/s, "
          f"replay {result['replay_per_s']:,.0f}/s ({result['ratio']:.2f}× the bare decode rate); "
          f"a {DAY_ENTRIES / 1e6:.0f} M-entry day would take {result['day_minutes_extrapolated']:.0f} min")
    print("decisions by outcome or reason:", dict(outcomes.most_common()))
    (work / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
