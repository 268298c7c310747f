"""The core's state survives a round trip through key → value tables (streams/persistence.py): a
router restored from the keys written after each entry decides exactly like the one that never
stopped, and its state equals the original's, key by key."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings, strategies as st

from streams.persistence import SEP, export, restore, snapshot
from streams.router import Router
from tests.core.test_fast_path import journal


def entries(lines):
    for offset, line in enumerate(lines):
        record = dict(line)
        kind = record.pop("type")
        if kind != "CalibratorSeed":  # a test-only shortcut into the calibrator, not a journal entry
            yield offset, kind, record


def save(router: Router, table: dict) -> None:
    """What the worker does after each entry: write the changed keys (as JSON), delete the gone."""
    for k, v in export(router, router.take_dirty()).items():
        if v is None:
            table.pop(k, None)
        else:
            table[k] = json.loads(json.dumps(v))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_providers=st.integers(2, 8), steps=st.integers(5, 80),
       cut_fraction=st.floats(0, 1))
@example(seed=39, n_providers=4, steps=80, cut_fraction=0.2)  # the newest TTFT prediction observed before the cut
def test_a_restored_router_continues_exactly_like_the_original(seed, n_providers, steps, cut_fraction):
    items = list(entries(journal(seed, n_providers, steps)))
    cut = int(cut_fraction * (len(items) - 1))
    original, table = Router(), {}
    for offset, kind, record in items[:cut + 1]:
        original.apply(offset, None, kind, dict(record))
        save(original, table)
    restored = restore(table.items())
    assert json.loads(json.dumps(snapshot(restored))) == json.loads(json.dumps(snapshot(original)))
    for offset, kind, record in items[cut + 1:]:
        assert restored.apply(offset, None, kind, dict(record)) == original.apply(offset, None, kind, dict(record))
    assert restored.counters == original.counters
    assert snapshot(restored) == snapshot(original)


def test_an_entry_writes_only_a_few_keys():
    items = list(entries(journal(7, 40, 300)))
    router, table, widths = Router(), {}, []
    for offset, kind, record in items:
        router.apply(offset, None, kind, dict(record))
        widths.append(len(router.dirty))
        save(router, table)
    assert max(widths) < 40 and sum(widths) / len(widths) < 8
    assert len(table) > 50


def test_requests_and_completions_write_reservations_not_the_provider_row():
    """The provider row (≈ 0.8 KB, the heartbeat's view) is not rewritten for every reservation: a
    routed request and its completion change only the provider's `pd` key (and the row only when
    the provider's status goes from idle to serving)."""
    items = list(entries(journal(7, 40, 300)))
    router, kinds = Router(), {"RouteRequest": [], "Completion": []}
    for offset, kind, record in items:
        before = {pid: p.status for pid, p in router.providers.items()}
        outputs = router.apply(offset, None, kind, dict(record))
        written = {k.split(SEP)[0] for k in router.take_dirty()}
        routed = [r for name, r in outputs if name == "RouteDecision" and r["outcome"] == "routed"]
        if kind == "Completion" and "pd" in written:
            kinds[kind].append("p" in written)
        elif routed and kind == "RouteRequest":
            pid = routed[0]["provider_id"]
            assert "pd" in written
            kinds[kind].append("p" in written and before.get(pid) == router.providers[pid].status)
    assert len(kinds["RouteRequest"]) > 20 and len(kinds["Completion"]) > 10
    assert not any(kinds["RouteRequest"]) and not any(kinds["Completion"])


def test_an_offline_router_keeps_no_changed_keys_and_decides_the_same():
    items = list(entries(journal(11, 12, 300)))
    tracked, offline = Router(), Router(track_changes=False)
    for offset, kind, record in items:
        assert offline.apply(offset, None, kind, dict(record)) == tracked.apply(offset, None, kind, dict(record))
    assert tracked.take_dirty()
    assert not offline.take_dirty()
    assert snapshot(offline) == snapshot(tracked)


def test_calibrator_windows_are_stored_in_pieces_that_restore_the_window():
    """A completion rewrites one piece of CHUNK samples of each window it feeds, not the whole
    200-sample window; the pieces a saved table holds restore each window exactly, at any point
    of its filling and sliding (pieces that left the window are deleted)."""
    from streams.calibration import CHUNK, WINDOW
    router, table = Router(), {}
    router.apply(0, 1000, "Tick", {"at_ms": 1000})  # a state to restore (meta)
    save(router, table)
    widths = []
    for n in range(2 * WINDOW + 3 * CHUNK + 7):
        key = (f"r{n}", 0)
        router.calibrator.note_prediction(key, "m", "M4", "static", 1000.0, 0.0, n)
        assert router.calibrator.observe(key, 500.0 + (n * 37) % 400, 1.0)
        changes = export(router, router.take_dirty())
        widths.append(max(len(v or []) for k, v in changes.items() if k.startswith("c")))
        for k, v in changes.items():
            if v is None:
                table.pop(k, None)
            else:
                table[k] = json.loads(json.dumps(v))
        restored = restore(table.items())
        for kind, ring_key in (("cw", ("m", "M4", "static")), ("cm", ("m", "static"))):
            table_of = (lambda r: r.calibrator.by_family) if kind == "cw" else (lambda r: r.calibrator.by_model)
            assert table_of(restored)[ring_key].samples() == table_of(router)[ring_key].samples()
            assert restored.calibrator.recorded[(kind, *ring_key)] == n + 1
        assert snapshot(restored) == snapshot(router)
    assert max(widths) <= CHUNK
    assert sum(k.startswith("cw") for k in table) == len(range((2 * WINDOW + 3 * CHUNK + 7 - WINDOW) // CHUNK,
                                                               (2 * WINDOW + 3 * CHUNK + 6) // CHUNK + 1))


def test_a_provider_row_saved_with_its_reservations_inside_still_restores_them():
    """State saved before reservations had their own `pd` key (a worker upgraded in place) keeps
    its reservations: the row's old "pending" field is read when there is no `pd` key."""
    items = list(entries(journal(7, 40, 300)))
    router = Router()
    for offset, kind, record in items:
        router.apply(offset, None, kind, dict(record))
    old = snapshot(router)
    held = [k for k in old if k.startswith("pd" + SEP)]
    assert held
    for k in held:
        old[k.replace("pd", "p", 1)]["pending"] = old.pop(k)
    assert snapshot(restore(old.items())) == snapshot(router)


def test_dedup_windows_are_stored_in_pieces_that_restore_them_while_they_slide(monkeypatch):
    """Event and request ids are stored in pieces of DEDUP_BUCKET sequence numbers (`eb`, `rqb`),
    not one key per id. With windows small enough to slide (ids dropped at the old end while new
    ones arrive at the other), a table saved after every entry restores both windows exactly, a
    router restored from it continues exactly like the original, and the table holds a few
    pieces."""
    from streams import router as router_module
    monkeypatch.setattr(router_module, "EVENT_DEDUP_WINDOW", 9)
    monkeypatch.setattr(router_module, "REQUEST_DEDUP_WINDOW", 5)
    items = list(entries(journal(5, 6, 400)))
    cut = 2 * len(items) // 3
    router, table = Router(), {}
    for i, (offset, kind, record) in enumerate(items[:cut]):
        router.apply(offset, None, kind, dict(record))
        save(router, table)
        if i % 20 == 0 or i == cut - 1:
            restored = restore(table.items())
            assert list(restored.seen_events.items()) == list(router.seen_events.items())
            assert list(restored.seen_requests.items()) == list(router.seen_requests.items())
    assert len(router.seen_events) == 9 and len(router.seen_requests) == 5  # both slid
    kinds = [k.split(SEP)[0] for k in table]
    assert "e" not in kinds and "rq" not in kinds
    assert 2 <= kinds.count("eb") + kinds.count("rqb") <= 6
    for offset, kind, record in items[cut:]:
        assert restored.apply(offset, None, kind, dict(record)) == router.apply(offset, None, kind, dict(record))
    assert snapshot(restored) == snapshot(router)


def test_ids_saved_in_their_own_keys_still_restore_and_move_into_pieces():
    """State saved before the dedup windows were stored in pieces (a key per id: `e<SEP>id`,
    `rq<SEP>id<SEP>attempt`) restores the same windows, and the next save moves the ids into
    their pieces and deletes their old keys."""
    items = list(entries(journal(7, 10, 200)))
    router = Router()
    for offset, kind, record in items:
        router.apply(offset, None, kind, dict(record))
    router.take_dirty()
    table = json.loads(json.dumps(snapshot(router)))
    for k in [k for k in table if k.split(SEP)[0] in ("eb", "rqb")]:
        for *ident, seq in table.pop(k):
            table[SEP.join(["e" if k.startswith("eb") else "rq", *map(str, ident)])] = seq
    assert sum(k.startswith("rq" + SEP) for k in table) > 20
    restored = restore(table.items())
    assert snapshot(restored) == snapshot(router)
    save(restored, table)
    assert not [k for k in table if k.split(SEP)[0] in ("e", "rq")]
    assert snapshot(restore(table.items())) == snapshot(router)


def test_predictions_are_stored_in_pieces_that_restore_them_while_they_come_and_go(monkeypatch):
    """TTFT predictions wait for their completions in pieces of calibration.PIECE sequence numbers
    (`cpb`), not one key per request (which cost every request a write in its decision's delta, in
    its completion's, a checkpoint's deletion marker and the marker's removal). Noted, observed in
    any order, some never and evicted when too many wait: a table saved after each step restores
    the predictions exactly and in order, and holds exactly the pieces that still have one."""
    import random

    from streams import calibration
    monkeypatch.setattr(calibration, "MAX_PREDICTIONS", 40)
    router, table = Router(), {}
    router.apply(0, 1000, "Tick", {"at_ms": 1000})
    save(router, table)
    rng, waiting, seq = random.Random(3), [], 0
    for n in range(900):
        seq += rng.randint(1, 7)
        key = (f"r{n}", n % 3)
        router.calibrator.note_prediction(key, f"m{n % 2}", "M4", "static", 1000.0 + n, float(n), seq)
        waiting.append(key)
        while waiting and rng.random() < 0.45:  # completions, mostly of the older predictions
            done = waiting.pop(min(len(waiting) - 1, int(rng.expovariate(0.3))))
            router.calibrator.observe(done, 800.0, float(n))
        save(router, table)
        if n % 50 == 0 or n == 899:
            restored = restore(table.items())
            assert list(restored.calibrator.predictions.items()) == list(router.calibrator.predictions.items())
            assert list(restored.calibrator.seq.items()) == list(router.calibrator.seq.items())
            assert snapshot(restored) == snapshot(router)
    assert len(router.calibrator.predictions) == 40  # evictions happened
    pieces = {k for k in table if k.startswith("cpb" + SEP)}
    assert pieces == {f"cpb{SEP}{s // calibration.PIECE}" for s in router.calibrator.seq.values()}
    assert len(pieces) < 40 and not [k for k in table if k.startswith("cp" + SEP)]


def test_predictions_saved_in_their_own_keys_still_restore_and_move_into_pieces():
    """State saved before the predictions were stored in pieces (`cp<SEP>request<SEP>attempt`)
    restores the same predictions, and the next save moves them into pieces, deleting the old keys."""
    items = list(entries(journal(7, 10, 200)))
    router = Router()
    for offset, kind, record in items:
        router.apply(offset, None, kind, dict(record))
    for n in range(30):  # predictions still waiting for their completions
        router.calibrator.note_prediction((f"w{n}", 0), "m", "M4", "static", 900.0, 1.0, router.seq + 2 * n)
    router.take_dirty()
    table = json.loads(json.dumps(snapshot(router)))
    for k in [k for k in table if k.startswith("cpb" + SEP)]:
        for rid, attempt, *note in table.pop(k):
            table[SEP.join(["cp", rid, str(attempt)])] = note
    assert sum(k.startswith("cp" + SEP) for k in table) >= 30
    restored = restore(table.items())
    assert snapshot(restored) == snapshot(router)
    save(restored, table)
    assert not [k for k in table if k.startswith("cp" + SEP)]
    assert snapshot(restore(table.items())) == snapshot(router)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(gaps=st.lists(st.integers(1, 12), min_size=0, max_size=300), start=st.integers(0, 200),
       wanted=st.sets(st.integers(0, 60), max_size=12))
def test_a_window_piece_holds_exactly_its_ids_in_order_from_either_end(gaps, start, wanted):
    """`_window_pieces` reads each piece from the nearer end of the window; whatever the pieces
    asked for, each holds exactly the ids numbered in its range, oldest first."""
    from collections import OrderedDict

    from streams.persistence import DEDUP_BUCKET, _window_pieces
    window, seq = OrderedDict(), start
    for i, gap in enumerate(gaps):
        seq += gap
        window[f"id{i}"] = seq
    got = _window_pieces(window, wanted)
    assert got == {n: [(k, s) for k, s in window.items() if s // DEDUP_BUCKET == n] for n in wanted}
