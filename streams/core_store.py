"""The core's state in a key → value table (the worker's Faust table on RocksDB + changelog), with
exactly-once effects under at-least-once delivery. Pure: works on any MutableMapping, so the
worker, the fault tests and unit tests share it.

Layout:
- the state keys of `streams.persistence` (`meta`, `p<SEP>…`, `r<SEP>…`, …) and the adapter's own
  keys (`reply<SEP>…`, `inputs`), each as of the last checkpoint that wrote it: {"o": that
  checkpoint's offset, "v": the value, or None for a deleted key (a marker, not a tombstone, so it
  has an offset too; markers older than KEEP entries are removed)};
- `ckpt`: the journal offset of the last checkpoint;
- `d<SEP><first>-<last>`: the delta of the batch of entries first..last, applied together
  {o: last, f: first, changes: {key: value | None}, outputs: [[offset, [[topic, key b64, value
  b64], …]], …], flushed: the offset up to which the writer knew every output was acknowledged};
  deltas more than KEEP entries older than a checkpoint are deleted by it;
- `flushed`: the same, written when a worker stops after flushing its producer.

Values are written as JSON bytes (`encode`) when the table is the worker's raw-valued Faust table:
Faust then passes them through to RocksDB and the changelog instead of serialising each write
twice. A plain dict of decoded values (the tests) uses the identity default.

After each batch of entries (the worker applies what the broker acknowledged together): one write,
its delta. Every FLUSH_EVERY entries a checkpoint starts: the keys those entries changed (merged, so
a key changed many times is written once), written a few per save (`checkpoint_writes`), then the
deltas and markers it makes obsolete are deleted, a few per save too, then `ckpt`. The worker does
a save's share in slices between which its loop runs (`save_batch(defer=True)`, `write_owed`).

Loading takes, for every key, the newest of its checkpointed value and the deltas that changed it
(a delta is newer when its last offset is above the key's "o"); deltas are full values, so
re-applying them is idempotent, and their changes stay pending for the next checkpoint. So after a
crash, when the table holds a prefix of the writes, the state is that of the last delta written. It
also undoes a stale write that lands late: a worker frozen with writes still buffered (SIGSTOP, a
VM pause) sends them when it wakes, after the new owner's, and the table keeps the last write of
each key; the deltas newer than the stale value's offset restore the key (docs/reliability.md, bug
8), as long as the stale write is less than KEEP entries old. A frozen worker's late delta has its
own key (its first..last), so it overwrites nothing the owner wrote (the same key means the same
entries, and so the same content: the core is deterministic), and it describes the state as of its
last entry as truly as the owner's do.

The deltas double as the outbox: outputs are sent before their delta is written, and the delta
records up to where the earlier outputs were acknowledged; on load, the outputs of the entries
after that are re-sent (identical bytes).
"""
from __future__ import annotations

import base64
import json
from typing import Any, Callable, MutableMapping

import orjson

from .persistence import SEP, export, restore

KEEP = 20_000        # entries whose deltas are kept after a checkpoint (the stale-write window)
FLUSH_EVERY = 5000   # entries between checkpoints of the keys
CHECKPOINT_WRITES = 32  # keys of a checkpoint in progress written per save, at least ...
CHECKPOINT_SPAN = FLUSH_EVERY // 2  # ... and enough to finish it within this many entries
DELTA = "d" + SEP
CHECKPOINT = "ckpt"
FLUSHED = "flushed"
ALL = 2**62          # "every write left"


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


def json_fragment(value: Any) -> Any:
    """A changed value encoded once, then embedded as is in the delta and, later, in its checkpoint
    write: not serialised twice, and not kept until the checkpoint as containers the garbage
    collector walks (they made its full collections take ~100 ms)."""
    return None if value is None else orjson.Fragment(json_bytes(value))


def _same(value: Any) -> Any:
    return value


class CoreStore:
    def __init__(self, table: MutableMapping[str, Any], encode: Callable[[Any], Any] = _same,
                 decode: Callable[[Any], Any] = _same, fragment: Callable[[Any], Any] = _same):
        self.table = table
        self.encode, self.decode, self.fragment = encode, decode, fragment
        self.pending: dict[str, Any] = {}   # changes since the last checkpoint
        self.since_checkpoint = 0           # entries
        self.markers: dict[str, int] = {}   # deleted key -> offset of the checkpoint that marked it
        self.deltas: dict[str, int] = {}    # delta key -> its last offset
        self.round: list[tuple[str, Any]] = []  # the checkpoint in progress: keys still to write
        self.round_offset = -1
        self.round_size = 0
        self.round_open = False
        self.removals: list[str] | None = None  # what it makes obsolete, once its keys are written
        self.owed = 0                        # checkpoint writes the saves so far asked for

    def _read(self):
        """(every key as of the last delta written, the deltas in offset order, the changes newer
        than the checkpointed keys, how many entries follow the checkpoint, the deletion markers,
        every delta key with its last offset, the flushed offset)."""
        items = {k: self.decode(v) for k, v in self.table.items()}
        checkpoint = items.pop(CHECKPOINT, -1)
        flushed = items.pop(FLUSHED, -1)
        all_deltas = {k: items.pop(k) for k in [k for k in items if k.startswith(DELTA)]}
        # A delta older than the checkpoint's window was due for deletion (a frozen worker's, landed
        # late): a key whose deletion marker is gone could come back from it.
        deltas = sorted((d for d in all_deltas.values() if d["o"] >= checkpoint - KEEP), key=lambda d: d["o"])
        version = {k: v["o"] for k, v in items.items()}
        values = {k: v["v"] for k, v in items.items()}
        pending: dict[str, Any] = {}
        for d in deltas:
            o = d["o"]
            flushed = max(flushed, d.get("flushed", -1))
            for k, v in d["changes"].items():
                if o > version.get(k, -1):
                    version[k] = o
                    values[k] = pending[k] = v
        markers = {k: v["o"] for k, v in items.items() if v["v"] is None}
        current = {k: v for k, v in values.items() if v is not None}
        since = sum(d["o"] - max(d.get("f", d["o"]), checkpoint + 1) + 1 for d in deltas if d["o"] > checkpoint)
        return current, deltas, pending, since, markers, {k: d["o"] for k, d in all_deltas.items()}, flushed

    @classmethod
    def of_json(cls, table: MutableMapping[str, Any]) -> "CoreStore":
        """A store whose table holds JSON bytes (the worker's raw-valued Faust table)."""
        return cls(table, encode=json_bytes, decode=json.loads, fragment=json_fragment)

    def current(self) -> dict[str, Any]:
        """Every key as of the last delta written (the checkpointed keys, newer deltas re-applied)."""
        return self._read()[0]

    def load(self):
        """(router, outbox, extra): the router as stored; the outbox, the outputs not known to be
        acknowledged, as (offset, messages) in offset order; the adapter's own keys (not the
        core's) as {key: value}. The changes newer than the checkpointed keys stay pending for the
        next checkpoint."""
        items, deltas, self.pending, self.since_checkpoint, self.markers, self.deltas, flushed = self._read()
        self.round = []
        state = [(k, v) for k, v in items.items() if not _adapter_key(k)]
        extra = {k: v for k, v in items.items() if _adapter_key(k)}
        outbox = [(o, _decode(encoded)) for d in deltas for o, encoded in d["outputs"] if encoded and o > flushed]
        return restore(state), outbox, extra

    def save(self, router, offset: int, messages, extra_changes: dict[str, Any] | None = None) -> None:
        """Record the one entry at `offset` (see `save_batch`)."""
        self.save_batch(router, offset, offset, [(offset, messages)], extra_changes)

    def save_batch(self, router, first: int, last: int, outputs, extra_changes: dict[str, Any] | None = None,
                   flushed: int = -1, defer: bool = False) -> None:
        """Record the entries first..last, applied since the last save: the keys the router marked
        dirty, `extra_changes` (the adapter's keys), the entries' output messages as [(offset,
        [(topic, key, value)])], and the offset up to which earlier outputs were acknowledged.
        With `defer`, the checkpoint writes this save owes are left to `write_owed`."""
        changes = export(router, router.take_dirty())
        if extra_changes:
            changes.update(extra_changes)
        changes = {k: self.fragment(v) for k, v in changes.items()}
        key = f"{DELTA}{first}-{last}"
        self.table[key] = self.encode({"o": last, "f": first, "changes": changes, "flushed": flushed,
                                       "outputs": [(o, _encode(m)) for o, m in outputs if m]})
        self.deltas[key] = last
        self.pending.update(changes)
        self.since_checkpoint += last - first + 1
        if not self.round_open and self.since_checkpoint >= FLUSH_EVERY:
            self._start_checkpoint(last)
        if self.round_open:  # paced by entries; a whole checkpoint's worth behind: finish it now
            self.owed = ALL if self.since_checkpoint >= FLUSH_EVERY else \
                self.owed + self.checkpoint_writes(last - first + 1)
        if not defer:
            self.write_owed()

    def write_owed(self, limit: int | None = None) -> int:
        """Do up to `limit` (default: all) of the checkpoint writes the saves asked for; returns how
        many are still owed."""
        n = self.owed if limit is None else min(limit, self.owed)
        self.owed -= n
        self._write_checkpoint(n)
        if not self.round_open:
            self.owed = 0
        return self.owed

    def checkpoint_writes(self, entries: int) -> int:
        """Keys of the checkpoint in progress to write after a batch of `entries`: paced by entries,
        not saves, so that it ends within CHECKPOINT_SPAN entries however the entries are batched
        (a round left unfinished when the next is due is written at once: a stall of ~100 ms)."""
        return max(CHECKPOINT_WRITES, -(-self.round_size * entries // CHECKPOINT_SPAN))

    def mark_flushed(self, offset: int) -> None:
        """Every output up to `offset` was acknowledged (a worker stopping after its last flush)."""
        self.table[FLUSHED] = self.encode(offset)

    def checkpoint(self, offset: int) -> None:
        """Write every key changed since the last checkpoint, at once."""
        self._write_checkpoint(ALL)
        self._start_checkpoint(offset)
        self._write_checkpoint(ALL)
        self.owed = 0

    def _start_checkpoint(self, offset: int) -> None:
        self.round, self.round_offset = list(self.pending.items()), offset
        self.round_size, self.round_open = len(self.round), True
        self.pending, self.since_checkpoint = {}, 0

    def _write_checkpoint(self, n: int) -> None:
        """Do n more writes of the checkpoint in progress: its keys (their values as of its offset:
        the deltas after it stay until it is complete), then the removal of the deltas and markers
        it makes obsolete, then `ckpt`. Spread over saves, a checkpoint of thousands of keys does
        not stall the entries behind it."""
        offset = self.round_offset
        while n > 0 and self.round:
            k, v = self.round.pop()
            self.table[k] = self.encode({"o": offset, "v": v})
            if v is None:
                self.markers[k] = offset
            else:
                self.markers.pop(k, None)
            n -= 1
        if self.round or not self.round_open:
            return
        if self.removals is None:
            # A marker or a delta older than the window can go: no delta left could resurrect its key.
            self.removals = [k for k, o in self.markers.items() if o < offset - KEEP]
            for k in self.removals:
                del self.markers[k]
            old = [k for k, o in self.deltas.items() if o < offset - KEEP]
            for k in old:
                del self.deltas[k]
            self.removals += old
        while n > 0 and self.removals:
            self._remove(self.removals.pop())
            n -= 1
        if self.removals:
            return
        self.removals, self.round_open = None, False
        self.table[CHECKPOINT] = self.encode(offset)

    def _remove(self, k: str) -> None:
        # Not `pop`: a mapping's pop reads the value first (a RocksDB read of a whole delta).
        try:
            del self.table[k]
        except KeyError:
            pass


def _adapter_key(k: str) -> bool:
    return k.startswith("reply" + SEP) or k in (INPUTS, WORKER_SETTINGS)


INPUTS = "inputs"  # the adapter's input positions: {"topic<SEP>partition": offset of the last appended}
WORKER_SETTINGS = "worker_settings"  # the settings the last worker recorded at its start
