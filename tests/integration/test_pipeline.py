"""The live pipeline on a real broker: a small fleet heartbeating and requests flowing; every
decision equals what the core decides for the same journal (an audit from Kafka), duplicates get
one decision, and a worker restart mid-stream loses and repeats nothing."""
from __future__ import annotations

import json
import uuid

import pytest

from replay.audit import compare
from replay.run import decisions as replay_decisions
from replay.sources import kafka_decisions, kafka_journal
from streams import codec
from tests.integration.kafka_io import produce_events, read_topic, wait_for
from tests.integration.test_worker import heartbeat, registration
from tests.integration.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def request(rid: str, model: str = "gpt-oss-20b", prompt: int = 800) -> dict:
    return {"request_id": rid, "attempt": 0, "model": model, "prompt_tokens": prompt, "max_tokens": 256,
            "sent_at_ms": 0}


def fleet(n: int) -> list:
    events = []
    for i in range(n):
        pid = f"box-{i}"
        reg = registration(pid)
        reg["decode_tps"] = 30.0 + 7 * i
        events.append((pid, "ProviderRegistered", reg))
        events.append((pid, "Heartbeat", heartbeat(pid, 2)))  # seq 2: running 0
    return events


def register_fleet(bootstrap, prefix, n: int) -> None:
    """n providers registered and heartbeating, in the journal before any request is produced:
    Kafka orders nothing across topics, so a request produced right after them could be ingested
    first (and rejected with no_provider)."""
    produce_events(bootstrap, prefix + "switchyard.providers", fleet(n))
    wait_for(lambda: sum(e.type == "Heartbeat" for e in kafka_journal(bootstrap, prefix + "switchyard.journal")) >= n,
             what=f"{n} providers in the journal")


def decisions_of(bootstrap, prefix) -> list[dict]:
    return kafka_decisions(bootstrap, prefix + "switchyard.decisions")


@pytest.fixture
def pipeline(kafka_bootstrap, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = f"p{tag}."
    worker = Worker(kafka_bootstrap, tmp_path / "worker", f"switchyard-p{tag}", prefix)
    worker.start()
    yield kafka_bootstrap, prefix, worker
    worker.stop()


def audit(bootstrap, prefix):
    journal = list(kafka_journal(bootstrap, prefix + "switchyard.journal"))
    return compare(decisions_of(bootstrap, prefix), list(replay_decisions(journal)))


def test_live_decisions_equal_a_replay_of_the_journal(pipeline):
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    reqs = [(f"r{i}", "RouteRequest", request(f"r{i}", prompt=200 + 300 * i)) for i in range(24)]
    produce_events(bootstrap, prefix + "switchyard.requests", reqs + [reqs[0], reqs[5]])  # two duplicates
    got = wait_for(lambda: (d := decisions_of(bootstrap, prefix)) and len(d) >= 24 and d, what="24 decisions")
    by_id = {}
    for d in got:
        by_id.setdefault(d["request_id"], []).append(d)
    assert all(len(v) == 1 or v[0]["outcome"] == "queued" for v in by_id.values())
    assert len(by_id) == 24
    routed = [d for d in got if d["outcome"] == "routed"]
    assert len({d["provider_id"] for d in routed}) > 1  # selection spread over several boxes
    reservations = [codec.decode(r.value)[1] for r in read_topic(bootstrap, prefix + "switchyard.reservations")]
    assert sorted(r["request_id"] for r in reservations) == sorted(d["request_id"] for d in routed)
    report = audit(bootstrap, prefix)
    assert report.ok, report.summary()
    assert report.compared == len(got)
    assert worker.metric("switchyard_decisions_total", 'outcome="routed",reason=""') == len(routed)
    assert worker.metric("switchyard_journal_entries_applied_on_ack_total") > 0  # the sequencer's path


def test_a_worker_restart_mid_stream_loses_and_repeats_nothing(pipeline):
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    produce_events(bootstrap, prefix + "switchyard.requests",
                   [(f"a{i}", "RouteRequest", request(f"a{i}")) for i in range(10)])
    wait_for(lambda: len(decisions_of(bootstrap, prefix)) >= 10, what="first 10 decisions")
    worker.stop()
    # While it is down: more requests (ingest and routing resume where they stopped).
    produce_events(bootstrap, prefix + "switchyard.requests",
                   [(f"b{i}", "RouteRequest", request(f"b{i}")) for i in range(10)])
    worker.start()
    got = wait_for(lambda: (d := decisions_of(bootstrap, prefix)) and
                   len({x["request_id"] for x in d}) >= 20 and d, what="20 answered requests")
    ids = [(d["request_id"], d["outcome"]) for d in got]
    assert len(ids) == len(set(ids)), "a decision was published twice"
    report = audit(bootstrap, prefix)
    assert report.ok, report.summary()
    # ingest resumed after the last input the journal holds: nothing ingested twice, nothing skipped
    ingested = sorted(e.record["request_id"] for e in kafka_journal(bootstrap, prefix + "switchyard.journal")
                      if e.type == "RouteRequest")
    assert ingested == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])


def test_a_worker_with_a_fresh_datadir_resumes_from_the_table_changelog(pipeline, tmp_path):
    """No journal replay from offset 0: the core state comes back from the tables' changelog."""
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    produce_events(bootstrap, prefix + "switchyard.requests",
                   [(f"a{i}", "RouteRequest", request(f"a{i}")) for i in range(8)])
    wait_for(lambda: len(decisions_of(bootstrap, prefix)) >= 8, what="first 8 decisions")
    worker.stop()
    fresh = Worker(bootstrap, tmp_path / "fresh", worker.app_id, prefix)
    fresh.start()
    try:
        produce_events(bootstrap, prefix + "switchyard.requests",
                       [(f"b{i}", "RouteRequest", request(f"b{i}")) for i in range(8)])
        wait_for(lambda: len({d["request_id"] for d in decisions_of(bootstrap, prefix)}) >= 16, what="16 answered")
        assert fresh.metric("switchyard_journal_entries_replayed_total") == 0
        assert fresh.metric("switchyard_providers_online") == 3
        report = audit(bootstrap, prefix)
        assert report.ok, report.summary()
    finally:
        fresh.stop()


def test_a_standby_worker_takes_over_when_the_active_one_dies(pipeline, tmp_path):
    bootstrap, prefix, worker = pipeline
    standby = Worker(bootstrap, tmp_path / "standby", worker.app_id, prefix)
    standby.start()
    try:
        register_fleet(bootstrap, prefix, 3)
        produce_events(bootstrap, prefix + "switchyard.requests",
                       [(f"a{i}", "RouteRequest", request(f"a{i}")) for i in range(8)])
        wait_for(lambda: len(decisions_of(bootstrap, prefix)) >= 8, what="first 8 decisions")
        active, other = (worker, standby) if worker.metric("switchyard_journal_entries_applied_total",
                                                         'type="RouteRequest"') else (standby, worker)
        import signal
        active.stop(sig=signal.SIGKILL)
        produce_events(bootstrap, prefix + "switchyard.requests",
                       [(f"b{i}", "RouteRequest", request(f"b{i}")) for i in range(8)])
        try:
            got = wait_for(lambda: (d := decisions_of(bootstrap, prefix)) and
                           len({x["request_id"] for x in d}) >= 16 and d, timeout=180, what="the standby's decisions")
        except AssertionError as exc:  # say where the survivor stands
            metrics = [m for m in other.metrics().splitlines() if m.startswith("switchyard_journal")]
            raise AssertionError(f"{exc}\n" + "\n".join(metrics) + "\n" + other.tail(30)) from None
        assert other.metric("switchyard_journal_entries_applied_total", 'type="RouteRequest"') >= 8
        report = audit(bootstrap, prefix)
        assert report.ok, report.summary()
        assert len({(d["request_id"], d["outcome"]) for d in got}) == len(
            {(d["request_id"], d["outcome"], d["provider_id"]) for d in got})  # re-sent ones are identical
    finally:
        standby.stop()


def test_the_capacity_feed_is_published_per_model_when_it_changes(pipeline):
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    latest = wait_for(lambda: (f := [codec.decode(r.value)[1] for r in
                                     read_topic(bootstrap, prefix + "switchyard.capacity")])
                      and f[-1]["routable_providers"] == 3 and f, what="3 routable providers")[-1]
    assert latest["model"] == "gpt-oss-20b" and latest["remaining_concurrency"] > 0
    assert latest["estimated_ttft_ms"] > 0
    produce_events(bootstrap, prefix + "switchyard.requests", [(f"c{i}", "RouteRequest", request(f"c{i}"))
                                                               for i in range(4)])
    after = wait_for(lambda: (f := [codec.decode(r.value)[1] for r in
                                    read_topic(bootstrap, prefix + "switchyard.capacity")])
                     and f[-1]["remaining_concurrency"] < latest["remaining_concurrency"] and f,
                     what="the feed to shrink after reservations")
    assert all(f["model"] == "gpt-oss-20b" for f in after)


def test_an_exported_journal_audits_clean_from_the_file(pipeline, tmp_path):
    """`replay export` (with the recorded decisions) then `replay audit` on the file alone."""
    import subprocess
    import sys
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    produce_events(bootstrap, prefix + "switchyard.requests",
                   [(f"e{i}", "RouteRequest", request(f"e{i}", prompt=100 + 500 * i)) for i in range(12)])
    wait_for(lambda: len(decisions_of(bootstrap, prefix)) >= 12, what="12 decisions")
    out, avro = tmp_path / "journal.jsonl", tmp_path / "journal.avro"
    run = [sys.executable, "-m", "replay"]
    subprocess.run(run + ["export", "--bootstrap", bootstrap, "--topic", prefix + "switchyard.journal",
                          "--decisions-topic", prefix + "switchyard.decisions", "--out", str(out),
                          "--avro", str(avro)], check=True, capture_output=True)
    res = subprocess.run(run + ["audit", "--journal", str(out)], capture_output=True, text=True)
    assert res.returncode == 0 and "AUDIT OK" in res.stdout, res.stdout + res.stderr
    assert "identical: " in res.stdout and avro.stat().st_size > 0
    # the Avro container holds the same journal: the same decisions, and it audits clean against the topic
    for path in (out, avro):
        subprocess.run(run + ["run", "--journal", str(path), "--out", str(path) + ".decisions"], check=True,
                       capture_output=True)
    assert (tmp_path / "journal.avro.decisions").read_text() == (tmp_path / "journal.jsonl.decisions").read_text()
    res = subprocess.run(run + ["audit", "--journal", str(avro), "--bootstrap", bootstrap,
                                "--decisions-topic", prefix + "switchyard.decisions"], capture_output=True, text=True)
    assert res.returncode == 0 and "AUDIT OK" in res.stdout, res.stdout + res.stderr


def test_entries_applied_close_together_share_one_delta(pipeline):
    """Requests produced one at a time (each acknowledged by the broker before the next, so the
    worker appends and applies each on its own) are saved together: one delta per 25 ms of
    entries (`SAVE_EVERY_S`), not one per acknowledged batch. Nothing is lost for it: a graceful
    stop saves the open batch, so the restarted worker replays nothing from the journal."""
    bootstrap, prefix, worker = pipeline
    register_fleet(bootstrap, prefix, 3)
    produce_events(bootstrap, prefix + "switchyard.requests",
                   [(f"s{i}", "RouteRequest", request(f"s{i}")) for i in range(60)])
    wait_for(lambda: len({d["request_id"] for d in decisions_of(bootstrap, prefix)}) >= 60, what="60 answered")
    worker.stop()
    spans = [tuple(map(int, k[2:].split("-"))) for k in
             (json.loads(r.key) for r in read_topic(bootstrap, f"{worker.app_id}-core-changelog"))
             if k.startswith("d\x1f")]
    entries = max(last for _, last in spans) + 1
    assert entries >= 66, sorted(spans)  # 3 registrations, 3 heartbeats, 60 requests (+ ticks, config)
    assert len(spans) * 3 <= entries, f"{len(spans)} deltas for {entries} entries: {sorted(spans)}"
    worker.start()
    produce_events(bootstrap, prefix + "switchyard.requests", [("t0", "RouteRequest", request("t0"))])
    wait_for(lambda: any(d["request_id"] == "t0" for d in decisions_of(bootstrap, prefix)), what="t0 answered")
    assert worker.metric("switchyard_journal_entries_replayed_total") == 0
