"""Heartbeats applied per second by one Switchyard worker, next to a bare aiokafka consume + Avro
(fastavro) decode of the same messages in the same run (docs/benchmarks.md).

    .venv/bin/python -m benchmarks.heartbeat_rate [--providers 1260] [--heartbeats 50000]

1. Pre-produce, under a fresh topic prefix, ``--providers`` ProviderRegistered events (the
   benchmarks/fleet.py shapes: ``--models`` models, ``--per-box`` per provider) and then
   ``--heartbeats`` Heartbeat events round-robin over the providers (seq 1, 2, … per provider;
   each report's load differs from the provider's previous one) to ``<prefix>switchyard.providers``.
2. ``bare``: one aiokafka consumer reads the topic from the beginning and `streams.codec.decode`s
   every message; rate = heartbeats / (time of the last heartbeat − time of the first).
3. ``worker``: a worker child process (`streams.worker_process.Worker`, fresh app id) starts on that
   prefix, ingests the topic from the beginning into its journal and applies it; /metrics
   (``switchyard_journal_entries_applied_total{type="Heartbeat"}``) is polled every ``--poll`` s;
   rate = (applied at the first poll that reached all − applied at the first poll that saw any) /
   the time between those polls (worker start-up and registrations excluded). Ingest (topic →
   journal) and apply run concurrently in the worker, as in production.
4. ``bare`` again (the machine is shared: two bare runs bracket the worker's; the ratio uses their
   mean).

Starts its own LocalKafka unless KAFKA_BOOTSTRAP_SERVERS is set; writes out/bench/heartbeat_rate.json
(``--out``). ``--py-spy FILE`` records the worker with py-spy while it applies (raw collapsed stacks).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fleet import fleet_events, heartbeat, model_names  # noqa: E402
from benchmarks.pipeline_latency import WORKER_OUTPUT_TOPICS, machine_cpu, machine_info, proc_cpu_split, profile_summary  # noqa: E402
from streams import codec  # noqa: E402

GOAL_RATIO = 0.5
APPLIED = 'switchyard_journal_entries_applied_total{type="Heartbeat"}'
INGESTED = 'switchyard_events_ingested_total{topic="%s",type="Heartbeat"}'


def wall_ms() -> int:
    return int(time.time() * 1000)


# The worker's other inputs, created before it starts so it does not wait for their auto-creation.
OTHER_INPUT_TOPICS = ("switchyard.requests", "switchyard.completions", "switchyard.config")


async def produce(bootstrap: str, topic: str, providers: int, models: int, per_box: int, heartbeats: int) -> dict:
    from aiokafka import AIOKafkaProducer

    from streams.client import ensure_topics

    await ensure_topics(bootstrap, [topic] + [topic.rpartition("switchyard.")[0] + t
                                              for t in WORKER_OUTPUT_TOPICS + OTHER_INPUT_TOPICS])
    names = model_names(models)
    now = wall_ms()
    regs = [(rec["provider_id"], codec.encode(name, rec))
            for name, rec in fleet_events(providers, models, per_box, at_ms=now) if name == "ProviderRegistered"]
    t0 = time.perf_counter()
    hbs = []
    for k in range(heartbeats):
        i = k % providers
        pid = f"p{i:05d}"
        mine = [names[(i + j) % models] for j in range(per_box)]
        seq = k // providers + 1
        hbs.append((pid, codec.encode("Heartbeat", heartbeat(pid, i, mine, seq, now + 1 + k // providers, shift=seq))))
    encode_s = time.perf_counter() - t0
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20,
                                max_batch_size=256 * 1024)
    await producer.start()
    try:
        t0 = time.perf_counter()
        for pid, value in regs + hbs:
            await producer.send(topic, value=value, key=pid.encode(), partition=0)
        await producer.flush()
        produce_s = time.perf_counter() - t0
    finally:
        await producer.stop()
    return {"messages": len(regs) + len(hbs), "bytes_per_heartbeat": round(sum(len(v) for _, v in hbs) / len(hbs)),
            "encode_s": round(encode_s, 2), "produce_s": round(produce_s, 2)}


async def bare(bootstrap: str, topic: str, expected: int) -> dict:
    """Consume `topic` from the beginning and decode every message, as fast as aiokafka goes."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                client_id="bench-bare-decode", auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        count = hb = 0
        t_first = t_last = None
        t0 = time.perf_counter()
        while count < expected:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=10_000)
            for r in batch.get(tp, []):
                name, _ = codec.decode(r.value)
                count += 1
                if name == "Heartbeat":
                    hb += 1
                    if t_first is None:
                        t_first, cpu_first = time.perf_counter(), time.process_time()
            if time.perf_counter() - t0 > 300:
                raise TimeoutError(f"bare consumer read {count}/{expected} in 300 s")
        t_last, cpu_last = time.perf_counter(), time.process_time()
    finally:
        await consumer.stop()
    seconds = t_last - t_first
    return {"heartbeats": hb, "seconds": round(seconds, 3), "rate": round((hb - 1) / seconds, 1),
            "cpu_us_per_heartbeat": round(1e6 * (cpu_last - cpu_first) / (hb - 1), 1),
            "total_seconds": round(t_last - t0, 3)}


def worker_run(bootstrap: str, prefix: str, rundir: Path, heartbeats: int, poll: float,
               py_spy: str | None, timeout: float) -> dict:
    from streams.worker_process import Worker

    t0 = time.monotonic()
    worker = Worker(bootstrap, rundir / "worker", f"switchyard-hbrate-{rundir.name}", prefix).start()
    spy = None
    try:
        ready_s = time.monotonic() - t0
        ingested_name = INGESTED % (prefix + "switchyard.providers")
        polls = []  # (monotonic, applied, ingested)
        deadline = time.monotonic() + timeout
        while True:
            m = worker.metrics()
            t = time.monotonic()
            applied = ingested = 0.0
            for line in m.splitlines():
                if line.startswith(APPLIED + " "):
                    applied = float(line.split()[-1])
                elif line.startswith(ingested_name + " "):
                    ingested = float(line.split()[-1])
            polls.append((t, applied, ingested, proc_cpu_split(worker.proc.pid), machine_cpu()))
            if applied > 0 and spy is None and py_spy:
                Path(py_spy).parent.mkdir(parents=True, exist_ok=True)
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                                        str(worker.proc.pid), "-r", "200", "-f", "raw", "--nonblocking", "--gil",
                                        "-o", py_spy], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if applied >= heartbeats:
                break
            if t > deadline or not worker.running():
                raise TimeoutError(f"worker applied {applied:.0f}/{heartbeats} heartbeats in {timeout:.0f}s; "
                                   f"see {worker.log}")
            time.sleep(poll)
        errors = sum(float(line.split()[-1]) for line in worker.metrics().splitlines()
                     if line.startswith("switchyard_core_errors_total{"))
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        worker.stop()
    first = next(p for p in polls if p[1] > 0)
    last = polls[-1]
    seconds = last[0] - first[0]
    ingest_done = next((p for p in polls if p[2] >= heartbeats), None)
    cpu = {}
    if first[3] is not None and last[3] is not None and seconds > 0:
        used = sum(last[3]) - sum(first[3])
        cpu["cpu_us_per_heartbeat"] = round(1e6 * used / (last[1] - first[1]), 1)
        cpu["worker_cores"] = round(used / seconds, 2)
        cpu["kernel_share"] = round((last[3][1] - first[3][1]) / used, 2) if used else None
    if first[4] and last[4] and seconds > 0:
        cpu["machine_busy_cores"] = round((last[4][0] - first[4][0]) / seconds, 2)
    return {"ready_s": round(ready_s, 1), "seconds": round(seconds, 3),
            "rate": round((last[1] - first[1]) / seconds, 1) if seconds > 0 else None, **cpu,
            "first_poll_applied": first[1], "polls": len(polls), "core_errors": errors,
            "ingest_done_s": round(ingest_done[0] - first[0], 2) if ingest_done else None,
            "log": str(worker.log)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.heartbeat_rate", description=__doc__.split("\n")[0])
    ap.add_argument("--providers", type=int, default=1260, help="fleet size (default 1260)")
    ap.add_argument("--heartbeats", type=int, default=50_000, help="heartbeats to apply (default 50000)")
    ap.add_argument("--models", type=int, default=15, help="models in the fleet (default 15)")
    ap.add_argument("--per-box", type=int, default=2, help="models per provider (default 2)")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between /metrics polls (default 0.5)")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up on the worker after (default 600 s)")
    ap.add_argument("--out", default="out/bench/heartbeat_rate.json")
    ap.add_argument("--workdir", default="var/bench")
    ap.add_argument("--py-spy", metavar="FILE", help="profile the worker with py-spy while it applies")
    args = ap.parse_args(argv)
    if args.providers < 1 or args.heartbeats < 2:
        ap.error("need at least 1 provider and 2 heartbeats")

    from streams.broker import LocalKafka

    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    tag = run_id.replace("-", "")
    prefix = f"hbrate{tag}."
    topic = prefix + "switchyard.providers"
    rundir = (ROOT / args.workdir / f"hbrate-{run_id}").resolve()
    info = machine_info()
    info.update(run_id=run_id, settings={k: getattr(args, k) for k in ("providers", "heartbeats", "models",
                                                                         "per_box", "poll")})
    broker = None
    result: dict = {"info": info}
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
        print(f"producing {args.providers} registrations + {args.heartbeats} heartbeats to {topic} ...", flush=True)
        result["produced"] = asyncio.run(produce(bootstrap, topic, args.providers, args.models, args.per_box,
                                                 args.heartbeats))
        expected = args.providers + args.heartbeats
        result["bare_before"] = asyncio.run(bare(bootstrap, topic, expected))
        print(f"bare consume+decode: {result['bare_before']['rate']:.0f} heartbeats/s", flush=True)
        print("worker: start, ingest, apply ...", flush=True)
        result["worker"] = worker_run(bootstrap, prefix, rundir, args.heartbeats, args.poll, args.py_spy,
                                      args.timeout)
        print(f"worker: {result['worker']['rate']:.0f} heartbeats/s applied "
              f"(ready in {result['worker']['ready_s']} s)", flush=True)
        result["bare_after"] = asyncio.run(bare(bootstrap, topic, expected))
        print(f"bare consume+decode: {result['bare_after']['rate']:.0f} heartbeats/s", flush=True)
        bare_rate = (result["bare_before"]["rate"] + result["bare_after"]["rate"]) / 2
        ratio = result["worker"]["rate"] / bare_rate
        bare_cpu = (result["bare_before"]["cpu_us_per_heartbeat"] + result["bare_after"]["cpu_us_per_heartbeat"]) / 2
        result["summary"] = {"bare_rate": round(bare_rate, 1), "worker_rate": result["worker"]["rate"],
                             "ratio": round(ratio, 3), "goal": f">= {GOAL_RATIO}", "met": ratio >= GOAL_RATIO,
                             "bare_cpu_us_per_heartbeat": round(bare_cpu, 1),
                             "worker_cpu_us_per_heartbeat": result["worker"].get("cpu_us_per_heartbeat")}
        if args.py_spy:
            result["profile"] = profile_summary(args.py_spy)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - report what we have, then fail
        print(f"benchmark failed: {e!r}", file=sys.stderr)
        code = 1
    finally:
        if broker is not None:
            broker.stop()
        info["loadavg_end"] = list(os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    s = result.get("summary")
    if s:
        print(f"\nheartbeats/s  bare consume+decode {s['bare_rate']:.0f}   worker applied {s['worker_rate']:.0f}   "
              f"ratio {s['ratio']:.3f} (goal {s['goal']}: {'met' if s['met'] else 'MISSED'})")
        print(f"CPU µs/heartbeat  bare {s['bare_cpu_us_per_heartbeat']}   worker {s['worker_cpu_us_per_heartbeat']}")
        for k, v in (result.get("profile") or {}).get("shares", {}).items():
            print(f"  {100 * v:5.1f}%  {k}")
    print(f"results: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
