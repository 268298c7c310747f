"""Recent-serve counter for the satisficing band (domain §2.17): exponentially decayed per provider.

count = count · 2^(−Δt / half-life) + 1 on every reservation; reading decays the same way. Above
4,096 entries each record prunes other entries whose decayed value fell below 0.01 (rules §8).
Time is the journal's "now", passed in; nothing here reads a clock.
"""
from __future__ import annotations

HALF_LIFE_MS = 5 * 60 * 1000
PRUNE_ABOVE = 4096
PRUNE_BELOW = 0.01


class ServeCounter:
    __slots__ = ("entries", "dirty")

    def __init__(self):
        self.entries: dict[str, tuple[float, float]] = {}  # provider id -> (count, last_ms)
        self.dirty: set[str] = set()  # provider ids changed since the owner last persisted

    @staticmethod
    def _decayed(count: float, last: float, now: float) -> float:
        dt = now - last
        if dt <= 0:
            return count
        return count * 2.0 ** (-dt / HALF_LIFE_MS)

    def record(self, provider_id: str, now: float) -> float:
        count, last = self.entries.get(provider_id, (0.0, now))
        value = self._decayed(count, last, now) + 1.0
        self.entries[provider_id] = (value, now)
        self.dirty.add(provider_id)
        if len(self.entries) > PRUNE_ABOVE:
            for pid in [p for p, (c, t) in self.entries.items()
                        if p != provider_id and self._decayed(c, t, now) < PRUNE_BELOW]:
                del self.entries[pid]
                self.dirty.add(pid)
        return value

    def read(self, provider_id: str, now: float) -> float:
        entry = self.entries.get(provider_id)
        if entry is None:
            return 0.0
        return self._decayed(entry[0], entry[1], now)
