"""The routing core's state as fine-grained key → value pairs, for Faust tables (RocksDB + changelog).

The router marks the keys an entry changed (`Router.take_dirty`); `export` turns them into JSON-able
values (None = delete); `restore` rebuilds a Router from every stored pair. One journal entry writes
a few keys: `meta` (time, offset, config, counters), the providers it touched (`p`, the heartbeat's
view; `pd`, the reservations, which every request and completion changes), the ring windows it
fed, the newest piece of a dedup window, and — for a decision — the serve counter, the newest piece
of the calibrator's predictions, the affinity entry and the queue of the model. Derived structures
(per-model candidate lists, the fast path's columns, reservation owners, pools) are rebuilt on
restore, not stored.

The dedup windows (event ids, request ids) are stored in pieces by insertion sequence number
(`eb`, `rqb`: the ids numbered in [n·DEDUP_BUCKET, (n+1)·DEDUP_BUCKET)): an id in its own key was
written once in a delta, once in a checkpoint, once as a deletion marker when the window dropped
it, and removed — four table writes per request and per completion, for keys read only on restore.
The calibrator's pending predictions are stored the same way (`cpb`, by `calibration.PIECE`).

Order-sensitive maps (liveness, dedup windows, affinity, calibrator predictions) store the sequence
number of their last insertion, so a restored router evicts and expires in exactly the same order.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from operator import attrgetter
from typing import Any, Iterable

from .calibration import CHUNK, PIECE, WINDOW
from .config import Config
from .provider import Backend, ModelEntry, Pool, ProviderState, Slot
from .rings import SampleRing

SEP = "\x1f"
SLOT_FIELDS = tuple(Slot.__dataclass_fields__)
PROVIDER_FIELDS = ("provider_id", "session", "registered_at_ms", "version", "account_id", "trust",
                   "private_only", "chip_name", "family", "chip_class", "memory_gb", "bandwidth_gbs",
                   "decode_tps", "prefill_tps", "last_seen", "last_seq", "status", "memory_pressure",
                   "cpu_usage", "thermal")
RING_FAMILIES = ("decode", "solo", "prefill")
# A heartbeat rewrites its provider's row: its fields are read in C, not one getattr at a time.
_provider_values, _slot_values = attrgetter(*PROVIDER_FIELDS), attrgetter(*SLOT_FIELDS)
DEDUP_BUCKET = 64  # sequence numbers per stored piece of a dedup window (~20 ids at 1000 requests/s)
WINDOWS = {"eb": "seen_events", "rqb": "seen_requests"}  # piece kind -> the router's window
PIECED = {*WINDOWS, "cpb"}  # kinds stored in pieces of sequence numbers (`_pieced`)


def key(*parts) -> str:
    return SEP.join(map(str, parts))


# --- export ---------------------------------------------------------------------------------------
def export(router, keys: Iterable[str]) -> dict[str, Any]:
    out, pieces = {}, {}
    for k in keys:
        kind, _, rest = k.partition(SEP)
        if kind in PIECED:
            pieces.setdefault(kind, {})[int(rest)] = k
        else:
            out[k] = export_key(router, k)
    for kind, wanted in pieces.items():
        window, size, stored = _pieced(router, kind)
        for n, entries in _window_pieces(window, wanted, size).items():
            out[wanted[n]] = [stored(k, seq) for k, seq in entries] or None
    return out


def _pieced(router, kind: str):
    """(its id -> seq map in insertion order, seqs per piece, an entry's stored form) of a kind
    stored in pieces."""
    if kind == "cpb":
        cal = router.calibrator  # its seq map holds the predictions in insertion order
        return cal.seq, PIECE, lambda k, seq: [*k, *cal.predictions[k], seq]
    return getattr(router, WINDOWS[kind]), DEDUP_BUCKET, \
        lambda k, seq: [*k, seq] if isinstance(k, tuple) else [k, seq]


def _window_pieces(window: dict, wanted, size: int = DEDUP_BUCKET) -> dict[int, list]:
    """The entries (id, seq) of the pieces `wanted` of a window (a dedup window, the calibrator's
    predictions: id -> seq, `size` seqs per piece). Its order is insertion order,
    so its sequence numbers ascend, and each piece is read from the nearer end of the window: a
    save asks for the newest pieces (and the oldest, when the window is full), so it reads about
    as many entries as those pieces hold, not the window (100,000 ids)."""
    out = {n: [] for n in wanted}
    if not window:
        return out
    oldest, newest = next(iter(window.values())), next(reversed(window.values()))
    newer, older = [], []
    for n in wanted:
        (newer if newest - n * size <= (n + 1) * size - oldest else older).append(n)
    if newer:
        stop = min(newer) * size
        for k, seq in reversed(window.items()):
            if seq < stop:
                break
            found = out.get(seq // size)
            if found is not None:
                found.append((k, seq))
        for n in newer:
            out[n].reverse()
    if older:
        stop = (max(older) + 1) * size
        for k, seq in window.items():
            if seq >= stop:
                break
            found = out.get(seq // size)
            if found is not None:
                found.append((k, seq))
    return out


def export_key(router, k: str) -> Any:
    kind, *rest = k.split(SEP)
    if kind == "meta":
        return {"now": router.now, "offset": router.offset, "seq": router.seq,
                "settings": dict(router.config.raw), "counters": dict(router.counters),
                "tripwires": dict(router.tripwires)}
    if kind == "p":
        p = router.providers.get(rest[0])
        return None if p is None else _provider(p, router.liveness_seq.get(p.provider_id, 0))
    if kind == "pd":  # a provider's reservations: their own key, as requests and completions change them
        p = router.providers.get(rest[0])
        return [[k[0], k[1], v.model, v.tokens, v.reserved_at_ms] for k, v in p.pending.items()] \
            if p is not None and p.pending else None
    if kind == "r":
        family, model, chip = rest
        ring = getattr(router.rings, family).rings.get((model, chip))
        return None if ring is None else ring.samples()
    if kind in ("cw", "cm"):  # one piece of a calibrator window: samples n in [piece·CHUNK, +CHUNK)
        *ring_key, piece = rest
        ring = (router.calibrator.by_family if kind == "cw" else router.calibrator.by_model).get(tuple(ring_key))
        if ring is None:
            return None
        base = router.calibrator.recorded[(kind, *ring_key)] - len(ring)  # number of the oldest sample
        lo, hi = max(0, int(piece) * CHUNK - base), (int(piece) + 1) * CHUNK - base
        return ring.samples()[lo:hi] if hi > lo else None
    if kind == "s":
        entry = router.serves.entries.get(rest[0])
        return None if entry is None else list(entry)
    if kind == "a":
        hit = router.affinity.get(tuple(rest))
        return None if hit is None else [*hit, router.affinity_seq.get(tuple(rest), 0)]
    if kind == "q":
        q = router.queues.get(rest[0])
        return [[_request(item.request), item.enqueued_at_ms] for item in q] if q else None
    if kind in PIECED:
        return export(router, [k])[k]
    if kind in ("e", "rq", "cp"):  # an id in its own key (before the pieces): moved into its piece on load
        return None
    raise KeyError(k)


def _provider(p: ProviderState, seen_seq: int) -> dict:
    out = dict(zip(PROVIDER_FIELDS, _provider_values(p)))
    out["seen_seq"] = seen_seq
    out["models"] = {m: [e.size_gb, e.min_ram_gb, e.is_vision] for m, e in p.models.items()}
    out["warm_models"] = list(p.warm_models)
    out["last_prefill"] = dict(p.last_prefill)
    b = p.backend
    out["backend"] = None if b is None else {
        "total_memory_gb": b.total_memory_gb, "gpu_memory_active_gb": b.gpu_memory_active_gb,
        "free_for_load_gb": b.free_for_load_gb,
        "slots": [list(_slot_values(s)) for s in b.slots]}
    return out


def _request(r) -> dict:
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    d["allowed"], d["excluded"] = sorted(r.allowed), sorted(r.excluded)
    return d


def snapshot(router) -> dict[str, Any]:
    """Every key of the state (tests compare a restored router's snapshot with the original's)."""
    return export(router, all_keys(router))


def all_keys(router) -> list[str]:
    keys = ["meta"]
    keys += [key("p", pid) for pid in router.providers]
    keys += [key("pd", pid) for pid, p in router.providers.items() if p.pending]
    for family in RING_FAMILIES:
        keys += [key("r", family, m, c) for (m, c) in getattr(router.rings, family).rings]
    for kind, table in (("cw", router.calibrator.by_family), ("cm", router.calibrator.by_model)):
        for k, ring in table.items():
            total = router.calibrator.recorded[(kind, *k)]
            keys += [key(kind, *k, piece) for piece in range((total - len(ring)) // CHUNK, (total - 1) // CHUNK + 1)]
    keys += [key("cpb", n) for n in sorted({seq // PIECE for seq in router.calibrator.seq.values()})]
    keys += [key("s", pid) for pid in router.serves.entries]
    keys += [key("a", *k) for k in router.affinity]
    keys += [key("q", m) for m, q in router.queues.items() if q]
    for kind, name in WINDOWS.items():
        keys += [key(kind, n) for n in sorted({seq // DEDUP_BUCKET for seq in getattr(router, name).values()})]
    return keys


# --- restore --------------------------------------------------------------------------------------
def restore(items: Iterable[tuple[str, Any]], fast: bool = True):
    from .router import Queued, Request, Router  # the router imports this module

    stored = {k: v for k, v in items if v is not None}
    meta = stored.get("meta")
    router = Router(Config(meta["settings"]) if meta else Config(), fast=fast)
    if meta is None:
        return router
    router.now, router.offset, router.seq = meta["now"], meta["offset"], meta["seq"]
    router.counters, router.tripwires = Counter(meta["counters"]), Counter(meta["tripwires"])
    providers, events, requests, affinity, predictions, legacy = [], [], [], [], [], []
    reservations = {k.split(SEP)[1]: v for k, v in stored.items() if k.startswith("pd" + SEP)}
    pieces: dict[tuple, dict[int, list]] = {}
    for k, v in stored.items():
        kind, *rest = k.split(SEP)
        if kind == "p":
            # a row saved before reservations had their own key carries them as "pending"
            pending = reservations.get(rest[0], v.get("pending", ()))
            providers.append((v["seen_seq"], _restore_provider(v, pending)))
        elif kind == "r":
            family, model, chip = rest
            getattr(router.rings, family).restore(model, chip, v)
        elif kind in ("cw", "cm"):
            *ring_key, piece = rest
            pieces.setdefault((kind, *ring_key), {})[int(piece)] = v
        elif kind == "cpb":
            predictions += [(seq, (rid, attempt), tuple(note)) for rid, attempt, *note, seq in v]
        elif kind == "cp":  # saved before the predictions were stored in pieces
            predictions.append((v[-1], (rest[0], int(rest[1])), tuple(v[:-1])))
            legacy.append(("cp", rest[0], rest[1]))
        elif kind == "s":
            router.serves.entries[rest[0]] = tuple(v)
        elif kind == "a":
            affinity.append((v[2], tuple(rest), (v[0], v[1])))
        elif kind == "q":
            router.queues[rest[0]] = deque(Queued(Request(**_request_fields(r)), t) for r, t in v)
        elif kind == "eb":
            events += [(seq, e) for e, seq in v]
        elif kind == "rqb":
            requests += [(seq, (rid, attempt)) for rid, attempt, seq in v]
        elif kind == "e":  # saved before the windows were stored in pieces
            events.append((v, rest[0]))
            legacy.append(("e", rest[0]))
        elif kind == "rq":
            requests.append((v, (rest[0], int(rest[1]))))
            legacy.append(("rq", rest[0], rest[1]))
    for seq, p in sorted(providers, key=lambda sp: sp[0]):
        router.add_restored_provider(p, seq)
    for seq, k, note in sorted(predictions):
        router.calibrator.predictions[k] = note
        router.calibrator.seq[k] = seq
    router.calibrator.observations = meta["counters"].get("calibrator_observations", 0)
    for (kind, *ring_key), by_piece in sorted(pieces.items()):
        # contiguous pieces up to the newest, which is never partly out of the window
        last = max(by_piece)
        samples = [x for piece in sorted(by_piece) for x in by_piece[piece]]
        table = router.calibrator.by_family if kind == "cw" else router.calibrator.by_model
        table[tuple(ring_key)] = SampleRing(WINDOW, samples=samples[-WINDOW:])
        router.calibrator.recorded[(kind, *ring_key)] = last * CHUNK + len(by_piece[last])
    for seq, k, hit in sorted(affinity):
        router.affinity[k] = hit
        router.affinity_seq[k] = seq
    router.seen_events = OrderedDict((e, seq) for seq, e in sorted(events))
    router.seen_requests = OrderedDict((k, seq) for seq, k in sorted(requests))
    router.dirty.clear()
    if legacy:  # ids saved in their own keys move into their pieces at the next save
        router.dirty.update(legacy)
        router.dirty.update(("eb", seq // DEDUP_BUCKET) for seq, _ in events)
        router.dirty.update(("rqb", seq // DEDUP_BUCKET) for seq, _ in requests)
        router.dirty.update(("cpb", seq // PIECE) for seq, _, _ in predictions)
    return router


def _request_fields(d: dict) -> dict:
    d = dict(d)
    d["allowed"], d["excluded"] = frozenset(d["allowed"]), frozenset(d["excluded"])
    return d


def _restore_provider(v: dict, pending) -> ProviderState:
    p = ProviderState.__new__(ProviderState)
    for f in PROVIDER_FIELDS:
        setattr(p, f, v[f])
    p.models = {m: ModelEntry(*e) for m, e in v["models"].items()}
    p.warm_models = tuple(v["warm_models"])
    p.last_prefill = dict(v["last_prefill"])
    p.pending, p.pending_by_model, p.pending_tokens_by_model, p.pending_tokens_all = {}, {}, {}, 0
    for rid, attempt, model, tokens, at in pending:
        p.add_pending((rid, attempt), model, tokens, at)
    b = v["backend"]
    if b is None:
        p.backend = None
    else:
        slots = [Slot(*s) for s in b["slots"]]
        by_model: dict = {}
        for s in slots:
            by_model.setdefault(s.model, s)
        p.backend = Backend(total_memory_gb=b["total_memory_gb"], gpu_memory_active_gb=b["gpu_memory_active_gb"],
                            free_for_load_gb=b["free_for_load_gb"], slots=slots, by_model=by_model,
                            pool=Pool.from_slots(slots), any_budget=any(s.budget_max > 0 for s in slots))
    return p
