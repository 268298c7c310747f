"""The core's state in a key → value table (the worker's Faust table on RocksDB + changelog), with
exactly-once effects under at-least-once delivery. Pure: works on any MutableMapping, so the
worker, the fault tests and unit tests share it.

Layout:
- the state keys of `streams.persistence` (`meta`, `p<SEP>…`, `r<SEP>…`, …) and the adapter's own
  keys (`reply<SEP>…`), each as of the last checkpoint;
- `ckpt`: the journal offset up to which those keys are complete;
- `d<SEP><slot>`: the delta of one applied entry {o: offset, changes: {key: value | None},
  outputs: [[topic, key b64, value b64], …]}, in slot `o % KEEP`, so the last KEEP entries are kept
  without deleting anything.

After each entry: one write, its delta. Every FLUSH_EVERY entries: the keys those entries changed
(merged, so a key changed many times is written once), then `ckpt`. That is about 2–3 writes per
entry instead of one per changed key plus a write-ahead record and an outbox record.

All writes go to one changelog partition in this order, so after a crash the table holds a prefix:
`load` re-applies every delta after `ckpt` (full values, so re-applying is idempotent) and keeps
their changes pending for the next flush. The deltas double as the outbox: Faust commits a journal
offset only after the producer flushed, so outputs of entries at or after the committed offset may
be lost with the process; on load they are re-sent from their deltas (identical bytes).
"""
from __future__ import annotations

import base64
from typing import Any, MutableMapping

from .persistence import SEP, export, restore

KEEP = 20_000        # deltas kept (the outbox window, in entries)
FLUSH_EVERY = 500    # entries between checkpoints of the keys
DELTA = "d" + SEP
CHECKPOINT = "ckpt"


def _encode(messages) -> list:
    return [(t, base64.b64encode(k).decode(), base64.b64encode(v).decode()) for t, k, v in messages]


def _decode(encoded) -> list[tuple[str, bytes, bytes]]:
    return [(t, base64.b64decode(k), base64.b64decode(v)) for t, k, v in encoded]


class CoreStore:
    def __init__(self, table: MutableMapping[str, Any]):
        self.table = table
        self.pending: dict[str, Any] = {}   # changes since the last checkpoint
        self.since_checkpoint = 0

    def _read(self) -> tuple[dict[str, Any], list[dict], dict[str, Any], int]:
        """(every key as of the last delta written, the deltas in offset order, the changes of the
        deltas after the checkpoint, how many those are)."""
        items = dict(self.table.items())
        checkpoint = items.pop(CHECKPOINT, -1)
        deltas = sorted((items.pop(k) for k in [k for k in items if k.startswith(DELTA)]), key=lambda d: d["o"])
        after = [d for d in deltas if d["o"] > checkpoint]  # not yet in the keys
        pending = {k: v for d in after for k, v in d["changes"].items()}
        for k, v in pending.items():
            if v is None:
                items.pop(k, None)
            else:
                items[k] = v
        return items, deltas, pending, len(after)

    def current(self) -> dict[str, Any]:
        """Every key as of the last delta written (the checkpointed keys, later deltas re-applied)."""
        return self._read()[0]

    def load(self):
        """(router, outbox, extra): the router as stored; the outbox as (offset, messages) in offset
        order; the adapter's own keys (not the core's) as {key: value}. The changes of the deltas
        after the checkpoint stay pending for the next checkpoint."""
        items, deltas, self.pending, self.since_checkpoint = self._read()
        state = [(k, v) for k, v in items.items() if not k.startswith("reply" + SEP)]
        extra = {k: v for k, v in items.items() if k.startswith("reply" + SEP)}
        outbox = [(d["o"], _decode(d["outputs"])) for d in deltas if d["outputs"]]
        return restore(state), outbox, extra

    def save(self, router, offset: int, messages, extra_changes: dict[str, Any] | None = None) -> None:
        """Record the entry at `offset`: the keys the router marked dirty, `extra_changes` (the
        adapter's keys), and the entry's output messages [(topic, key, value)]."""
        changes = export(router, router.take_dirty())
        if extra_changes:
            changes.update(extra_changes)
        self.table[f"{DELTA}{offset % KEEP}"] = {"o": offset, "changes": changes, "outputs": _encode(messages)}
        self.pending.update(changes)
        self.since_checkpoint += 1
        if self.since_checkpoint >= FLUSH_EVERY:
            self.checkpoint(offset)

    def checkpoint(self, offset: int) -> None:
        for k, v in self.pending.items():
            if v is None:
                if k in self.table:
                    del self.table[k]
            else:
                self.table[k] = v
        self.table[CHECKPOINT] = offset
        self.pending, self.since_checkpoint = {}, 0
