"""Request → decision latency of a Switchyard worker under a heartbeating fleet, next to two bare
aiokafka baselines measured in the same run (docs/benchmarks.md).

    .venv/bin/python -m benchmarks.pipeline_latency [--rates 200,1000] [--seconds 15] [--providers 1260]

Five systems, one open-loop load driver (this process) and a fleet child (heartbeats, completions),
both on librdkafka by default (``--load-client``, benchmarks/load.py: the load takes less of the
two cores than on aiokafka; the systems under test are aiokafka either way):

* ``echo`` — one hop: a child consumes the request topic and produces each value to the reply
  topic (`benchmarks.echo_baselines echo`);
* ``pipeline`` — the worker's hops and no logic: requests → journal → replies, plain aiokafka, Avro
  decode on both stages and encode of the reply (`benchmarks.echo_baselines pipeline`);
* ``switchyard`` — a real worker child process (`streams.worker_process.Worker`, fresh topic prefix
  and app id) with ``--providers`` providers registered (benchmarks/fleet.py shapes: ``--models``
  models, ``--per-box`` per provider) that heartbeat every ``--heartbeat-s`` seconds from a
  separate child process (``fleet`` role below) during the switchyard phases — 252 heartbeats/s
  for 1,260 providers every 5 s; the same child sends a Completion ``--hold-ms`` after each routed
  decision, so capacity is released as a real gateway would;
* ``echo_fleet``, ``pipeline_fleet`` — the two baselines measured under the switchyard phase's
  traffic: a fleet child of their own heartbeats and sends a Completion after each reply (the
  echoed request names its model; a provider of that model completes it), and the pipeline's
  stage 1 appends those heartbeats and completions to its journal too (stage 2 replies to the
  requests only) — the worker's hops with everything the worker carries, and no logic. The
  plain ``echo`` and ``pipeline`` run on a quieter machine than the worker (no fleet child, no
  heartbeats or completions through the broker); the goals are reported against both.

Optional (``--systems``): ``pipeline_shared`` (the pipeline with one consumer for both stages) and
``echo_librdkafka`` (the echo on confluent-kafka: what a Kafka client in C costs a hop, next to
aiokafka's).

Before anything is measured, ``--broker-warmup`` seconds of echo load at the highest rate (own
topics, own echo child) warm the broker's JIT, which the first measured phase used to pay for.
For each rate, the systems run one after the other (echo, pipeline, echo_fleet, pipeline_fleet,
switchyard; each fleet child heartbeats only during its system's phase): ``--warmup`` seconds of
load that are not counted, then ``--seconds`` measured. Each request is a RouteRequest
(streams.codec, a random model of the fleet, key = request_id, reply_to = the benchmark's reply
topic); the driver timestamps each send
(perf_counter just before the client's send call) and its reply consumer the receipt (once per fetched
batch, before decoding); latency = receipt − send, in the driver. Lost = measured requests without
a reply ``--drain`` seconds after the last send. Achieved = measured sends / their time span.

Where the time goes: per request, the Kafka timestamps of its journal entry (pipeline, switchyard)
and of its reply (producer create times, whole milliseconds) split the latency into
send → journal append, journal append → reply sent, reply sent → receipt (means and p50s; ±1 ms).

Starts its own LocalKafka unless KAFKA_BOOTSTRAP_SERVERS is set. Writes out/bench/pipeline_latency.json
(``--out``). ``--py-spy DIR`` records the worker with py-spy (raw collapsed stacks, one file per
rate) during the switchyard phases: a profiling run, its latencies are not representative.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.echo_baselines import CONSUMER_SETTINGS, Child  # noqa: E402
from benchmarks.fleet import fleet_events, model_names  # noqa: E402
from benchmarks.load import CLIENTS, drive, fleet_main, mean, pct, r3, wall_ms  # noqa: E402
from streams import codec  # noqa: E402

SYSTEMS = ("echo", "echo_librdkafka", "pipeline", "pipeline_shared", "echo_fleet", "pipeline_fleet", "switchyard")
DEFAULT_SYSTEMS = ("echo", "pipeline", "echo_fleet", "pipeline_fleet", "switchyard")
BASELINES = ("echo", "pipeline", "echo_fleet", "pipeline_fleet")
WORKER_OUTPUT_TOPICS = ("switchyard.decisions", "switchyard.reservations", "switchyard.capacity",
                        "switchyard.deadletter")
GOAL_P50_VS_PIPELINE = 1.5
GOAL_P50_VS_ECHO = 3.0
GOAL_P99_MS = 25.0


# === CPU accounting (Linux /proc) ====================================================================
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_split(pid: int | None) -> tuple[float, float] | None:
    """(user, system) CPU seconds, all threads, a process has used so far."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) / _TICK, int(fields[12]) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far."""
    split = proc_cpu_split(pid)
    return None if split is None else split[0] + split[1]


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far, all cores."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / _TICK, sum(v[:8]) / _TICK


class CpuMeter:
    """CPU used by named processes (and the whole machine) between start() and stop()."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = {k: v for k, v in pids.items() if v is not None}

    def start(self) -> "CpuMeter":
        self.t0 = time.monotonic()
        self.c0 = {k: proc_cpu_split(p) for k, p in self.pids.items()}
        self.self0 = time.process_time()
        self.m0 = machine_cpu()
        return self

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        out = {"wall_s": round(wall, 2), "cores": os.cpu_count()}
        for k, p in self.pids.items():
            c1, c0 = proc_cpu_split(p), self.c0.get(k)
            if c1 is not None and c0 is not None:
                out[k + "_cpu_s"] = round(c1[0] + c1[1] - c0[0] - c0[1], 2)
                out[k + "_sys_cpu_s"] = round(c1[1] - c0[1], 2)
        out["driver_cpu_s"] = round(time.process_time() - self.self0, 2)
        m1 = machine_cpu()
        if m1 and self.m0:
            busy = m1[0] - self.m0[0]
            out["machine_busy_cores"] = round(busy / wall, 2)
            ours = sum(v for k, v in out.items() if k.endswith("_cpu_s") and not k.endswith("_sys_cpu_s"))
            out["others_busy_cores"] = round(max(0.0, busy - ours) / wall, 2)
        return out


# === py-spy profiles ===================================================================================
PROFILE_CATEGORIES = (  # (category, substrings of a frame's file), matched from the leaf frame up
    ("avro (streams.codec, fastavro)", ("streams/codec.py", "fastavro/")),
    ("core (streams.router & co)", tuple(f"streams/{m}.py" for m in (
        "router", "candidates", "provider", "rings", "admission", "estimates", "calibration",
        "serve_counter", "config", "versions"))),
    ("tables (faust stores, rocksdict)", ("faust/stores/", "faust/tables/", "rocksdict")),
    ("metrics (prometheus_client, /metrics)", ("prometheus_client/", "aiohttp/")),
    ("kafka client (aiokafka)", ("aiokafka/",)),
    ("faust/mode streams, agents, consumer", ("faust/", "mode/")),
    ("adapter (streams.service)", ("streams/service.py",)),
)


def profile_summary(path: str | Path) -> dict:
    """Share of py-spy samples (raw collapsed format) by category: each sample goes to the first
    category whose files appear walking from the leaf frame towards the event loop's frames (what
    started the loop does not count); samples with no such frame count as "event loop, other"."""
    counts: Counter = Counter()
    total = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        try:
            n = int(n)
        except ValueError:
            continue
        total += n
        cat = "event loop, other"
        for frame in reversed(stack.split(";")):
            if frame.startswith(("BaseEventLoop._run_once ", "Handle._run ")):
                break  # the loop itself; the frames above it are the launcher (faust CLI, mode)
            hit = next((c for c, files in PROFILE_CATEGORIES if any(f in frame for f in files)), None)
            if hit:
                cat = hit
                break
        counts[cat] += n
    return {"samples": total, "shares": {k: round(v / total, 3) for k, v in counts.most_common()} if total else {}}


async def journal_times(bootstrap: str, topic: str, start: int, wanted: set[str]) -> dict[str, int]:
    """request_id -> Kafka timestamp (ms) of its RouteRequest entry in `topic`, from `start` on."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id="bench-journal-reader",
                                **dict(CONSUMER_SETTINGS, fetch_max_wait_ms=50))
    await consumer.start()
    out: dict[str, int] = {}
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, start)
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=10000)
            for r in batch.get(tp, []):
                try:
                    if codec.peek_type(r.value) != "RouteRequest":
                        continue
                    _, rec = codec.decode(r.value)
                except codec.CodecError:
                    continue
                if rec["request_id"] in wanted:
                    out.setdefault(rec["request_id"], r.timestamp)
    finally:
        await consumer.stop()
    return out


async def end_offset(bootstrap: str, topic: str) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id="bench-offsets", group_id=None)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        return (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()


def breakdown(arrays: dict, journal: dict[str, int] | None) -> dict:
    """Mean and p50 (ms) of send → journal append → reply sent → receipt over the measured requests
    (Kafka timestamps are whole ms; the driver's clocks are exact)."""
    seg = {"send_to_journal": [], "journal_to_reply": [], "send_to_reply": [], "reply_to_receipt": []}
    for j in range(arrays["n_warm"], len(arrays["rids"])):
        rts = arrays["reply_ts"][j]
        if rts is None:
            continue
        sent = arrays["send_wall"][j] * 1000
        seg["send_to_reply"].append(rts - sent)
        seg["reply_to_receipt"].append(arrays["recv_wall"][j] * 1000 - rts)
        if journal is not None:
            jts = journal.get(arrays["rids"][j])
            if jts is not None:
                seg["send_to_journal"].append(jts - sent)
                seg["journal_to_reply"].append(rts - jts)
    return {k: {"mean": r3(mean(v)), "p50": r3(pct(v, 50)), "p99": r3(pct(v, 99))}
            for k, v in seg.items() if v}


# === the worker's metrics ============================================================================
def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("switchyard_") and " " in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def metric_delta(before: dict, after: dict, prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix) and after[k] - before.get(k, 0.0)}


# === orchestration ===================================================================================
def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        rev, dirty = "", False
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(), "cpu": cpu,
            "python": platform.python_version(), "platform": platform.platform(),
            "git": rev + ("+dirty" if dirty else ""), "loadavg_start": list(os.getloadavg())}


async def register_fleet(bootstrap: str, prefix: str, n: int, models: int, per_box: int) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        topic = prefix + "switchyard.providers"
        for name, rec in fleet_events(n, models, per_box, at_ms=wall_ms()):
            await producer.send(topic, value=codec.encode(name, rec), key=rec["provider_id"].encode())
        await producer.flush()
    finally:
        await producer.stop()


def wait_metric(worker, name: str, target: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = worker.metric(name)
        if value >= target:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{name} = {value}, expected {target} within {timeout:.0f}s")


def wait_idle(worker, quiet: float = 2.0, timeout: float = 180.0) -> float:
    """Wait until the worker has applied and ingested nothing new for `quiet` s (its backlog is
    gone, so the next phase starts clean); returns the seconds waited."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = parse_metrics(worker.metrics())
        now = tuple(sorted((k, v) for k, v in m.items() if k.startswith(
            ("switchyard_journal_entries_applied_total{", "switchyard_events_ingested_total{"))
            and 'type="Tick"' not in k))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def report(results: list[dict], rates: list[float]) -> tuple[str, list[dict]]:
    lines = [f"{'rate/s':>7} {'system':<15} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7} "
             f"{'achieved/s':>10} {'replies':>7} {'lost':>5}"]
    ratios = []
    for rate in rates:
        by = {r["system"]: r for r in results if r["rate"] == rate}
        for s in SYSTEMS:
            r = by.get(s)
            if r is None:
                continue
            lines.append(f"{rate:>7g} {s:<15} {fmt(r['p50_ms'], 2):>7} {fmt(r['p90_ms'], 2):>7} "
                         f"{fmt(r['p99_ms'], 2):>7} {fmt(r['max_ms'], 1):>7} {fmt(r['achieved_rate']):>10} "
                         f"{r['replies']:>7} {r['lost']:>5}")
        ours = by.get("switchyard")
        if ours:
            q = {"rate": rate, "p99_ms": ours["p99_ms"]}
            for b in BASELINES:
                q[f"p50_vs_{b}"] = ratio(ours["p50_ms"], by.get(b) and by[b]["p50_ms"])
                q[f"p99_vs_{b}"] = ratio(ours["p99_ms"], by.get(b) and by[b]["p99_ms"])
            q["goals"] = {f"p50 <= {goal}x {b}": q[f"p50_vs_{b}"] <= goal
                          for b, goal in (("pipeline", GOAL_P50_VS_PIPELINE), ("echo", GOAL_P50_VS_ECHO),
                                          ("pipeline_fleet", GOAL_P50_VS_PIPELINE), ("echo_fleet", GOAL_P50_VS_ECHO))
                          if q[f"p50_vs_{b}"] is not None}
            q["goals"].update({f"p99 < {GOAL_P99_MS} ms": ours["p99_ms"] is not None and ours["p99_ms"] < GOAL_P99_MS,
                               "no lost replies": ours["lost"] == 0})
            ratios.append(q)
    lines.append("")
    for q in ratios:
        met = ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in q["goals"].items())
        vs = ";  ".join(f"/{b} p50 {fmt(q[f'p50_vs_{b}'], 2)}x p99 {fmt(q[f'p99_vs_{b}'], 2)}x"
                        for b in BASELINES if q[f"p50_vs_{b}"] is not None)
        lines.append(f"rate {q['rate']:g}/s  switchyard {vs}\n    {met}")
    lines.append("")
    lines.append("CPU per phase (cores = CPU seconds / wall seconds; others = the rest of the machine):")
    for r in results:
        c = r.get("cpu") or {}
        lines.append(f"  {r['rate']:>6g} {r['system']:<15} system {fmt(c.get('system_cores'), 2)} cores "
                     f"({fmt(c.get('system_sys_share') and 100 * c['system_sys_share'], 0)}% kernel), "
                     f"{fmt(c.get('system_cpu_ms_per_request'), 3)} ms CPU/request; broker "
                     f"{fmt(c.get('broker_cpu_s') and c['broker_cpu_s'] / c['wall_s'], 2)}, driver "
                     f"{fmt(c.get('driver_cpu_s') and c['driver_cpu_s'] / c['wall_s'], 2)}, machine "
                     f"{fmt(c.get('machine_busy_cores'), 2)} of {c.get('cores')} (others "
                     f"{fmt(c.get('others_busy_cores'), 2)})")
    lines.append("")
    lines.append("where the time goes (mean / p50 ms; Kafka timestamps, +-1 ms):")
    for r in results:
        b = r.get("breakdown") or {}
        parts = [f"{k} {fmt(v['mean'], 2)}/{fmt(v['p50'], 0)}" for k, v in b.items()]
        lines.append(f"  {r['rate']:>6g} {r['system']:<15} " + "  ".join(parts))
    return "\n".join(lines), ratios


def summarise_rounds(results: list[dict], ratios: list[dict], rates: list[float]) -> tuple[str, list[dict]]:
    """Medians over the rounds of each system's p50 and p99 and of the worker's per-round ratios,
    and in how many rounds each goal was met: on a shared machine one round's verdict is a draw."""
    lines = [f"over {len({r['round'] for r in results})} rounds (medians; goals: rounds met / rounds)"]
    summary = []
    for rate in rates:
        rounds = [q for q in ratios if q["rate"] == rate]
        for s in SYSTEMS:
            mine = [r for r in results if r["rate"] == rate and r["system"] == s]
            if mine:
                lines.append(f"{rate:>7g} {s:<15} p50 {fmt(median([r['p50_ms'] for r in mine]), 2):>7} ms  "
                             f"p99 {fmt(median([r['p99_ms'] for r in mine]), 2):>7} ms  "
                             f"CPU {fmt(median([r['cpu'].get('system_cpu_ms_per_request') for r in mine]), 3)} "
                             f"ms/request")
        if not rounds:
            continue
        q = {"rate": rate, "rounds": len(rounds)}
        for b in BASELINES:
            for k in (f"p50_vs_{b}", f"p99_vs_{b}"):
                q[k] = median([x[k] for x in rounds])
        q["goals_met_in_rounds"] = {g: sum(x["goals"].get(g, False) for x in rounds) for g in rounds[0]["goals"]}
        summary.append(q)
        vs = ";  ".join(f"/{b} p50 {fmt(q[f'p50_vs_{b}'], 2)}x p99 {fmt(q[f'p99_vs_{b}'], 2)}x"
                        for b in BASELINES if q[f"p50_vs_{b}"] is not None)
        met = ", ".join(f"{g}: {n}/{len(rounds)}" for g, n in q["goals_met_in_rounds"].items())
        lines.append(f"rate {rate:g}/s  switchyard {vs}\n    {met}")
    return "\n".join(lines), summary


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_latency",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role")
    f = sub.add_parser("fleet", help="(internal) the heartbeat + completion child")
    f.add_argument("--bootstrap", required=True)
    f.add_argument("--prefix", required=True)
    f.add_argument("--replies", required=True)
    f.add_argument("--providers", type=int, default=1260)
    f.add_argument("--models", type=int, default=15)
    f.add_argument("--per-box", type=int, default=2)
    f.add_argument("--interval", type=float, default=5.0)
    f.add_argument("--hold-ms", type=float, default=200.0)
    f.add_argument("--paused", action="store_true")
    f.add_argument("--client", choices=CLIENTS, default=CLIENTS[0])
    pr = sub.add_parser("profile", help="summarise a py-spy raw profile by category")
    pr.add_argument("file")
    ap.add_argument("--rates", default="200,1000", help="requests/s, comma-separated (default 200,1000)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per rate and system (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each (default 3)")
    ap.add_argument("--drain", type=float, default=5.0, help="seconds to wait for the last replies (default 5)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole schedule (every rate, every system) this many times on the same "
                         "broker, and report medians over the rounds too (default 1)")
    ap.add_argument("--broker-warmup", type=float, default=10.0,
                    help="seconds of echo load at the highest rate before anything is measured, so the "
                         "broker's JIT warm-up does not land in the first phase (default 10; 0: none)")
    ap.add_argument("--providers", type=int, default=1260, help="fleet size (default 1260)")
    ap.add_argument("--models", type=int, default=15, help="models in the fleet (default 15)")
    ap.add_argument("--per-box", type=int, default=2, help="models per provider (default 2)")
    ap.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat interval per provider (default 5)")
    ap.add_argument("--hold-ms", type=float, default=200.0, help="routed request -> its Completion (default 200)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help="comma-separated, in order, of " + ",".join(SYSTEMS) + " (default "
                         + ",".join(DEFAULT_SYSTEMS) + "; pipeline_shared: the bare pipeline with one "
                         "consumer for both stages)")
    ap.add_argument("--load-client", choices=CLIENTS, default=CLIENTS[0],
                    help="the Kafka client of the load driver and the fleet child (benchmarks/load.py; "
                         "default librdkafka: the load takes less of the machine; the systems under "
                         "test are aiokafka either way)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="out/bench/pipeline_latency.json")
    ap.add_argument("--workdir", default="var/bench", help="worker data dirs and logs go under here")
    ap.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra environment for the worker, e.g. an EIGENINFERENCE_* setting (repeat)")
    ap.add_argument("--py-spy", metavar="DIR", help="profile the worker with py-spy during switchyard phases "
                    "(samples of the thread holding the GIL: where the CPU goes)")
    ap.add_argument("--py-spy-idle", action="store_true", help="with --py-spy: sample every thread, idle "
                    "ones too (where the worker waits)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "fleet":
        fleet_main(args)
        return 0
    if args.role == "profile":
        summary = profile_summary(args.file)
        print(f"{summary['samples']} samples")
        for k, v in summary["shares"].items():
            print(f"{100 * v:5.1f}%  {k}")
        return 0
    from streams.broker import LocalKafka
    from streams.client import ensure_topics
    from streams.worker_process import Worker

    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not rates or min(rates) <= 0 or args.rounds < 1:
        print(f"bad --systems {sorted(unknown)}, --rates or --rounds", file=sys.stderr)
        return 2
    if (args.load_client == "librdkafka" or "echo_librdkafka" in systems) \
            and importlib.util.find_spec("confluent_kafka") is None:
        print("librdkafka (the load, or echo_librdkafka) needs confluent-kafka: `make install` installs it",
              file=sys.stderr)
        return 2
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    tag = run_id.replace("-", "")
    rundir = (ROOT / args.workdir / f"latency-{run_id}").resolve()
    base = f"bench{tag}."
    topics = {
        "echo": (base + "echo.requests", base + "echo.replies"),
        "echo_librdkafka": (base + "echork.requests", base + "echork.replies"),
        "pipeline": (base + "pipe.requests", base + "pipe.replies"),
        "pipeline_shared": (base + "pipe1.requests", base + "pipe1.replies"),
        "echo_fleet": (base + "echoF.requests", base + "echoF.replies"),
        "pipeline_fleet": (base + "pipeF.requests", base + "pipeF.replies"),
        "switchyard": (base + "sy.switchyard.requests", base + "sy.switchyard.bench.replies"),
    }
    warm_topics = (base + "warm.requests", base + "warm.replies")  # the broker's warm-up echo
    pipe_journal = base + "pipe.journal"
    pipe1_journal = base + "pipe1.journal"
    pipeF_journal = base + "pipeF.journal"
    sy_prefix = base + "sy."
    # where each fleet child sends heartbeats and completions (prefix + switchyard.providers, ...)
    fleet_prefix = {"echo_fleet": base + "echoF.", "pipeline_fleet": base + "pipeF.", "switchyard": sy_prefix}
    fleet_inputs = {s: [fleet_prefix[s] + "switchyard.providers", fleet_prefix[s] + "switchyard.completions"]
                    for s in ("echo_fleet", "pipeline_fleet")}
    info = machine_info()
    info.update(run_id=run_id, rundir=str(rundir), settings={
        k: getattr(args, k) for k in ("rates", "seconds", "warmup", "broker_warmup", "rounds", "drain", "load_client", "providers",
                                      "models", "per_box", "heartbeat_s", "hold_ms", "seed", "worker_env")},
        pipeline_avro="decode on both stages, encode of the reply")
    models = model_names(args.models)

    broker = worker = None
    children: dict[str, Child] = {}
    fleets: dict[str, Child] = {}  # system -> its fleet child (heartbeats during its phases)
    results: list[dict] = []
    code = 0
    try:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if bootstrap:
            info["broker"] = f"external {bootstrap}"
        else:
            print("starting a local Kafka broker ...", flush=True)
            broker = LocalKafka().start()
            bootstrap = broker.bootstrap
            info["broker"] = f"LocalKafka {bootstrap}"
        # The worker's output topics are created up front, as a deployment would: left to the
        # broker's auto-creation on first send, the first routed decision stalls the worker's
        # producer (seen once as a wedge: docs/benchmarks.md).
        asyncio.run(ensure_topics(bootstrap, [t for s in systems for t in topics[s]]
                                  + (list(warm_topics) if args.broker_warmup > 0 else [])
                                  + ([pipe_journal] if "pipeline" in systems else [])
                                  + ([pipe1_journal] if "pipeline_shared" in systems else [])
                                  + ([pipeF_journal] if "pipeline_fleet" in systems else [])
                                  + [t for s in fleet_inputs if s in systems for t in fleet_inputs[s]]
                                  + ([sy_prefix + t for t in WORKER_OUTPUT_TOPICS] if "switchyard" in systems else [])))
        # each baseline: echo_baselines' mode and options (the topics are added below)
        baselines = {
            "echo": ["echo"], "echo_librdkafka": ["echo_librdkafka"], "echo_fleet": ["echo"],
            "pipeline": ["pipeline", "--journal", pipe_journal],
            "pipeline_shared": ["pipeline", "--shared-consumer", "--journal", pipe1_journal],
            "pipeline_fleet": ["pipeline", "--inputs", ",".join(fleet_inputs["pipeline_fleet"]),
                               "--journal", pipeF_journal],
        }
        for system, options in baselines.items():
            if system in systems:
                children[system] = Child("benchmarks.echo_baselines", [
                    *options, "--bootstrap", bootstrap, "--requests", topics[system][0],
                    "--replies", topics[system][1]], rundir / f"{system}.log").start()

        def start_fleet(system: str) -> None:
            fleets[system] = Child("benchmarks.pipeline_latency", [
                "fleet", "--bootstrap", bootstrap, "--prefix", fleet_prefix[system], "--replies",
                topics[system][1], "--providers", str(args.providers), "--models", str(args.models),
                "--per-box", str(args.per_box), "--interval", str(args.heartbeat_s), "--hold-ms",
                str(args.hold_ms), "--client", args.load_client, "--paused"], rundir / f"fleet-{system}.log").start()

        for system in fleet_inputs:
            if system in systems:
                start_fleet(system)
        if "switchyard" in systems:
            print(f"starting a worker (log {rundir / 'worker.log'}) ...", flush=True)
            worker_env = dict(item.partition("=")[::2] for item in args.worker_env)
            worker = Worker(bootstrap, rundir / "worker", f"switchyard-bench-{tag}", sy_prefix, env=worker_env).start()
            t0 = time.monotonic()
            asyncio.run(register_fleet(bootstrap, sy_prefix, args.providers, args.models, args.per_box))
            wait_metric(worker, "switchyard_providers_online", args.providers, 180)
            print(f"{args.providers} providers online after {time.monotonic() - t0:.1f}s", flush=True)
            start_fleet("switchyard")

        # Warm the broker before any phase is measured: its JIT compiles the produce and fetch
        # paths during the first seconds of load, and the first measured phase used to pay for it
        # (0.75-0.9 broker cores against 0.4-0.5 in later phases of the same run).
        if args.broker_warmup > 0:
            warm = Child("benchmarks.echo_baselines", ["echo", "--bootstrap", bootstrap, "--requests",
                         warm_topics[0], "--replies", warm_topics[1]], rundir / "broker-warmup.log").start()
            try:
                t0 = time.monotonic()
                warmed, _ = drive(args.load_client, bootstrap, "warmup", *warm_topics, max(rates), 0.0,
                                  args.broker_warmup, models, args.seed + 2, 2.0)
            finally:
                info["children"] = {"broker_warmup": warm.stop()}
            print(f"broker warmed: {warmed['replies']} echoes at {max(rates):g}/s in "
                  f"{time.monotonic() - t0:.1f} s", flush=True)

        # Prime every system (first-use costs: metadata of output topics the worker creates on first
        # send, the core's per-model candidate indexes): 2 s at 20 requests/s, not reported.
        for system in systems:
            if system in fleets:
                os.kill(fleets[system].pid, signal.SIGUSR2)
            try:
                primed, _ = drive(args.load_client, bootstrap, system, *topics[system], 20.0, 0.0, 2.0,
                                  models, args.seed + 1, 10.0)
            finally:
                if system in fleets:
                    os.kill(fleets[system].pid, signal.SIGUSR1)
            print(f"primed {system}: {primed['replies']}/{primed['requests']} replies, p50 "
                  f"{fmt(primed['p50_ms'], 1)} ms", flush=True)

        schedule = [(n, rate, system) for n in range(1, args.rounds + 1) for rate in rates for system in systems]
        for round_no, rate, system in schedule:
            print(f"{f'round {round_no}: ' if args.rounds > 1 else ''}rate {rate:g}/s: {system} "
                  f"({args.warmup:g}+{args.seconds:g} s) ...", flush=True)
            before = parse_metrics(worker.metrics()) if system == "switchyard" else {}
            journal_topic = {"pipeline": pipe_journal, "pipeline_shared": pipe1_journal,
                             "pipeline_fleet": pipeF_journal,
                             "switchyard": sy_prefix + "switchyard.journal"}.get(system)
            jstart = asyncio.run(end_offset(bootstrap, journal_topic)) if journal_topic else None
            spy = None
            spy_file = Path(args.py_spy) / f"worker-{int(rate)}{f'-r{round_no}' if args.rounds > 1 else ''}.txt" \
                if args.py_spy else None
            if system in fleets:
                os.kill(fleets[system].pid, signal.SIGUSR2)  # heartbeats on
                time.sleep(1.0)
            if system == "switchyard":
                if args.py_spy:
                    Path(args.py_spy).mkdir(parents=True, exist_ok=True)
                    spy = subprocess.Popen(
                        [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(worker.proc.pid),
                         "-d", str(int(args.warmup + args.seconds)), "-r", "200", "-f", "raw", "--nonblocking",
                         "--threads", "--idle" if args.py_spy_idle else "--gil",
                         "-o", str(spy_file)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            pids = {"system": worker.proc.pid if system == "switchyard" else children[system].pid,
                    "broker": broker.pid if broker is not None else None}
            if system in fleets:
                pids["fleet"] = fleets[system].pid
            meter = CpuMeter(pids).start()
            t_phase = time.monotonic()
            try:
                res, arrays = drive(args.load_client, bootstrap, system, *topics[system], rate, args.warmup,
                                    args.seconds, models, args.seed, args.drain)
            finally:
                if system in fleets:
                    os.kill(fleets[system].pid, signal.SIGUSR1)  # heartbeats off
                if spy is not None:
                    spy.wait(60)
            phase_s = time.monotonic() - t_phase
            cpu = meter.stop()
            sent = res["requests"] + int(round(rate * args.warmup))
            if "system_cpu_s" in cpu:
                cpu["system_cpu_ms_per_request"] = round(1000 * cpu["system_cpu_s"] / sent, 3)
                cpu["system_cores"] = round(cpu["system_cpu_s"] / cpu["wall_s"], 2)
                cpu["system_sys_share"] = round(cpu["system_sys_cpu_s"] / cpu["system_cpu_s"], 2) \
                    if cpu["system_cpu_s"] else None
            res["cpu"] = cpu
            if spy is not None:
                res["profile"] = profile_summary(spy_file)
            journal = None
            if journal_topic:
                wanted = set(arrays["rids"][arrays["n_warm"]:])
                journal = asyncio.run(journal_times(bootstrap, journal_topic, jstart, wanted))
            res["breakdown"] = breakdown(arrays, journal)
            res["round"] = round_no
            if system == "switchyard":
                after = parse_metrics(worker.metrics())
                applied = metric_delta(before, after, "switchyard_journal_entries_applied_total")
                res["worker"] = {
                    "applied_per_s": {k: round(v / phase_s, 1) for k, v in applied.items()},
                    "decisions": metric_delta(before, after, "switchyard_decisions_total"),
                    "core_errors": metric_delta(before, after, "switchyard_core_errors_total"),
                    "phase_seconds": round(phase_s, 1)}
                if not worker.running():
                    raise RuntimeError("the worker died; see " + str(worker.log))
                res["worker"]["backlog_drain_s"] = round(wait_idle(worker), 1)
            results.append(res)
            print(f"  p50 {fmt(res['p50_ms'], 2)} ms, p99 {fmt(res['p99_ms'], 2)} ms, "
                  f"achieved {fmt(res['achieved_rate'])}/s, lost {res['lost']}, outcomes {res['outcomes']}"
                  + (f", worker applied/s {res['worker']['applied_per_s']}" if "worker" in res else "")
                  + f"; cpu {res['cpu']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - report what we have, then fail
        print(f"benchmark failed: {e!r}", file=sys.stderr)
        code = 1
    finally:
        info.setdefault("children", {})
        for name, child in fleets.items():
            info["children"]["fleet-" + name] = child.stop()
        for name, child in children.items():
            info["children"][name] = child.stop()
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()
        info["loadavg_end"] = list(os.getloadavg())
    if results:
        texts, ratios = [], []
        for n in range(1, args.rounds + 1):
            text, round_ratios = report([r for r in results if r["round"] == n], rates)
            texts.append((f"round {n}\n" if args.rounds > 1 else "") + text)
            ratios += [dict(q, round=n) for q in round_ratios]
        summary = None
        if args.rounds > 1:
            text, summary = summarise_rounds(results, ratios, rates)
            texts.append(text)
        print("\n" + "\n\n".join(texts))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"info": info, "results": results, "ratios": ratios, "summary": summary},
                                  indent=2) + "\n")
        print(f"\nresults: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
