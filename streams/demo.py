"""The demo: a real broker, a real worker, and the simulator's closed-loop fleet routed through them.

    python -m streams.demo [--duration 180] [--rate 20] [--providers 24] [--seed 7] [--preset default]
                           [--report out/demo-report.md]

The main job of the README (`make demo`). It runs a `streams.sim` preset (default: the production
mix of domain §6.1) in live mode:

* infrastructure — a `LocalKafka` (unless $KAFKA_BOOTSTRAP_SERVERS is set) and one Faust worker
  child process (`streams.worker_process`) with a fresh data dir under `var/demo/<run>/`, a unique
  topic prefix and app id per run, started with the preset's routing settings;
* the fleet — `streams.sim.fleet`: Apple-silicon providers with true decode (load slowdown k per
  engine) and prefill rates, engine batch limits and KV budgets they enforce, heartbeats reporting
  their observed EWMAs, versions old and new, legacy, hostile and broken machines;
* the gateway — `streams.sim.arrivals` traffic (per-model Poisson, prompts p50 ≈ 1k / p90 ≈ 10k,
  cache-affinity keys for multi-turn conversations) published through `GatewayClient`, routed
  requests served by the chosen provider, Completions with the measured TTFT;
* the live summary (every 2 s) and the Markdown report (plus a JSON twin) at the end.

Provider time runs faster than wall time (`--time-scale`, default 20): a request that would decode
for 20 s on a real Mac takes 1 s here, so a demo minute carries real traffic. Rates, TTFTs and
observed EWMAs are reported in model time; the router's own clock (journal time: queue waits,
staleness) is wall time. The same machinery is `python -m streams.sim live` (docs/simulator.md).
"""
from __future__ import annotations

import argparse
import sys

from .sim import presets
from .sim.live import LiveOptions, main_live
from .sim.scenario import resolve


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m streams.demo",
        description="Run Switchyard end to end: a local Kafka broker (unless $KAFKA_BOOTSTRAP_SERVERS is "
                    "set), one worker, and a simulated fleet of Apple-silicon providers with a gateway "
                    "sending Poisson traffic. Shows a live summary every 2 s and writes a Markdown report "
                    "(plus a .json twin). Ctrl-C ends early and still writes the report.")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of traffic (default 180)")
    ap.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second (default 20)")
    ap.add_argument("--providers", type=int, default=24, help="fleet size (default 24)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the fleet and the traffic (default 7)")
    ap.add_argument("--preset", default="default", choices=sorted(presets.PRESETS),
                    help="scenario preset (default: the production mix; python -m streams.sim presets)")
    ap.add_argument("--report", default="out/demo-report.md", help="report path (default out/demo-report.md)")
    ap.add_argument("--time-scale", type=float, default=20.0,
                    help="provider time runs this many times faster than wall time (default 20)")
    ap.add_argument("--workdir", default="var/demo", help="worker data dirs go under here (default var/demo)")
    ap.add_argument("--route-timeout", type=float, default=10.0,
                    help="seconds a request waits for its decision before it counts as lost (default 10)")
    ap.add_argument("--queue-timeout", type=float, default=45.0,
                    help="seconds a queued request waits for its second decision (default 45)")
    ap.add_argument("--drain", type=float, default=45.0,
                    help="seconds to let in-flight requests finish after the last arrival (default 45)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="an EIGENINFERENCE_* routing setting for the worker (repeat)")
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.rate <= 0 or args.providers < 2 or args.time_scale <= 0:
        ap.error("--duration, --rate and --time-scale must be positive and --providers at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    scn = resolve(args.preset, providers=args.providers, rate=args.rate / args.time_scale,
                  duration_s=args.duration * args.time_scale, seed=args.seed, settings=args.setting)
    opts = LiveOptions(duration=args.duration, time_scale=args.time_scale, route_timeout=args.route_timeout,
                       queue_timeout=args.queue_timeout, drain=args.drain, title="Switchyard demo")
    return main_live(scn, opts, args.report, args.workdir, label="demo")


if __name__ == "__main__":
    sys.exit(main())
