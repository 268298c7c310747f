"""The outside clients (`streams.client`) against a worker on a real broker: providers register and
heartbeat through ProviderPublisher, a gateway routes through GatewayClient, completions release
capacity and drain the queue, an operator's ConfigChange reaches the journal."""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from streams import codec
from streams.client import ConfigPublisher, GatewayClient, ProviderPublisher
from tests.integration.kafka_io import read_topic, wait_for
from tests.integration.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

CAPPED = "capped-model"  # quality cap 1 through the ConfigChange below


def registration(models: list[str]) -> dict:
    return {"version": "0.7.5", "trust_level": "hardware",
            "hardware": {"chip_name": "Apple M3 Max", "chip_family": "M3", "chip_tier": "Max",
                         "memory_gb": 64.0, "memory_bandwidth_gbs": 400.0, "gpu_cores": 40},
            "decode_tps": 40.0,
            "models": [{"id": m, "size_bytes": 12_000_000_000, "min_ram_gb": 24.0} for m in models]}


def heartbeat(models: list[str]) -> dict:
    return {"status": "idle", "warm_models": models,
            "system_metrics": {"memory_pressure": 0.1, "cpu_usage": 0.1, "thermal_state": "nominal"},
            "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 12.0, "slots": [
                {"model": m, "state": "idle", "num_running": 0, "max_concurrency": 8} for m in models]}}


def journal(bootstrap: str, prefix: str) -> list[tuple[str, dict]]:
    return [codec.decode(r.value) for r in read_topic(bootstrap, prefix + "switchyard.journal")]


@pytest.fixture
def world(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = f"c{tag}."
    worker = Worker(kafka_bootstrap, tmp_path / "worker", f"switchyard-c{tag}", prefix).start()
    yield kafka_bootstrap, prefix, worker
    worker.stop()


def test_route_spread_queue_and_release(world):
    bootstrap, prefix, worker = world
    author = f"test-{uuid.uuid4().hex[:6]}"

    async def scenario():
        # The operator caps CAPPED at one request per box: solo 10 tok/s is under the 15 tok/s floor
        # (quality batch 1), overcommit 1 keeps it at 1.
        async with ConfigPublisher(bootstrap, topic_prefix=prefix) as ops:
            sent = await ops.publish({"MODEL_SOLO_TPS_SEED": f"{CAPPED}=10",
                                      "QUALITY_CONCURRENCY_OVERCOMMIT_BY_MODEL": f"{CAPPED}=1"},
                                     author=author)
        assert sent["settings"]["EIGENINFERENCE_MODEL_SOLO_TPS_SEED"] == f"{CAPPED}=10"
        await asyncio.to_thread(wait_for, lambda: any(
            n == "ConfigChange" and r["author"] == author for n, r in journal(bootstrap, prefix)),
            what="the ConfigChange in the journal")

        boxes = {"box-a": ["gpt-oss-20b"], "box-b": ["gpt-oss-20b"], "box-c": ["gpt-oss-20b", CAPPED]}
        for pid, models in boxes.items():
            async with ProviderPublisher(bootstrap, pid, topic_prefix=prefix) as pub:
                await pub.register(registration(models))
                await pub.heartbeat(heartbeat(models))
                hb = await pub.heartbeat(heartbeat(models))
                assert hb["seq"] == 2 and hb["event_id"]
        await asyncio.to_thread(wait_for, lambda: worker.metric("switchyard_providers_online") == 3,
                                what="3 providers online")

        # A private reply topic: queue follow-ups (decided on a completion, not on the request's own
        # journal entry) must reach it too.
        reply = f"{prefix}switchyard.replies.{uuid.uuid4().hex}"
        async with GatewayClient(bootstrap, topic_prefix=prefix, reply_topic=reply) as gw:
            # Identical idle boxes tie on cost; each reservation then makes its box dearer (queue and
            # pending terms), so consecutive requests spread over the boxes.
            decisions = [await gw.route({"model": "gpt-oss-20b", "prompt_tokens": 1000, "max_tokens": 256},
                                        timeout=20) for _ in range(6)]
            assert all(d["outcome"] == "routed" and d["http_status"] == 200 for d in decisions), decisions
            assert len({d["provider_id"] for d in decisions}) > 1, decisions

            # CAPPED: box-c alone serves it, one at a time. The second request queues (202) ...
            first = await gw.route({"model": CAPPED, "prompt_tokens": 500, "max_tokens": 128}, timeout=20)
            assert (first["outcome"], first["provider_id"]) == ("routed", "box-c"), first
            second = await gw.route({"model": CAPPED, "prompt_tokens": 500, "max_tokens": 128}, timeout=20)
            assert (second["outcome"], second["http_status"]) == ("queued", 202), second
            # ... and the completion of the first releases the slot: the queue drains to box-c.
            await gw.complete({"request_id": first["request_id"], "attempt": first["attempt"],
                               "provider_id": "box-c", "model": CAPPED, "prompt_tokens": 500,
                               "completion_tokens": 128, "ttft_ms": 300.0})
            follow = await gw.follow_up(second["request_id"], second["attempt"], timeout=20)
            assert (follow["outcome"], follow["provider_id"], follow["selected_by"]) == \
                ("routed", "box-c", "queue_drain"), follow

            # A follow-up that arrives before anyone awaits it is kept.
            third = await gw.route({"model": CAPPED, "prompt_tokens": 500, "max_tokens": 128}, timeout=20)
            assert third["outcome"] == "queued", third
            await gw.complete({"request_id": second["request_id"], "provider_id": "box-c", "model": CAPPED})
            await asyncio.to_thread(wait_for, lambda: (third["request_id"], 0) in gw._unclaimed,
                                    timeout=20, what="the unclaimed follow-up")
            late = await gw.follow_up(third["request_id"], 0, timeout=1)
            assert late["outcome"] == "routed" and late["selected_by"] == "queue_drain"
            await gw.complete({"request_id": third["request_id"], "provider_id": "box-c", "model": CAPPED})

            # A request given up on while the worker is stalled is routed when it resumes, to the
            # one CAPPED slot; the client's cancel, right behind it, releases that reservation.
            os.killpg(worker.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await gw.route({"request_id": "given-up", "model": CAPPED, "prompt_tokens": 500}, timeout=1.5)
                assert ("given-up", 0) in gw._abandoned
                while gw._cancels:  # sent while the worker is stopped: it reads both when it resumes
                    await asyncio.sleep(0.05)
            finally:
                os.killpg(worker.proc.pid, signal.SIGCONT)
            await asyncio.to_thread(wait_for, lambda: any(
                n == "Completion" and r["request_id"] == "given-up" and r["status"] == "cancelled"
                for n, r in journal(bootstrap, prefix)), what="the cancel in the journal")
            with pytest.raises(ValueError, match="try again as attempt 1"):
                await gw.route({"request_id": "given-up", "model": CAPPED}, timeout=5)
            fourth = await gw.route({"model": CAPPED, "prompt_tokens": 500, "max_tokens": 128}, timeout=20)
            assert (fourth["outcome"], fourth["provider_id"]) == ("routed", "box-c"), fourth
            await asyncio.to_thread(wait_for, lambda: gw.stats["late_after_cancel"] == 1, timeout=20,
                                    what="the abandoned request's decision, dropped")

    asyncio.run(scenario())
    reservations = read_topic(bootstrap, prefix + "switchyard.reservations")
    assert len(reservations) == 6 + 3 + 2  # one per routed decision, none for a queued one
    assert read_topic(bootstrap, prefix + "switchyard.decisions") == []  # all went to the private topic


def test_private_reply_topic(world):
    bootstrap, prefix, worker = world

    async def scenario():
        async with ProviderPublisher(bootstrap, "box-p", topic_prefix=prefix) as pub:
            await pub.register(registration(["gpt-oss-20b"]))
            await pub.heartbeat(heartbeat(["gpt-oss-20b"]))
        reply = f"{prefix}switchyard.replies.{uuid.uuid4().hex}"
        async with GatewayClient(bootstrap, topic_prefix=prefix, reply_topic=reply) as gw:
            d = await gw.route({"model": "gpt-oss-20b", "prompt_tokens": 100}, timeout=30)
            assert d["outcome"] == "routed" and d["provider_id"] == "box-p"
        return reply

    reply = asyncio.run(scenario())
    assert len(read_topic(bootstrap, reply)) == 1
    assert read_topic(bootstrap, prefix + "switchyard.decisions") == []


def test_a_request_nobody_answers_times_out(kafka_bootstrap):
    prefix = f"nobody{uuid.uuid4().hex[:8]}."  # no worker reads this prefix

    async def scenario():
        async with GatewayClient(kafka_bootstrap, topic_prefix=prefix) as gw:
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await gw.route({"model": "gpt-oss-20b", "prompt_tokens": 10}, timeout=1.5)
            assert 1.4 < time.monotonic() - t0 < 5
            assert gw.pending == 0
            with pytest.raises(asyncio.TimeoutError):
                await gw.follow_up("never-queued", 0, timeout=0.3)

    asyncio.run(scenario())


def test_operator_cli(world, capsys):
    from streams import cli

    bootstrap, prefix, worker = world

    async def provider():
        async with ProviderPublisher(bootstrap, "box-cli", topic_prefix=prefix) as pub:
            await pub.register(registration(["gpt-oss-20b"]))
            await pub.heartbeat(heartbeat(["gpt-oss-20b"]))

    asyncio.run(provider())
    base = ["--bootstrap", bootstrap, "--topic-prefix", prefix]

    assert cli.main(base + ["config", "set", "QUEUE_MAX_DEPTH=20", "EIGENINFERENCE_SATISFICING_BAND=",
                            "--author", "cli-test"]) == 0
    change = json_lines(capsys)[-1]
    assert change["settings"] == {"EIGENINFERENCE_QUEUE_MAX_DEPTH": "20", "EIGENINFERENCE_SATISFICING_BAND": ""}
    assert cli.main(base + ["config", "set", "NO_SUCH_SETTING=1"]) == 2
    assert "unknown setting" in capsys.readouterr().err

    # Options also after the command; the prefix must match the worker's.
    assert cli.main(["route", "--model", "gpt-oss-20b", "--prompt-tokens", "700", "--max-tokens", "128",
                     "--timeout", "30"] + base) == 0
    decision = json_lines(capsys)[-1]
    assert decision["outcome"] == "routed" and decision["provider_id"] == "box-cli"

    assert cli.main(base + ["tail", "decisions", "--from-beginning", "--limit", "1"]) == 0
    assert json_lines(capsys) == [decision]
    assert wait_for(lambda: any(n == "ConfigChange" and r["author"] == "cli-test"
                                for n, r in journal(bootstrap, prefix)), what="the CLI's ConfigChange")


def json_lines(capsys) -> list[dict]:
    import json
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
