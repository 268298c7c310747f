"""The TPS registry (domain §2.4): three families of 50-sample FIFO rings with cached medians.

- load-inclusive decode, keyed (model, chip family): every observed decode EWMA;
- solo decode, keyed (model, chip class): only samples from an uncontended box (§2.5.2);
- prefill, keyed (model, chip class): observed prefill EWMAs that changed (§2.13.2).

Medians are kept up to date on record (a sorted copy beside the FIFO), so reading one is O(1):
the original service spent a large share of its scan copying and sorting ring samples.
"""
from __future__ import annotations

from bisect import insort, bisect_left
from collections import deque

RING_SIZE = 50


class SampleRing:
    """At most `size` positive samples, oldest evicted first; median of the sorted samples."""

    __slots__ = ("fifo", "ordered", "size", "_median")

    def __init__(self, size: int = RING_SIZE, samples=()):
        self.fifo: deque[float] = deque()
        self.ordered: list[float] = []
        self.size = size
        self._median = 0.0
        for s in samples:
            self.record(s)

    def record(self, value: float) -> bool:
        if not value > 0 or value == float("inf"):
            return False
        if len(self.fifo) >= self.size:
            old = self.fifo.popleft()
            del self.ordered[bisect_left(self.ordered, old)]
        self.fifo.append(value)
        insort(self.ordered, value)
        n = len(self.ordered)
        mid = n // 2
        self._median = self.ordered[mid] if n % 2 else (self.ordered[mid - 1] + self.ordered[mid]) / 2
        return True

    @property
    def median(self) -> float:
        return self._median

    def __len__(self) -> int:
        return len(self.fifo)

    def stats(self) -> tuple[float, int]:
        return (self._median, len(self.fifo))

    def samples(self) -> list[float]:
        return list(self.fifo)


class RingFamily:
    """Rings keyed by (model, chip key). Empty model ids and non-positive samples are ignored."""

    __slots__ = ("rings", "by_model", "versions", "dirty", "across")

    def __init__(self):
        self.dirty: set[tuple[str, str]] = set()  # rings changed since the owner last persisted
        self.rings: dict[tuple[str, str], SampleRing] = {}
        self.by_model: dict[str, dict[str, SampleRing]] = {}
        # model -> number of samples stored so far: a change marker for the candidate indexes
        self.versions: dict[str, int] = {}
        self.across: dict[str, tuple[int, tuple[float, int, int]]] = {}  # model -> (version, min_across_chips)

    def record(self, model: str, chip: str, value: float) -> bool:
        if not model or not value > 0:
            return False
        ring = self.rings.get((model, chip))
        if ring is None:
            ring = self.rings[(model, chip)] = SampleRing()
            self.by_model.setdefault(model, {})[chip] = ring
        if ring.record(value):
            self.versions[model] = self.versions.get(model, 0) + 1
            self.dirty.add((model, chip))
            return True
        return False

    def restore(self, model: str, chip: str, samples: list[float]) -> None:
        ring = self.rings[(model, chip)] = SampleRing(samples=samples)
        self.by_model.setdefault(model, {})[chip] = ring
        self.versions[model] = self.versions.get(model, 0) + len(ring)
        self.across.pop(model, None)

    def version(self, model: str) -> int:
        return self.versions.get(model, 0)

    def stats(self, model: str, chip: str) -> tuple[float, int]:
        ring = self.rings.get((model, chip))
        return ring.stats() if ring is not None else (0.0, 0)

    def median(self, model: str, chip: str) -> float:
        ring = self.rings.get((model, chip))
        return ring.median if ring is not None else 0.0

    def min_across_chips(self, model: str) -> tuple[float, int, int]:
        """(minimum of the positive per-chip medians, total samples, chips with a positive median);
        memoised per model version (a quality-cap refresh asks once per chip class)."""
        version = self.versions.get(model, 0)
        hit = self.across.get(model)
        if hit is not None and hit[0] == version:
            return hit[1]
        best, total, classes = 0.0, 0, 0
        for ring in self.by_model.get(model, {}).values():
            total += len(ring)
            m = ring.median
            if m > 0:
                classes += 1
                if best == 0.0 or m < best:
                    best = m
        self.across[model] = (version, (best, total, classes))
        return best, total, classes


class TpsRegistry:
    __slots__ = ("decode", "solo", "prefill")

    def __init__(self):
        self.decode = RingFamily()   # (model, family)
        self.solo = RingFamily()     # (model, class)
        self.prefill = RingFamily()  # (model, class)
