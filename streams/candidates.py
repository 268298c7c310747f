"""The fast path of the candidate scan (domain §2.12): per-model candidate indexes whose columns hold,
for every provider advertising the model, the request-independent part of its evaluation, so a
decision is one call of compiled loops over the columns (streams/scan_kernel.py) instead of a
Python loop over candidates.

Layout. One `ModelIndex` per model that has been decided at least once: rows in ascending provider
id (the scan order of rules §2), columns in three 2-D arrays (float64 `F`, int64 `I`, bool `B`,
each `[column, row]` so a column is contiguous). Provider-level values that change with every
reservation (pending count, pooled free budget) live in fleet-wide arrays indexed by a provider
slot number (`gidx`) and are gathered per decision, so a reservation touches O(1) cells.

Keeping it current:
- a heartbeat rebuilds that provider's rows (scalar, with the same functions the scalar path
  uses) in every index that exists — only rows whose slot or box-level inputs changed;
- a reservation or release updates the provider's fleet-wide cells and its row for that model;
- a provider joining or leaving (or a new session) marks the indexes of its models for a re-layout
  (done lazily at the next decision; rows of unchanged providers are kept);
- the fleet decode medians and the calibrator ratios are small tables per index (by family, and
  by family and prefill source) that the scan reads through each row's codes; they, and the
  columns that read the prefill medians and the solo rates (the quality cap), are refreshed before
  a scan when the ring family's per-model version (for the ratios: the model's observation count
  per prefill source) moved since the last refresh;
- a config change drops every index (rebuilt on the next decision for each model).

Exactness. Request-dependent arithmetic is element-wise IEEE float64 in the formulas' written
order (rules §2): numpy's and the compiled loops' +, −, ×, ÷ on float64 (no fast-math, so no
reordering or fused multiply-add) round exactly like Python floats, so the fast path
gives bit-identical TTFT and cost. Integer admissions are exact int64 comparisons (`used + tokens ≤ max` ⇔
`tokens ≤ max − used`; pooled `… + tokens·rate ≤ total` ⇔ `tokens·rate ≤ free`, no overflow for
tokens < 2^32 and rate ≤ 2^24). The only reductions are min / argmin /
counts, which do not depend on the order of evaluation; argmin and the near-tie walk pick the
first row in provider order, as the scalar path does. Anything outside the ranges where this
reasoning holds (huge token counts, non-finite costs, values beyond int64, caps the scalar code
could not compute) falls back to the scalar path — the reference, and the path `explain` traces.
tests/core/test_fast_path.py checks that both paths give identical outputs on random journals.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np

from . import admission as adm
from . import estimates as est
from .provider import TRUST_RANK
from .versions import compare_versions

BIG = 1 << 62                # "no limit" for integer thresholds
TOKEN_LIMIT = 1 << 31        # the fast path handles prompt and max_tokens below this
SOURCES = ("observed", "median", "anchor", "static")
SRC = {s: i for i, s in enumerate(SOURCES)}
NEAR_TIE_MS = 3_000.0
NO_ROWS = np.zeros(0, dtype=bool)  # no allowed/excluded mask
NO_OBSERVATIONS: dict = {}
ONE_RATIO = np.ones((1, len(SOURCES)))  # the ratio table before the first refresh (or uncalibrated)
NO_MEDIANS = np.zeros(0)

# float columns
(F_PEN, F_KQ, F_EFF, F_PF, F_PFT, F_SPF, F_HEALTH, F_PROJ, F_STATIC_EFF, F_FB_PF,
 F_SOLO_STATIC, F_CPEN, F_LM_L, F_LM_B, F_LM_SIZE, F_LM_TOTAL) = range(16)
NF = 16
# int columns
(I_GIDX, I_LOAD, I_CAP, I_BOXMAX, I_BASE, I_EQ, I_W, I_THR, I_RATE, I_BLNUM, I_BLWAIT, I_BLPOT,
 I_BLPEND, I_FAM, I_CLS, I_SRC, I_FBSRC, I_VER, I_ACCT, I_BMAX) = range(20)
NI = 20
# bool columns
(B_PREPUB, B_GATEPUB, B_GATEOWN, B_GATESELF, B_OKSTATE, B_VISION, B_HASMC, B_TL, B_KVS, B_HASBC,
 B_NOBC, B_LOADED, B_EFFRING, B_PFRING, B_DECPOS, B_LM, B_LMUNL, B_LMFFL, B_LMFFLOK) = range(19)
NB = 19


def _clip(v: int) -> int:
    """A threshold in int64: beyond ±2^62 only its sign matters (tokens < 2^32 here)."""
    return BIG if v > BIG else -BIG if v < -BIG else v


def _exact(v: int) -> int:
    """A value used in arithmetic: must fit exactly, else the index gives up (scalar path)."""
    if -BIG <= v <= BIG:
        return v
    raise OverflowError("value out of the fast path's range")


class ModelIndex:
    """The candidate columns of one model."""

    __slots__ = ("model", "n", "pids", "provs", "row_of", "F", "I", "B", "layout_dirty", "broken",
                 "fam_codes", "fams", "cls_codes", "classes", "ver_codes", "acct_codes",
                 "seen_decode", "seen_prefill", "seen_solo", "seen_calib", "ratio_table",
                 "decode_medians",
                 "floor", "pattern", "solo_rates", "solo_rates_version", "out", "stale")

    def __init__(self, model: str):
        self.model = model
        self.n = 0
        self.pids: list[str] = []
        self.provs: list = []
        self.row_of: dict[str, int] = {}
        self.F = np.zeros((NF, 0))
        self.I = np.zeros((NI, 0), dtype=np.int64)
        self.B = np.zeros((NB, 0), dtype=bool)
        self.layout_dirty = True
        self.broken = False
        self.fam_codes: dict[str, int] = {}
        self.fams: list[str] = []
        self.cls_codes: dict[str, int] = {}
        self.classes: list[str] = []
        self.ver_codes: dict[str, int] = {}
        self.acct_codes: dict[str, int] = {}
        self.seen_decode = self.seen_prefill = self.seen_solo = -1
        self.seen_calib: dict | None = None  # calibrator versions per source, as of ratio_table
        self.ratio_table = ONE_RATIO  # calibrator ratio per (family code, source), read by the scan
        self.decode_medians = NO_MEDIANS  # fleet decode median per family code, read by the scan
        self.floor = None
        self.pattern = None
        self.solo_rates: dict[str, float | None] = {}  # chip class -> class_solo_tps, for row builds
        self.solo_rates_version = -1
        self.out = _scan_buffers(0)
        # providers whose rows changed since the index was last read: rebuilt then, once however
        # many heartbeats came in between (a dict: rebuilt in a deterministic order)
        self.stale: dict[str, None] = {}

    @staticmethod
    def code(table: dict, names: list | None, key: str) -> int:
        c = table.get(key)
        if c is None:
            c = table[key] = len(table)
            if names is not None:
                names.append(key)
        return c


class ScanBuffers(NamedTuple):
    """What a scan and a selection write per row, reused by every decision of the index (a result
    is read only while its decision is made)."""
    npend: np.ndarray       # pending reservations of the row's provider
    owned: np.ndarray       # bool: the requester's account owns the provider
    admitted: np.ndarray    # bool
    cand: np.ndarray        # bool: admitted and within the TTFT gate
    pool: np.ndarray        # bool: the candidates left after narrowing
    raw: np.ndarray         # raw TTFT
    ttft: np.ndarray        # calibrated TTFT
    cost: np.ndarray
    equivalent: np.ndarray  # int: the head holds the rows tied for the win


def _scan_buffers(n: int) -> ScanBuffers:
    i, b, f = np.empty((2, n), dtype=np.int64), np.empty((4, n), dtype=bool), np.empty((3, n))
    return ScanBuffers(i[0], b[0], b[1], b[2], b[3], f[0], f[1], f[2], i[1])


class FastScan:
    """What the fast scan found: the counters of `Scan`, plus the columns selection needs."""

    __slots__ = ("candidates", "capacity_rejections", "too_large", "ttft_rejections", "best_ttft",
                 "best_source", "has_ttft", "affinity_pid", "ix", "adm", "cand", "cost", "ttft", "raw",
                 "npend", "owned", "_admitted")

    def __init__(self, ix=None):
        self.candidates = range(0)
        self.capacity_rejections = self.too_large = self.ttft_rejections = 0
        self.best_ttft = 0.0
        self.best_source = "none"
        self.has_ttft = True
        self.affinity_pid = None
        self.ix = ix
        self.adm = self.cand = self.cost = self.ttft = self.raw = self.npend = self.owned = None
        self._admitted = None

    def candidate_fields(self, i: int) -> dict:
        """The `Candidate` of row i (the winner), as the scalar scan would have built it."""
        ix = self.ix
        p = ix.provs[i]
        has_bc = p.backend is not None
        f, n = ix.F[:, i].tolist(), ix.I[:, i].tolist()  # one conversion each, not one per cell
        return dict(
            p=p, slot=p.backend.by_model.get(ix.model) if has_bc else None, cost=self.cost.item(i),
            ttft=self.ttft.item(i) if has_bc else 0.0, raw_ttft=self.raw.item(i),
            prefill_source=SOURCES[n[I_SRC]] if has_bc else "none", penalty=f[F_PEN],
            eff_queue=n[I_EQ], total_pending=self.npend.item(i),
            projected_tps=f[F_PROJ], health=f[F_HEALTH])

    @property
    def admitted(self) -> list:
        """(provider, slot) pairs that passed admission, in scan order (for the shadow telemetry)."""
        if self._admitted is None:
            out = []
            if self.adm is not None:
                model = self.ix.model
                for i in np.flatnonzero(self.adm).tolist():
                    p = self.ix.provs[i]
                    out.append((p, p.backend.by_model.get(model) if p.backend is not None else None))
            self._admitted = out
        return self._admitted


class FastPath:
    """Fleet-wide provider cells plus the per-model indexes, owned by one `Router`."""

    def __init__(self, router):
        self.router = router
        self.indexes: dict[str, ModelIndex] = {}
        self.stats: Counter = Counter()  # scans served / declined (diagnostics, not decisions)
        self.gidx: dict[str, int] = {}
        self.free: list[int] = []
        cap = 64
        self.npend = np.zeros(cap, dtype=np.int64)
        self.pool = np.full(cap, BIG, dtype=np.int64)
        self.pooled = np.zeros(cap, dtype=bool)  # per slot: the box reports a KV pool (pool.total > 0)
        self.byte = [False] * cap  # per slot: pooled budget counted in bytes (not read by the kernels)
        # provider id -> its `_provider_view`, shared by its rows in every index until it changes
        self.views: dict[str, tuple] = {}

    # === maintenance ============================================================================
    def reset(self) -> None:
        """Config changed: every index is rebuilt on its model's next decision."""
        self.indexes.clear()
        self.views.clear()

    def provider_added(self, p) -> None:
        self.views.pop(p.provider_id, None)
        if self.free:
            g = self.free.pop()
        else:
            g = len(self.gidx)
            if g >= len(self.npend):
                n = 2 * len(self.npend)
                self.npend = np.resize(self.npend, n)
                self.pool = np.resize(self.pool, n)
                self.pooled = np.resize(self.pooled, n)
                self.byte += [False] * (n - len(self.byte))
        self.gidx[p.provider_id] = g
        self._provider_cells(p, g)
        for model in p.models:
            ix = self.indexes.get(model)
            if ix is not None:
                ix.layout_dirty = True

    def provider_removed(self, p) -> None:
        self.views.pop(p.provider_id, None)
        g = self.gidx.pop(p.provider_id, None)
        if g is not None:
            self.free.append(g)
        for model in p.models:
            ix = self.indexes.get(model)
            if ix is not None:
                ix.layout_dirty = True

    @staticmethod
    def snapshot(p) -> tuple:
        """What a heartbeat may change that rows depend on (taken before the heartbeat applies)."""
        return (p.backend, p.status, p.thermal, p.memory_pressure, p.cpu_usage)

    def provider_changed(self, p, before: tuple | None = None) -> None:
        """A heartbeat changed the provider's state: its rows are stale — only those whose inputs
        changed when `before` (a `snapshot`) is given. Ring- and calibrator-derived columns are
        refreshed per index anyway, so a row whose slot and box-level inputs are unchanged stays."""
        g = self.gidx.get(p.provider_id)
        if g is None:
            return
        if self._provider_cells(p, g):
            before = None  # byte/token accounting flipped: every row's rate changes
        old = None
        if before is not None:
            b_old, b_new = before[0], p.backend
            if before[1:] == (p.status, p.thermal, p.memory_pressure, p.cpu_usage) and (
                    (b_old is None and b_new is None) or (
                        b_old is not None and b_new is not None
                        and b_old.total_memory_gb == b_new.total_memory_gb
                        and b_old.gpu_memory_active_gb == b_new.gpu_memory_active_gb
                        and b_old.free_for_load_gb == b_new.free_for_load_gb
                        and b_old.any_budget == b_new.any_budget
                        and b_old.pool.max_rate == b_new.pool.max_rate)):
                old = b_old
                if b_old is None:
                    return  # legacy before and after, same metrics: nothing a row reads changed
        self._mark_stale(p, old)

    def pending_changed(self, p, model: str) -> None:
        """A reservation was added to or removed from the provider (for `model`)."""
        g = self.gidx.get(p.provider_id)
        if g is None:
            return
        if self._provider_cells(p, g):  # byte/token accounting flipped: every row's rate changes
            self._mark_stale(p)
            return
        ix = self.indexes.get(model)
        if ix is None or ix.broken:  # a dirty layout is still the current one
            return
        i = ix.row_of.get(p.provider_id)
        if i is None or ix.provs[i] is not p:
            return
        slot = p.backend.by_model.get(model) if p.backend is not None else None
        pbm = p.pending_by_model.get(model, 0)
        ptbm = p.pending_tokens_by_model.get(model, 0)
        rw = slot.num_running + slot.num_waiting if slot is not None else 0
        waiting = slot.num_waiting if slot is not None else 0
        eq = max(pbm, rw)
        F, I = ix.F, ix.I
        if slot is not None and slot.max_concurrency > 0:
            I[I_LOAD, i] = eq
        I[I_EQ, i] = eq
        F[F_KQ, i] = F.item(F_PEN, i) + est.QUEUE_MS * eq
        I[I_W, i] = waiting + max(0, pbm - rw)
        if slot is not None and slot.budget_max > 0:
            uq = slot.budget_used + slot.queued_budget
            committed = max(0, max(uq, slot.max_tokens_potential))
            I[I_THR, i] = _clip(slot.budget_max - uq - max(0, ptbm - committed))
        else:
            potential = slot.max_tokens_potential if slot is not None else 0
            try:
                I[I_BLNUM, i] = _exact(potential + max(0, ptbm - potential))
                I[I_BLPEND, i] = _exact(ptbm)
            except OverflowError:
                ix.broken = True

    def _provider_cells(self, p, g: int) -> bool:
        """Refresh the fleet-wide cells of a provider; True if its byte-mode flag changed."""
        self.npend[g] = len(p.pending)
        b = p.backend
        byte = False
        pooled = b is not None and b.pool.total > 0
        self.pooled[g] = pooled
        if not pooled:
            free = BIG
        else:
            pool = b.pool
            pending_bytes = p.pending_bytes()
            if pool.byte_mode and pending_bytes is not None:
                byte = True
                free = pool.total_bytes - pool.used_bytes - max(0, pending_bytes - pool.committed_bytes)
            else:
                free = pool.total - pool.used - max(0, p.pending_tokens_all - pool.committed)
        self.pool[g] = _clip(free)
        flipped = self.byte[g] != byte
        self.byte[g] = byte
        return flipped

    def _mark_stale(self, p, old_backend=None) -> None:
        """p's rows are to be rebuilt when their index is next read; with `old_backend` (same
        box-level inputs), only the rows whose slot changed. A heartbeat backlog, or a model
        nobody asks for, costs a row rebuild per read of the index, not per heartbeat."""
        self.views.pop(p.provider_id, None)
        new_slots = p.backend.by_model if p.backend is not None else None
        for model in p.models:
            ix = self.indexes.get(model)
            if ix is None or ix.broken:
                continue
            if old_backend is not None and old_backend.by_model.get(model) == new_slots.get(model):
                continue
            ix.stale[p.provider_id] = None

    def _rebuild_stale(self, ix: ModelIndex) -> None:
        providers, views = self.router.providers, self.views
        for pid in ix.stale:
            i = ix.row_of.get(pid)
            p = providers.get(pid)
            if i is not None and ix.provs[i] is p:
                pv = views.get(pid)
                if pv is None:
                    pv = views[pid] = self._provider_view(p)
                self._write_row(ix, i, p, pv)
        ix.stale.clear()

    # --- rows -------------------------------------------------------------------------------------
    def _provider_view(self, p) -> tuple:
        c = self.router.config
        return (p.box_max_concurrency(c), est.health_ms(p), p.static_decode_tps(),
                p.static_prefill_tps(c), min(p.static_prefill_tps(c), c.max_prefill_tps),
                p.total_memory_gb(), TRUST_RANK[p.trust] >= TRUST_RANK[c.min_trust],
                p.status == "draining", p.thermal == "critical", self.byte[self.gidx[p.provider_id]])

    def _write_row(self, ix: ModelIndex, i: int, p, pv: tuple) -> None:
        try:
            f, n, b = self._row(ix, p, pv)
        except (ArithmeticError, ValueError):  # e.g. a cap the scalar path cannot compute either
            ix.broken = True
            return
        ix.F[:, i] = f
        ix.I[:, i] = n
        ix.B[:, i] = b

    def _row(self, ix: ModelIndex, p, pv: tuple) -> tuple[tuple, tuple, tuple]:
        r = self.router
        c, rings, model = r.config, r.rings, ix.model
        box_max, health, static_decode, static_prefill, spf, total, trust_ok, draining, critical, byte = pv
        b = p.backend
        slot = b.by_model.get(model) if b is not None else None
        state = slot.state if slot is not None else "unknown"
        pen = est.state_penalty(state)
        loaded = slot is not None and slot.loaded
        okstate = state not in ("crashed", "reloading")
        # gates (domain §2.2): public / owner (trust relaxed) / owner self-route
        floor = ix.floor
        vfloor_ok = floor is None or bool(p.version and compare_versions(p.version, floor) >= 0)
        pattern = ix.pattern
        ded_ok = pattern is None or not any(pattern not in m.lower() for m in p.models)
        gate_own = not draining and not p.private_only and ded_ok and vfloor_ok
        gate_pub = gate_own and trust_ok
        gate_self = not draining and vfloor_ok
        entry = p.models[model]
        # concurrency
        has_mc = slot is not None and slot.max_concurrency > 0
        base = slot.max_concurrency if has_mc else box_max
        if c.quality_cap:
            v = rings.solo.version(model)
            if v != ix.solo_rates_version:
                ix.solo_rates.clear()
                ix.solo_rates_version = v
            rates = ix.solo_rates
            if p.chip_class in rates:
                class_rate = rates[p.chip_class]
            else:
                class_rate = rates[p.chip_class] = adm.class_solo_tps(model, p.chip_class, c, rings)
            cap = adm.cap_for_class_rate(p, model, base, class_rate, c)
        else:
            cap = base
        rw = slot.num_running + slot.num_waiting if slot is not None else 0
        waiting = slot.num_waiting if slot is not None else 0
        pbm = p.pending_by_model.get(model, 0)
        ptbm = p.pending_tokens_by_model.get(model, 0)
        eq = max(pbm, rw)
        toolarge = not loaded and not adm.hardware_fits(p, model)
        # KV admission thresholds
        budget = slot is not None and slot.budget_max > 0
        if budget:
            uq = slot.budget_used + slot.queued_budget
            committed = max(0, max(uq, slot.max_tokens_potential))
            thr = _clip(slot.budget_max - uq - max(0, ptbm - committed))
            blnum, blwait, blpot, blpend = _exact(uq), 0, 0, 0
        else:
            thr = BIG
            potential = slot.max_tokens_potential if slot is not None else 0
            blnum = _exact(potential + max(0, ptbm - potential))
            blwait, blpot, blpend = waiting, potential, _exact(ptbm)
        rate = 1
        if byte:
            rate = slot.kv_bytes_per_token if slot is not None and slot.kv_bytes_per_token > 0 else b.pool.max_rate
        size = entry.size_gb
        lm = not budget and size > 0 and total > 0
        ffl = b.free_for_load_gb if b is not None else None
        lm_ffl = ffl is not None
        lm_fflok = lm_ffl and size * 1.2 * (1e9 / adm.GIB) <= ffl
        active = b.gpu_memory_active_gb if b is not None else 0.0
        # rates and estimates
        recal = c.prefill_fallback_mode == "enforce"
        eff = est.effective_tps(p, model, slot, c, rings)
        pf, src = est.resolve_prefill(p, model, slot, c, rings, recal)
        fb_pf, fb_src = est.prefill_fallback(p, c, recal)
        static_eff = est.static_effective_tps(p, slot, c)
        proj = est.projected_decode_tps(p, slot, c)
        fam = ix.code(ix.fam_codes, ix.fams, p.family)
        cls = ix.code(ix.cls_codes, ix.classes, p.chip_class)
        ver = ix.code(ix.ver_codes, None, p.version)
        acct = ix.code(ix.acct_codes, None, p.account_id) if p.account_id is not None else -1
        has_bc = b is not None
        f = (pen, pen + est.QUEUE_MS * eq, eff, pf, pf if pf > 0 else 1.0,
             spf, health, proj, static_eff, fb_pf, static_decode, 0.0 if loaded else pen,
             total - active, 0.0 if loaded else size, size, total)
        n = (self.gidx[p.provider_id], eq if has_mc else 0, cap, box_max, base, eq,
             waiting + max(0, pbm - rw), thr, rate, blnum, blwait, blpot, blpend, fam, cls, SRC[src],
             SRC[fb_src], ver, acct, slot.budget_max if budget else 0)
        bb = (gate_pub and okstate, gate_pub, gate_own, gate_self, okstate, entry.is_vision, has_mc,
              not critical and toolarge, not critical and not toolarge, has_bc, not has_bc, loaded,
              not (slot is not None and slot.observed_decode_tps > 0),
              not (slot is not None and slot.observed_prefill_tps > 0),
              p.decode_tps > 0, lm, not loaded, lm_ffl, lm_fflok)
        return f, n, bb

    # --- index build, re-layout and ring refresh -------------------------------------------------
    def index(self, model: str) -> ModelIndex | None:
        """The model's index, current; None when the fast path cannot serve it."""
        ix = self.indexes.get(model)
        if ix is None:
            ix = self.indexes[model] = ModelIndex(model)
            c = self.router.config
            ix.floor = c.version_floor(model)
            ix.pattern = c.is_dedicated(model)
        if ix.broken:
            return None
        if ix.layout_dirty:
            self._relayout(ix)
        if ix.stale and not ix.broken:
            self._rebuild_stale(ix)
        if ix.broken:
            return None
        self._refresh(ix)
        return None if ix.broken else ix

    def _relayout(self, ix: ModelIndex) -> None:
        r = self.router
        pids = list(r.by_model.get(ix.model, ()))
        provs = [r.providers[pid] for pid in pids]
        n = len(pids)
        take = np.zeros(n, dtype=np.int64)
        rebuild = []
        old_row, old_provs = ix.row_of, ix.provs
        for j, (pid, p) in enumerate(zip(pids, provs)):
            i = old_row.get(pid)
            if i is not None and old_provs[i] is p:
                take[j] = i
            else:
                rebuild.append(j)
        if ix.n:
            F, I, B = (np.take(a, take, axis=1) for a in (ix.F, ix.I, ix.B))  # C order, as the kernels expect
        else:
            F, I, B = np.zeros((NF, n)), np.zeros((NI, n), dtype=np.int64), np.zeros((NB, n), dtype=bool)
        ix.F, ix.I, ix.B = F, I, B
        ix.n, ix.pids, ix.provs = n, pids, provs
        ix.row_of = {pid: j for j, pid in enumerate(pids)}
        ix.out = _scan_buffers(n)
        ix.layout_dirty = False
        views: dict = {}
        for j in rebuild:
            p = provs[j]
            pv = views.get(id(p))
            if pv is None:
                pv = views[id(p)] = self._provider_view(p)
            self._write_row(ix, j, p, pv)

    def _refresh(self, ix: ModelIndex) -> None:
        """Re-read ring medians / solo rates / calibrator ratios that moved since the last look."""
        r = self.router
        rings, model = r.rings, ix.model
        if ix.n == 0:
            return
        v = rings.decode.version(model)
        if v != ix.seen_decode or len(ix.decode_medians) < len(ix.fams):
            ix.seen_decode = v
            ix.decode_medians = np.array([rings.decode.median(model, fam) for fam in ix.fams])
        v = rings.prefill.version(model)
        if v != ix.seen_prefill:
            ix.seen_prefill = v
            self._refresh_prefill(ix)
        v = rings.solo.version(model)
        if v != ix.seen_solo:
            ix.seen_solo = v
            self._refresh_cap(ix)
        seen = r.calibrator.versions.get(model, NO_OBSERVATIONS)
        if len(ix.ratio_table) < len(ix.fams):  # a family new to the index: every ratio
            ix.seen_calib = dict(seen)
            self._refresh_ratio(ix)
        elif seen != ix.seen_calib:
            old, ix.seen_calib = ix.seen_calib, dict(seen)
            self._refresh_ratio(ix, None if old is None else [
                i for i, s in enumerate(SOURCES) if seen.get(s) != old.get(s)])

    def _refresh_prefill(self, ix: ModelIndex) -> None:
        c = self.router.config
        mask = ix.B[B_PFRING]
        if not c.prefill_medians or not mask.any():
            return
        rings = self.router.rings
        stats = [rings.prefill.stats(ix.model, cls) for cls in ix.classes] or [(0.0, 0)]
        kernel.refresh_prefill(ix.F, ix.I, ix.B, np.array([s[0] for s in stats]),
                               np.array([s[1] for s in stats], dtype=np.int64), c.prefill_min_samples,
                               float(c.max_prefill_tps), SRC["median"])

    def _refresh_ratio(self, ix: ModelIndex, sources: list[int] | None = None) -> None:
        """The calibrator ratio of every (family, source) pair, or of the `sources` whose windows
        moved (ratio(model, ·, source) reads only that source's windows). The scan reads the table
        by each row's family and prefill source."""
        r = self.router
        if not r.config.ttft_calibration:
            return
        cal, model, table = r.calibrator, ix.model, ix.ratio_table
        if sources is None:
            table = np.array([[cal.ratio(model, fam, s) for s in SOURCES] for fam in ix.fams] or ONE_RATIO)
        else:
            for si in sources:
                table[:len(ix.fams), si] = [cal.ratio(model, fam, SOURCES[si]) for fam in ix.fams]
        ix.ratio_table = table

    def _refresh_cap(self, ix: ModelIndex) -> None:
        """The quality cap of every row (domain §2.6), compiled; mirrors `admission.effective_cap`."""
        r = self.router
        c, model = r.config, ix.model
        if not c.quality_cap:
            ix.I[I_CAP] = ix.I[I_BASE]
            return
        rates = [adm.class_solo_tps(model, cls, c, r.rings) for cls in ix.classes] or [None]
        has_rate = np.array([x is not None for x in rates])
        rates = np.array([x if x is not None else 0.0 for x in rates])
        try:
            fallback = float(c.fallback_concurrency)
        except OverflowError:
            ix.broken = True
            return
        if not kernel.refresh_cap(ix.F, ix.I, ix.B, has_rate, rates, ix.pattern is not None, fallback,
                                  float(c.decode_floor), float(c.k), float(c.overcommit_for(model))):
            ix.broken = True

    # === the decision =============================================================================
    def scan(self, req) -> FastScan | None:
        """The candidate scan for one stamped request, or None to use the scalar path."""
        P, R = req.prompt, req.max_tokens
        if not (0 <= P < TOKEN_LIMIT and 0 < R < TOKEN_LIMIT):
            self.stats["declined_tokens"] += 1
            return None
        r = self.router
        model = req.model
        if not r.by_model.get(model):
            self.stats["scans"] += 1
            return FastScan()
        ix = self.index(model)
        if ix is None:
            self.stats["declined_index"] += 1
            return None
        self.stats["scans"] += 1
        return self._scan(req, ix, P, R)  # compiled with numpy's error model: no warnings to silence

    def capacity(self, model: str, prompt: int) -> tuple[int, int, int, float] | None:
        """The capacity feed's figures for the model from its index, exactly those of the scalar
        loop (`Router.capacity`): (routable providers, remaining concurrency, remaining tokens,
        best estimated TTFT for a `prompt`-token request); None to use that loop."""
        ix = self.index(model) if self.router.by_model.get(model) else None
        if ix is None:
            return None
        raw, ttft = np.empty(ix.n), np.empty(ix.n)
        got = kernel.capacity(ix.F, ix.I, ix.B, ix.decode_medians, ix.ratio_table, self.npend, self.pool,
                              self.pooled, prompt, self.router.config.ttft_calibration, raw, ttft)
        self.stats["capacity" if got[0] >= 0 else "declined_capacity"] += 1
        return got if got[0] >= 0 else None

    def _scan(self, req, ix: ModelIndex, P: int, R: int) -> FastScan:
        r = self.router
        c = r.config
        res = FastScan(ix)
        acct = -1
        if req.account_id is not None:
            acct = ix.acct_codes.get(req.account_id, -1)
        if req.self_route_only and acct < 0:
            return res  # no provider of the requester's account advertises the model
        keep = NO_ROWS
        if req.allowed or req.excluded:
            keep = np.zeros(ix.n, dtype=bool) if req.allowed else np.ones(ix.n, dtype=bool)
            row_of = ix.row_of
            for pid in req.allowed:
                i = row_of.get(pid)
                if i is not None:
                    keep[i] = True
            for pid in req.excluded:
                i = row_of.get(pid)
                if i is not None:
                    keep[i] = False
        kv_gb = min(P + R, adm.MAX_KV_TOKENS) * adm.KV_DEFAULT_BYTES_PER_TOKEN / adm.GIB
        long_prompt = c.long_prompt_tokens > 0 and P >= c.long_prompt_tokens
        npend, owned, admitted, cand, _, raw, ttft, cost, _ = ix.out  # ScanBuffers
        n_elig, n_ph, res.too_large, n_kvs, n_adm, res.ttft_rejections, best, no_bc = kernel.scan(
            ix.F, ix.I, ix.B, ix.decode_medians, ix.ratio_table, self.npend, self.pool, acct,
            req.self_route_only, req.requires_vision, keep, P, R, kv_gb, c.ttft_calibration,
            float(req.max_ttft_ms), long_prompt, float(c.long_prompt_weight - 1),
            npend, owned, admitted, cand, raw, ttft, cost)
        res.npend, res.adm, res.raw, res.ttft = npend, admitted, raw, ttft
        if acct >= 0:
            res.owned = owned
        res.capacity_rejections = n_elig - n_ph + n_kvs - n_adm
        if n_adm == 0:
            return res
        if best >= 0:
            res.best_ttft, res.best_source = res.ttft.item(best), SOURCES[ix.I.item(I_SRC, best)]
        if no_bc:
            res.has_ttft = False
        n_cand = n_adm - res.ttft_rejections
        res.cand = cand
        res.candidates = range(n_cand)
        if n_cand == 0:
            return res
        aff = r._affinity_lookup(req)
        res.affinity_pid = aff
        if aff is not None:
            i = ix.row_of.get(aff)
            if i is not None and cand[i] and c.affinity_bonus_ms > 0:
                x = cost[i].item()
                cost[i] = x - min(c.affinity_bonus_ms, x)
        res.cost = cost
        return res

    def select(self, req, res: FastScan, draw):
        """Narrowing (domain §2.12) and selection (§2.16, §2.17) on a fast scan with candidates.
        Returns (row, how, band_members), or None when the scalar path must decide."""
        r = self.router
        c = r.config
        ix = res.ix
        F, I, Bc = ix.F, ix.I, ix.B
        avoid = ix.ver_codes.get(req.avoid_version, -1) if req.avoid_version else -1
        owned = res.owned if res.owned is not None else NO_ROWS
        pool, equivalent = ix.out.pool, ix.out.equivalent
        best, n_eq = kernel.narrow_and_cheapest(
            res.cand, owned, bool(req.prefer_owner and res.owned is not None), avoid,
            float(req.min_decode_tps), F, I, res.cost, res.npend, NEAR_TIE_MS, pool, equivalent)
        aff = res.affinity_pid
        aff_row = ix.row_of.get(aff) if aff is not None else None
        if c.band:
            if req.max_ttft_ms > 0:
                band = pool & Bc[B_HASBC] & ~(res.ttft > req.max_ttft_ms - c.band_margin_ms)
            else:
                band = pool & Bc[B_LOADED]
            if req.min_decode_tps > 0:
                band &= ~(F[F_PROJ] < req.min_decode_tps)
            rows = np.flatnonzero(band)
            if len(rows):
                rows = rows.tolist()
                pos, how = r._band_choice(req, [ix.pids[i] for i in rows],
                                          F[F_HEALTH][rows].tolist(), aff)
                return rows[pos], how, len(rows)
        # winner = first near-tie with the lowest (effective queue, total pending) key. `equivalent`
        # of domain §2.16 step 4 is exactly those rows: every near-tie cost lies in
        # [best, best + 3000], so any two are within 3000 of each other (rounding is monotonic).
        if not math.isfinite(best):
            self.stats["declined_cost"] += 1
            return None
        if n_eq > 1:
            winner = equivalent.item(math.floor(draw(req.request_id, req.attempt, 0) * n_eq))
            how = "near_tie_random"
        else:
            winner, how = equivalent.item(0), "cheapest"
        if aff_row is not None and pool[aff_row] and abs(res.cost[aff_row].item() - best) <= NEAR_TIE_MS:
            return aff_row, "affinity", 0
        return winner, how, 0


from . import scan_kernel as kernel  # noqa: E402  (it reads this module's column numbers)
