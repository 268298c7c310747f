"""`python -m streams.sim` — the simulator's command line.

  python -m streams.sim presets
  python -m streams.sim offline --preset NAME --duration S --seed N --out journal.jsonl
                                [--providers N] [--rate RPS] [--heartbeat S] [--with-decisions]
                                [--trace azure-code|azure-conv|mooncake [--trace-scale X]]
                                [--setting NAME=VALUE ...] [--report summary.json]
  python -m streams.sim live    --preset NAME [--duration S] [--rate RPS] [--providers N] [--seed N]
                                [--time-scale X] [--trace ...] [--setting NAME=VALUE ...] [--report FILE.md]

Settings are the preset's, then EIGENINFERENCE_* variables of the environment, then --setting.
Offline times are simulated seconds; live times are wall seconds (providers run --time-scale faster).
"""
from __future__ import annotations

import argparse
import json
import sys

from . import presets
from .arrivals import TRACES


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="default", help="scenario (python -m streams.sim presets)")
    p.add_argument("--providers", type=int, help="fleet size (default: the preset's)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fleet and the traffic (default 1)")
    p.add_argument("--trace", choices=sorted(TRACES), help="replay a public trace instead of synthetic arrivals")
    p.add_argument("--trace-scale", type=float,
                   help="trace rate multiplier (10 = ten times the trace's rate); default: fitted to --rate")
    p.add_argument("--heartbeat", type=float, help="seconds between heartbeats (model time; default: the preset's)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                   help="an EIGENINFERENCE_* routing setting (repeat); applied after the preset's and the environment's")
    p.add_argument("--retries", type=int, default=0,
                   help="the gateway retries a 429/503 after Retry-After up to this many times (default 0)")


def cmd_presets(args) -> int:
    print(presets.listing())
    return 0


def cmd_offline(args) -> int:
    from . import offline, scenario
    scn = scenario.resolve(args.preset, providers=args.providers, rate=args.rate, duration_s=args.duration,
                           seed=args.seed, heartbeat_s=args.heartbeat, settings=args.setting, trace=args.trace,
                           trace_scale=args.trace_scale, tick_ms=args.tick_ms, retries=args.retries)
    progress = None if args.quiet else sys.stderr
    if progress:
        progress.write(f"simulating preset {scn.preset.name}: {scn.providers} providers, {scn.rate:g} req/s, "
                       f"{scn.duration_s:g} s{', journal ' + args.out if args.out else ''} …\n")
    res = offline.run(scn, args.out, with_decisions=args.with_decisions, strict=args.strict, drain_s=args.drain,
                      progress=progress)
    print(res.summary())
    if args.report:
        figures = res.figures()
        with open(args.report, "w") as fp:
            fp.write(json.dumps(figures, indent=2, sort_keys=True, default=str).replace("NaN", "null") + "\n")
        print(f"report: {args.report}")
    if args.out:
        print(f"journal: {args.out} ({res.total_entries:,} entries"
              + (f" + {res.decisions:,} decisions" if args.with_decisions else "") + ")")
    return 0


def cmd_live(args) -> int:
    from . import scenario
    from .live import LiveOptions, main_live
    p = presets.get(args.preset)
    n = args.providers if args.providers is not None else p.providers
    wall_rate = args.rate if args.rate is not None else p.rate_per_provider * n * args.time_scale
    scn = scenario.resolve(args.preset, providers=n, rate=wall_rate / args.time_scale,
                           duration_s=args.duration * args.time_scale, seed=args.seed, heartbeat_s=args.heartbeat,
                           settings=args.setting, trace=args.trace, trace_scale=args.trace_scale,
                           retries=args.retries)
    opts = LiveOptions(duration=args.duration, time_scale=args.time_scale, route_timeout=args.route_timeout,
                       queue_timeout=args.queue_timeout, drain=args.drain,
                       title=f"Switchyard simulator (live, {scn.preset.name})")
    return main_live(scn, opts, args.report, args.workdir, label="sim")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streams.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list the scenario presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("offline", help="closed-loop simulation in simulated time; writes a JSON Lines journal")
    _common(p)
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals (default 600)")
    p.add_argument("--rate", type=float, help="arrivals per second, all models (default: the preset's per-provider "
                                              "rate × providers)")
    p.add_argument("--out", help="journal file (JSON Lines; replay with python -m replay run --journal FILE)")
    p.add_argument("--with-decisions", action="store_true",
                   help="also write each RouteDecision after its entry (for python -m replay audit)")
    p.add_argument("--report", help="write the run's figures as JSON here")
    p.add_argument("--tick-ms", type=int, default=1000, help="Tick entries every this many ms (0 = none; default 1000)")
    p.add_argument("--drain", type=float, default=120.0,
                   help="simulated seconds to let in-flight requests finish after the last arrival (default 120)")
    p.add_argument("--strict", action="store_true", help="write through streams.jsonl.write_record (validates; slower)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_offline)

    p = sub.add_parser("live", help="the fleet and a gateway against a Kafka broker and a worker")
    _common(p)
    p.add_argument("--duration", type=float, default=120.0, help="wall seconds of arrivals (default 120)")
    p.add_argument("--rate", type=float, help="arrivals per wall second (default: the preset's load at --time-scale)")
    p.add_argument("--time-scale", type=float, default=20.0,
                   help="provider time runs this many times faster than wall time (default 20)")
    p.add_argument("--report", default="out/sim-live-report.md", help="report path (default %(default)s)")
    p.add_argument("--workdir", default="var/sim", help="worker data dirs go under here (default %(default)s)")
    p.add_argument("--route-timeout", type=float, default=10.0,
                   help="seconds a request waits for its decision before it counts as lost (default 10)")
    p.add_argument("--queue-timeout", type=float, default=45.0,
                   help="seconds a queued request waits for its second decision (default 45)")
    p.add_argument("--drain", type=float, default=45.0,
                   help="seconds to let in-flight requests finish after the last arrival (default 45)")
    p.set_defaults(func=cmd_live)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
