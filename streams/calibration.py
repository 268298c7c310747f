"""Online TTFT calibrator (domain §2.13.3, rules §7, decision §8.6).

Ratios actual / raw-prediction are kept in 200-sample windows keyed by (model, chip family, prefill
source) and (model, prefill source), so ratios learned against the static chain never scale a
newly trusted median. The applied ratio is the (model, family, source) median once it has 50
observations, else the (model, source) median at 50, else 1.0; clamped to [0.2, 1.5].
"""
from __future__ import annotations

from collections import OrderedDict

from .rings import SampleRing

WINDOW = 200
CHUNK = 25  # samples per stored piece of a window: a completion rewrites one piece, not 200 samples
WARM_UP = 50
RATIO_MIN, RATIO_MAX = 0.2, 1.5
PREDICTION_TTL_MS = 10 * 60 * 1000
MAX_PREDICTIONS = 8192
# Predictions are stored in pieces by insertion sequence number, [n·PIECE, (n+1)·PIECE) (about 20
# at 1000 requests/s): one in its own key was written in a delta at the decision, again at its
# completion, then as a checkpoint's deletion marker, then removed — most of a checkpoint's writes.
PIECE = 64


class TtftCalibrator:
    __slots__ = ("by_family", "by_model", "recorded", "predictions", "observations", "seq", "dirty", "versions")

    def __init__(self):
        self.by_family: dict[tuple[str, str, str], SampleRing] = {}
        self.by_model: dict[tuple[str, str], SampleRing] = {}
        # ("cw", *key) / ("cm", *key) -> samples ever recorded in that window: sample n is stored in
        # piece n // CHUNK (streams/persistence.py)
        self.recorded: dict[tuple, int] = {}
        # (request_id, attempt) -> (model, family, source, raw_ms, at_ms); insertion = time order
        self.predictions: OrderedDict[tuple[str, int], tuple[str, str, str, float, float]] = OrderedDict()
        self.observations = 0
        # insertion order of predictions, for restore: the router's persisted sequence number, so a
        # restored router numbers new predictions exactly as one that never stopped
        self.seq: dict[tuple[str, int], int] = {}
        self.dirty: set[tuple] = set()  # ("cw", model, family, source, piece) / ("cm", ...) / ("cpb", piece)
        # model -> prefill source -> observations since this object was built: a cache key for
        # the fast path's ratio columns (ratio(model, ·, source) reads only the windows of that
        # model and source), not state
        self.versions: dict[str, dict[str, int]] = {}

    def ratio(self, model: str, family: str, source: str) -> float:
        ring = self.by_family.get((model, family, source))
        if ring is None or len(ring) < WARM_UP:
            ring = self.by_model.get((model, source))
            if ring is None or len(ring) < WARM_UP:
                return 1.0
        return min(RATIO_MAX, max(RATIO_MIN, ring.median))

    @staticmethod
    def apply(raw: float, state_penalty: float, ratio: float) -> float:
        if raw <= 0 or ratio == 1.0:
            return raw
        if 0 <= state_penalty < raw:
            return state_penalty + (raw - state_penalty) * ratio
        return raw

    def note_prediction(self, key: tuple[str, int], model: str, family: str, source: str,
                        raw: float, now: float, seq: int) -> None:
        self.forget(key)
        self.predictions[key] = (model, family, source, raw, now)
        self.seq[key] = seq
        self.dirty.add(("cpb", seq // PIECE))
        while len(self.predictions) > MAX_PREDICTIONS:
            self.forget(next(iter(self.predictions)))

    def forget(self, key: tuple[str, int]):
        note = self.predictions.pop(key, None)
        if note is not None:
            self.dirty.add(("cpb", self.seq.pop(key) // PIECE))
        return note

    def observe(self, key: tuple[str, int], actual_ms: float, now: float) -> bool:
        """Feed one measured TTFT; True if it reached a window."""
        note = self.forget(key)
        if note is None or not actual_ms > 0 or actual_ms == float("inf"):
            return False
        model, family, source, raw, at = note
        if now - at >= PREDICTION_TTL_MS or raw <= 0:
            return False
        ratio = actual_ms / raw
        for table, k, tag in ((self.by_family, (model, family, source), "cw"),
                              (self.by_model, (model, source), "cm")):
            ring = table.get(k)
            if ring is None:
                ring = table[k] = SampleRing(WINDOW)
            if ring.record(ratio):
                n = self.recorded.get((tag, *k), 0)
                self.recorded[(tag, *k)] = n + 1
                self.dirty.add((tag, *k, n // CHUNK))
                gone = n - WINDOW  # the sample this one pushed out; its piece is gone when it was the last
                if gone >= 0 and gone % CHUNK == CHUNK - 1:
                    self.dirty.add((tag, *k, gone // CHUNK))
        self.observations += 1
        counts = self.versions.setdefault(model, {})
        counts[source] = counts.get(source, 0) + 1
        return True
