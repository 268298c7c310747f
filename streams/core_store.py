"""The core's state in a key → value table (the worker's Faust table on RocksDB + changelog), with
exactly-once effects under at-least-once delivery. Pure: works on any MutableMapping, so the
worker, the fault tests and unit tests share it.

Layout:
- the state keys of `streams.persistence` (`meta`, `p<SEP>…`, `r<SEP>…`, …) and the adapter's own
  keys (`reply<SEP>…`), each as of the last checkpoint that wrote it: {"o": that checkpoint's
  offset, "v": the value, or None for a deleted key (a marker, not a tombstone, so it has an offset
  too; markers older than KEEP entries are removed)};
- `ckpt`: the journal offset of the last checkpoint;
- `d<SEP><slot>`: the delta of one applied entry {o: offset, changes: {key: value | None},
  outputs: [[topic, key b64, value b64], …]}, in slot `o % KEEP`, so the last KEEP entries are kept
  without deleting anything.

Values are written as JSON bytes (`encode`) when the table is the worker's raw-valued Faust table:
Faust then passes them through to RocksDB and the changelog instead of serialising each write
twice. A plain dict of decoded values (the tests) uses the identity default.

After each entry: one write, its delta. Every FLUSH_EVERY entries: the keys those entries changed
(merged, so a key changed many times is written once), then `ckpt`. That is about 2–3 writes per
entry instead of one per changed key plus a write-ahead record and an outbox record.

Loading takes, for every key, the newest of its checkpointed value and the deltas that changed it
(a delta is newer when its offset is above the key's "o"); deltas are full values, so re-applying
them is idempotent, and their changes stay pending for the next checkpoint. So after a crash, when
the table holds a prefix of the writes, the state is that of the last delta written. It also
undoes a stale write that lands late: a worker frozen with writes still buffered (SIGSTOP, a VM
pause) sends them when it wakes, after the new owner's, and the table keeps the last write of each
key; the deltas newer than the stale value's offset restore the key (docs/reliability.md, bug 8),
as long as the stale write is less than KEEP entries old.

The deltas double as the outbox: Faust commits a journal offset only after the producer flushed,
so outputs of entries at or after the committed offset may be lost with the process; on load they
are re-sent from their deltas (identical bytes).
"""
from __future__ import annotations

import base64
import json
from typing import Any, Callable, MutableMapping

import orjson

from .persistence import SEP, export, restore

KEEP = 20_000        # deltas kept (the outbox window, in entries)
FLUSH_EVERY = 500    # entries between checkpoints of the keys
DELTA = "d" + SEP
CHECKPOINT = "ckpt"


def _encode(messages) -> list:
    return [(t, base64.b64encode(k).decode(), base64.b64encode(v).decode()) for t, k, v in messages]


def _decode(encoded) -> list[tuple[str, bytes, bytes]]:
    return [(t, base64.b64decode(k), base64.b64decode(v)) for t, k, v in encoded]


def json_bytes(value: Any) -> bytes:
    """Compact JSON. orjson is several times faster than `json` on these values (a heartbeat's
    delta is ≈ 1.6 KB); the state holds no NaN or Inf (the core clamps them away), the one case
    where the two libraries write different values. Anything orjson refuses goes through `json`."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


def _same(value: Any) -> Any:
    return value


class CoreStore:
    def __init__(self, table: MutableMapping[str, Any], encode: Callable[[Any], Any] = _same,
                 decode: Callable[[Any], Any] = _same):
        self.table = table
        self.encode, self.decode = encode, decode
        self.pending: dict[str, Any] = {}   # changes since the last checkpoint
        self.since_checkpoint = 0
        self.markers: dict[str, int] = {}   # deleted key -> offset of the checkpoint that marked it

    def _read(self) -> tuple[dict[str, Any], list[dict], dict[str, Any], int, dict[str, int]]:
        """(every key as of the last delta written, the deltas in offset order, the changes newer
        than the checkpointed keys, how many deltas follow the checkpoint, the deletion markers)."""
        items = {k: self.decode(v) for k, v in self.table.items()}
        checkpoint = items.pop(CHECKPOINT, -1)
        deltas = sorted((items.pop(k) for k in [k for k in items if k.startswith(DELTA)]), key=lambda d: d["o"])
        version = {k: v["o"] for k, v in items.items()}
        values = {k: v["v"] for k, v in items.items()}
        pending: dict[str, Any] = {}
        for d in deltas:
            o = d["o"]
            for k, v in d["changes"].items():
                if o > version.get(k, -1):
                    version[k] = o
                    values[k] = pending[k] = v
        markers = {k: v["o"] for k, v in items.items() if v["v"] is None}
        current = {k: v for k, v in values.items() if v is not None}
        return current, deltas, pending, sum(d["o"] > checkpoint for d in deltas), markers

    def current(self) -> dict[str, Any]:
        """Every key as of the last delta written (the checkpointed keys, newer deltas re-applied)."""
        return self._read()[0]

    def load(self):
        """(router, outbox, extra): the router as stored; the outbox as (offset, messages) in offset
        order; the adapter's own keys (not the core's) as {key: value}. The changes newer than the
        checkpointed keys stay pending for the next checkpoint."""
        items, deltas, self.pending, self.since_checkpoint, self.markers = self._read()
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
        self.table[f"{DELTA}{offset % KEEP}"] = self.encode(
            {"o": offset, "changes": changes, "outputs": _encode(messages)})
        self.pending.update(changes)
        self.since_checkpoint += 1
        if self.since_checkpoint >= FLUSH_EVERY:
            self.checkpoint(offset)

    def checkpoint(self, offset: int) -> None:
        for k, v in self.pending.items():
            self.table[k] = self.encode({"o": offset, "v": v})
            if v is None:
                self.markers[k] = offset
            else:
                self.markers.pop(k, None)
        # A marker older than every kept delta can go: no delta left could resurrect its key.
        for k in [k for k, o in self.markers.items() if o < offset - KEEP]:
            self.table.pop(k, None)
            del self.markers[k]
        self.table[CHECKPOINT] = self.encode(offset)
        self.pending, self.since_checkpoint = {}, 0
