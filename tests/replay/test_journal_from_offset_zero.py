"""A replay starts from the initial state, so it refuses a journal that does not begin at offset 0
(entries deleted by retention, or an export of a window) instead of reporting other decisions."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from streams import codec
from streams.jsonl import read_journal
from tests.replay.test_replay_cli import EXAMPLES, lines, replay

JOURNAL = EXAMPLES / "dedicated-cap-sheds.jsonl"


def _with_offsets(tmp_path, first: int):
    """The example journal as an export writes it (each line with its journal_offset), from `first`."""
    rows = [json.loads(x) for x in JOURNAL.read_text().splitlines() if x.strip()]
    path = tmp_path / f"from-{first}.jsonl"
    path.write_text("".join(json.dumps({**row, "journal_offset": i}) + "\n" for i, row in enumerate(rows) if i >= first))
    return path


def test_a_file_from_offset_zero_replays_and_one_without_its_first_entries_is_refused(tmp_path):
    whole = replay("run", "--journal", _with_offsets(tmp_path, 0), "--out", tmp_path / "d0.jsonl")
    assert len(lines(tmp_path / "d0.jsonl")) == 4, whole.stderr
    for command in (["run", "--out", tmp_path / "d3.jsonl"], ["explain", "r4"], ["what-if", "--quiet",
                    "--set", "SATISFICING_BAND=true", "--report", tmp_path / "w.md"]):
        res = replay(*command, "--journal", _with_offsets(tmp_path, 3), check=False)
        assert res.returncode == 2 and "begins at offset 3, not 0" in res.stderr, (command, res.stderr)


def test_lines_the_reader_skips_at_the_start_do_not_count_as_missing_entries(tmp_path):
    journal = tmp_path / "j.jsonl"  # no journal_offset: a line's offset is its index, skipped or not
    journal.write_text('not json\n{"type": "Mystery"}\n' + JOURNAL.read_text())
    res = replay("run", "--journal", journal, "--out", tmp_path / "d.jsonl")
    assert "bad_json" in res.stderr and len(lines(tmp_path / "d.jsonl")) == 4


async def _produce_then_delete(bootstrap: str, topic: str, delete_before: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for entry in read_journal(JOURNAL):
            await producer.send_and_wait(topic, codec.encode(entry.type, entry.record), key=b"default", partition=0)
    finally:
        await producer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:  # what retention.ms does to a journal's oldest segment
        await admin.delete_records({TopicPartition(topic, 0): RecordsToDelete(delete_before)})
    finally:
        await admin.close()


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_kafka_journal_whose_first_entries_were_deleted_is_refused_and_its_export_says_so(kafka_bootstrap, tmp_path):
    topic = f"t{uuid.uuid4().hex[:8]}.switchyard.journal"
    asyncio.run(_produce_then_delete(kafka_bootstrap, topic, 0))
    res = replay("run", "--bootstrap", kafka_bootstrap, "--topic", topic, "--out", tmp_path / "d.jsonl")
    assert len(lines(tmp_path / "d.jsonl")) == 4, res.stderr

    first = 2 * len(list(read_journal(JOURNAL))) - 3  # a second copy, and all but its last 3 entries deleted
    asyncio.run(_produce_then_delete(kafka_bootstrap, topic, first))
    res = replay("run", "--bootstrap", kafka_bootstrap, "--topic", topic, "--out", tmp_path / "d2.jsonl", check=False)
    assert res.returncode == 2 and f"{topic} partition 0 begins at offset {first}, not 0" in res.stderr, res.stderr

    exported = tmp_path / "export.jsonl"
    res = replay("export", "--bootstrap", kafka_bootstrap, "--topic", topic, "--out", exported)
    assert f"note: the journal begins at offset {first}" in res.stderr
    res = replay("audit", "--journal", exported, check=False)
    assert res.returncode == 2 and f"begins at offset {first}, not 0" in res.stderr, res.stderr
