"""GatewayClient's reply bookkeeping without a broker: which waiter a decision completes, what is
kept for later, what a stop tells the callers (streams/client.py)."""
from __future__ import annotations

import asyncio

import pytest

from streams import codec
from streams.client import GatewayClient


def decision(outcome: str, request_id: str = "r1", attempt: int = 0) -> bytes:
    return codec.encode("RouteDecision", {"request_id": request_id, "attempt": attempt, "outcome": outcome,
                                          "provider_id": "box-a" if outcome == "routed" else ""})


def client() -> GatewayClient:
    gw = GatewayClient("127.0.0.1:1", topic_prefix="t.")
    gw._sent[("r1", 0)] = None  # as `route` records what it sent
    return gw


def test_a_resent_queued_decision_does_not_complete_the_follow_up():
    async def scenario():
        gw = client()
        follow = asyncio.get_running_loop().create_future()
        gw._follow[("r1", 0)] = follow
        gw._on_record(decision("queued"))  # the at-least-once re-send of the first decision
        assert not follow.done()
        gw._on_record(decision("routed"))
        assert follow.result()["outcome"] == "routed"

    asyncio.run(scenario())


def test_an_early_follow_up_is_kept_and_a_resent_queued_one_neither_replaces_it_nor_counts_as_one():
    async def scenario():
        gw = client()
        gw._producer = object()  # "started": follow_up only reads what the reply loop kept
        gw._on_record(decision("queued"))
        with pytest.raises(asyncio.TimeoutError):  # only a queued decision is there: no follow-up yet
            await gw.follow_up("r1", 0, timeout=0.05)
        gw._on_record(decision("routed"))
        gw._on_record(decision("queued"))
        assert (await gw.follow_up("r1", 0, timeout=0.05))["outcome"] == "routed"

    asyncio.run(scenario())


def test_a_late_decision_of_an_abandoned_request_is_dropped():
    async def scenario():
        gw = client()
        gw._abandoned[("r1", 0)] = None
        gw._on_record(decision("routed"))
        assert gw.stats["late_after_cancel"] == 1 and not gw._unclaimed

    asyncio.run(scenario())


def test_stop_fails_the_waiting_callers_instead_of_cancelling_them():
    async def scenario():
        gw = client()
        waiting = asyncio.get_running_loop().create_future()
        gw._first[("r1", 0)] = waiting
        await gw.stop()
        assert not waiting.cancelled() and isinstance(waiting.exception(), ConnectionError)

    asyncio.run(scenario())


@pytest.mark.parametrize("reply_topic, problem", [
    ("t.switchyard.journal", "one of the worker's own topics"),
    ("t.switchyard.providers", "one of the worker's own topics"),
    ("switchyard-core-changelog", "is not under 't.switchyard.'"),
    ("t.switchyard.replies/x", "not a legal topic name"),
    ("t.switchyard." + "x" * 240, "not a legal topic name"),
])
def test_a_reply_topic_the_worker_would_refuse_is_refused_at_once(reply_topic, problem):
    with pytest.raises(ValueError, match=problem):
        GatewayClient("127.0.0.1:1", topic_prefix="t.", reply_topic=reply_topic)


def test_the_default_and_private_reply_topics_pass():
    assert GatewayClient("127.0.0.1:1", topic_prefix="t.").reply_topic == "t.switchyard.decisions"
    GatewayClient("127.0.0.1:1", topic_prefix="t.", reply_topic="t.switchyard.replies.gw-eu-1")
