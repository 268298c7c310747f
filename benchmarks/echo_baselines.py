"""Bare aiokafka baselines for `benchmarks.pipeline_latency`, each run as a child process.

    python -m benchmarks.echo_baselines echo     --bootstrap B --requests T --replies R
    python -m benchmarks.echo_baselines pipeline --bootstrap B --requests T --journal J --replies R [--no-avro]
                                                 [--inputs T2,T3]
    python -m benchmarks.echo_baselines echo_librdkafka --bootstrap B --requests T --replies R

* ``echo`` — one hop: consume the request topic, produce each value unchanged to the reply topic
  with the same key. No decoding: the cheapest request/reply a Kafka service can give.
* ``pipeline`` — the same hops as a Switchyard worker and no logic: stage 1 consumes the request
  topic and appends each value to a journal topic (like `ingest`), stage 2 consumes the journal
  and produces a reply keyed like the request (like the `router` agent). By default both stages
  do what the worker's adapter does with Avro and nothing more: stage 1 decodes the request
  (validation) and appends the original bytes, stage 2 decodes the journal entry and encodes the
  reply (the request record re-encoded, to the reply topic). ``--no-avro`` copies bytes only.
  ``--inputs``: more input topics appended to the journal by stage 1 (as a worker ingests
  heartbeats and completions); stage 2 decodes every entry and replies to RouteRequests only.
* ``echo_librdkafka`` — ``echo`` on confluent-kafka (librdkafka, the protocol in C) instead of
  aiokafka (the protocol in Python): what the Kafka client alone costs a hop (optional; needs
  ``pip install confluent-kafka``).

``echo`` and ``pipeline`` run in one process on one asyncio loop with one shared producer, as a
Faust worker does, but with one consumer per stage (each long-polls only its own partition;
``--shared-consumer``: one consumer assigned both partitions, as a Faust worker has), no consumer
group, no offset commits, acks=all and linger 0 (the worker's producer settings). Each consumer starts at
the beginning of its (fresh, single-partition) topic. The child prints ``READY`` once its
consumers are positioned, and a JSON line of counters when it gets SIGTERM.

`Child` is the parent's side: start a ``python -m ...`` child, wait for ``READY``, stop it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRODUCER_SETTINGS = {"acks": "all", "linger_ms": 0}
CONSUMER_SETTINGS = {"group_id": None, "enable_auto_commit": False, "fetch_max_wait_ms": 100,
                     "auto_offset_reset": "earliest"}


# The same settings on confluent-kafka (librdkafka): the `echo_librdkafka` baseline and the load
# (benchmarks/load.py). Nagle off, as aiokafka has it: with it on, small messages on loopback wait
# ~40 ms for an ACK.
def rdkafka_producer(bootstrap: str, client_id: str):
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": PRODUCER_SETTINGS["acks"],
                     "linger.ms": PRODUCER_SETTINGS["linger_ms"], "socket.nagle.disable": True})


def rdkafka_consumer(bootstrap: str, client_id: str):
    """An unassigned consumer (no group membership, no commits)."""
    from confluent_kafka import Consumer

    return Consumer({"bootstrap.servers": bootstrap, "client.id": client_id, "group.id": client_id,
                     "enable.auto.commit": False, "fetch.wait.max.ms": CONSUMER_SETTINGS["fetch_max_wait_ms"],
                     "socket.nagle.disable": True})


def rdkafka_take(consumer, timeout: float) -> list:
    """What is fetched already; else wait up to `timeout` s for one message. (consume(n, t) waits
    until it has n messages: it would hold a message that came early.)"""
    return consumer.consume(1000, 0) or consumer.consume(1, timeout)


# === the child's side ================================================================================
async def _consumer_at_start(bootstrap: str, *topics: str):
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id=f"bench-{topics[0]}", **CONSUMER_SETTINGS)
    await consumer.start()
    tps = [TopicPartition(topic, 0) for topic in topics]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    for tp in tps:
        await consumer.position(tp)
    return consumer


async def _stage(consumer, handle, stats: dict, name: str) -> None:
    while True:
        batches = await consumer.getmany(timeout_ms=500, max_records=1000)
        if batches:  # records per fetch: how the load's arrivals batch (docs/benchmarks.md, "ninth")
            stats[name + "_fetches"] = stats.get(name + "_fetches", 0) + 1
        for records in batches.values():
            for record in records:
                await handle(record)
            stats[name] += len(records)


async def run_until_stopped(coroutines, ready: str = "READY") -> None:
    """Run the child's coroutines, print `ready` (what `Child.start` waits for), and return on
    SIGTERM or SIGINT; if one of them fails first, raise its error. The others are cancelled."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    tasks = [asyncio.create_task(c) for c in coroutines]
    print(ready, flush=True)
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopper and t.exception() is not None:
                raise t.exception()
    finally:
        for t in (stopper, *tasks):
            t.cancel()


async def serve(args) -> None:
    from aiokafka import AIOKafkaProducer

    from streams import codec

    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, client_id="bench-baseline", **PRODUCER_SETTINGS)
    await producer.start()
    stats = {"mode": args.mode, "avro": not args.no_avro, "stage1": 0, "stage2": 0, "records": 0}
    consumers, tasks = [], []
    try:
        if args.mode == "echo":
            async def echo(record):
                await producer.send(args.replies, value=record.value, key=record.key)

            consumers.append(await _consumer_at_start(args.bootstrap, args.requests))
            tasks.append(_stage(consumers[0], echo, stats, "stage1"))
        else:
            avro = not args.no_avro

            async def ingest(record):
                if avro:
                    codec.decode(record.value)  # validation only; the original bytes are appended
                await producer.send(args.journal, value=record.value, key=record.key, partition=0)

            async def reply(record):
                value = record.value
                if avro:
                    name, rec = codec.decode(value)
                    if name != "RouteRequest":  # a heartbeat or completion (--inputs): no reply
                        return
                    value = codec.encode(name, rec)
                await producer.send(args.replies, value=value, key=record.key)

            if args.shared_consumer:  # one consumer for both stages, as a Faust worker has
                from aiokafka import AIOKafkaConsumer, TopicPartition

                consumer = AIOKafkaConsumer(bootstrap_servers=args.bootstrap, client_id="bench-shared",
                                            **CONSUMER_SETTINGS)
                await consumer.start()
                consumers.append(consumer)
                tps = [TopicPartition(args.requests, 0), TopicPartition(args.journal, 0)]
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                for tp in tps:
                    await consumer.position(tp)

                async def either(record):
                    if record.topic == args.requests:
                        stats["stage1"] += 1
                        await ingest(record)
                    else:
                        stats["stage2"] += 1
                        await reply(record)

                tasks.append(_stage(consumer, either, stats, "records"))
            else:
                consumers.append(await _consumer_at_start(args.bootstrap, args.requests, *args.inputs))
                consumers.append(await _consumer_at_start(args.bootstrap, args.journal))
                tasks.append(_stage(consumers[0], ingest, stats, "stage1"))
                tasks.append(_stage(consumers[1], reply, stats, "stage2"))
        await run_until_stopped(tasks)
    finally:
        for c in consumers:
            await c.stop()
        await producer.stop()
        print(json.dumps(stats), flush=True)


def serve_librdkafka(args) -> None:
    """The echo on librdkafka, with the aiokafka echo's settings (acks=all, linger 0, no group)."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    producer = rdkafka_producer(args.bootstrap, "bench-baseline")
    consumer = rdkafka_consumer(args.bootstrap, "bench-baseline-requests")
    consumer.assign([TopicPartition(args.requests, 0, OFFSET_BEGINNING)])
    stop, stats = [], {"mode": args.mode, "stage1": 0}
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("READY", flush=True)
    while not stop:
        for message in rdkafka_take(consumer, 0.1):
            if message.error() is None:
                producer.produce(args.replies, message.value(), message.key())
                stats["stage1"] += 1
        producer.poll(0)  # delivery reports
    producer.flush(5)
    consumer.close()
    print(json.dumps(stats), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.echo_baselines", description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("echo", "pipeline", "echo_librdkafka"))
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--requests", required=True, help="request topic (consumed)")
    ap.add_argument("--replies", required=True, help="reply topic (produced)")
    ap.add_argument("--journal", help="pipeline: the intermediate topic")
    ap.add_argument("--no-avro", action="store_true", help="pipeline: copy bytes, no Avro decode/encode")
    ap.add_argument("--shared-consumer", action="store_true",
                    help="pipeline: one consumer for both stages (default: one per stage)")
    ap.add_argument("--inputs", default="", help="pipeline: more input topics for the journal, comma-separated")
    args = ap.parse_args(argv)
    args.inputs = [t for t in args.inputs.split(",") if t]
    if args.mode == "pipeline" and not args.journal:
        ap.error("pipeline needs --journal")
    if args.inputs and (args.mode != "pipeline" or args.no_avro or args.shared_consumer):
        ap.error("--inputs: pipeline only, with Avro, one consumer per stage")
    if args.mode == "echo_librdkafka":
        serve_librdkafka(args)
    else:
        asyncio.run(serve(args))
    return 0


# === the parent's side ===============================================================================
class Child:
    """A ``python -m <module> <args>`` child in its own process group. ``start()`` waits until it
    prints ``READY``; ``stop()`` sends SIGTERM (SIGKILL after a timeout) and returns the JSON
    object of its last output line, if any. stderr goes to ``log``."""

    def __init__(self, module: str, args: list[str], log: Path, env: dict | None = None):
        self.cmd = [sys.executable, "-m", module, *args]
        self.log = Path(log)
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.proc: subprocess.Popen | None = None
        self._out: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> "Child":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.strip() == "READY":
                    return self
                if line:
                    self._out.append(line)
                    continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(self.cmd[2:4])} exited {self.proc.returncode}; see {self.log}")
        self.stop()
        raise TimeoutError(f"{' '.join(self.cmd[2:4])} not ready in {timeout:.0f}s; see {self.log}")

    def stop(self, timeout: float = 20.0) -> dict | None:
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        for line in reversed((out or "").splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    break
        return None


if __name__ == "__main__":
    sys.exit(main())
