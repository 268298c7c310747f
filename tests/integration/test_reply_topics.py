"""On a cluster without topic auto-creation (as most production clusters), a request naming a
reply topic that is not there is dead-lettered at ingest, and the worker keeps deciding: the
decision's send would otherwise wait for the topic's metadata inside the apply loop."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from streams import codec
from streams.broker import LocalKafka
from streams.client import ensure_topics
from tests.integration.kafka_io import journal_types, produce_events, read_topic, wait_for
from tests.integration.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def strict_kafka():
    with LocalKafka(auto_create_topics=False) as kafka:
        yield kafka.bootstrap


def test_a_reply_topic_that_is_not_there_is_dead_lettered_and_deciding_goes_on(strict_kafka, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = f"s{tag}."
    private, missing = prefix + "switchyard.replies.gw-1", prefix + "switchyard.replies.nobody"
    asyncio.run(ensure_topics(strict_kafka, [private]))
    worker = Worker(strict_kafka, tmp_path / "worker", f"switchyard-s{tag}", prefix).start()
    try:
        def request(rid: str, reply_to: str) -> tuple[str, str, dict]:
            return rid, "RouteRequest", {"request_id": rid, "model": "gpt-oss-20b", "prompt_tokens": 100,
                                         "reply_to": reply_to}

        produce_events(strict_kafka, prefix + "switchyard.requests", [
            request("to-nobody", missing), request("to-gw-1", private), request("to-nobody-again", missing),
            request("to-default", "")])
        replies = wait_for(lambda: read_topic(strict_kafka, private), what="the private topic's decision")
        assert [codec.decode(r.value)[1]["request_id"] for r in replies] == ["to-gw-1"]
        default = wait_for(lambda: read_topic(strict_kafka, prefix + "switchyard.decisions"), what="default")
        assert [codec.decode(r.value)[1]["request_id"] for r in default] == ["to-default"]
        letters = [codec.decode(r.value)[1] for r in read_topic(strict_kafka, prefix + "switchyard.deadletter")]
        assert sorted((x["original_key"], x["reason"]) for x in letters) == [
            (b"to-nobody", "bad_reply_to"), (b"to-nobody-again", "bad_reply_to")]
        assert all("no such topic" in x["detail"] for x in letters)
        assert journal_types(strict_kafka, prefix + "switchyard.journal") == ["RouteRequest"] * 2
    finally:
        worker.stop()


def test_a_decision_whose_reply_topic_went_away_goes_to_the_default_topic(strict_kafka, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = f"g{tag}."
    worker = Worker(strict_kafka, tmp_path / "worker", f"switchyard-g{tag}", prefix).start()
    try:
        # An entry whose reply topic is not there (any more): appended straight to the journal, as a
        # worker that ingested it before its topic was deleted would have. This worker applies it
        # when its own next append finds the journal longer than it left it.
        produce_events(strict_kafka, prefix + "switchyard.journal", [("default", "RouteRequest", {
            "request_id": "to-gone", "model": "gpt-oss-20b", "prompt_tokens": 100,
            "reply_to": prefix + "switchyard.replies.gone"})])
        produce_events(strict_kafka, prefix + "switchyard.requests", [("after", "RouteRequest", {
            "request_id": "after", "model": "gpt-oss-20b", "prompt_tokens": 100})])
        default = wait_for(lambda: (d := read_topic(strict_kafka, prefix + "switchyard.decisions")) and len(d) >= 2
                           and d, timeout=30, what="both decisions on the default topic")
        assert sorted(codec.decode(r.value)[1]["request_id"] for r in default) == ["after", "to-gone"]
        assert worker.metric("switchyard_decisions_redirected_total") == 1
    finally:
        worker.stop()
