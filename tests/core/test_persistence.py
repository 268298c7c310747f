"""The core's state survives a round trip through key → value tables (streams/persistence.py): a
router restored from the keys written after each entry decides exactly like the one that never
stopped, and its state equals the original's, key by key."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings, strategies as st

from streams.persistence import export, restore, snapshot
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


def test_an_offline_router_keeps_no_changed_keys_and_decides_the_same():
    items = list(entries(journal(11, 12, 300)))
    tracked, offline = Router(), Router(track_changes=False)
    for offset, kind, record in items:
        assert offline.apply(offset, None, kind, dict(record)) == tracked.apply(offset, None, kind, dict(record))
    assert tracked.take_dirty()
    assert not offline.take_dirty()
    assert snapshot(offline) == snapshot(tracked)
