"""The fast path's per-request candidate scan as compiled loops (numba), from the gates to the
cost and the cheapest rows, and the index refreshes that are whole-column passes: the same
element-wise IEEE float64 arithmetic, in the same written order, as the numpy expressions they
replaced (`FastPath._scan` keeps the allowed/excluded mask before and the affinity bonus after).

Why: a scan over a model's 700–900 rows took about 70 numpy calls, each a few microseconds of
call overhead on short columns; one compiled call does one pass per stage. The passes are bound by
memory rather than arithmetic: a replay evicts the columns between requests. Exactness is as in
streams/candidates.py: no fast-math, so no reordering or fused multiply-add; the only reductions
are counts and a first-minimum. `error_model="numpy"` makes ÷0 give inf/nan as numpy does, and the
two whole-column tests of the numpy code (any W > 0, all TTFTs finite) stay whole-column tests.
tests/core/test_fast_path.py compares the fast path with the scalar path on random journals.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .candidates import (BIG, B_DECPOS, B_EFFRING, B_GATEOWN, B_GATEPUB, B_GATESELF, B_HASBC, B_HASMC,
                         B_KVS, B_LM, B_LMFFL, B_LMFFLOK, B_LMUNL, B_NOBC, B_OKSTATE, B_PFRING,
                         B_PREPUB, B_TL, B_VISION, F_CPEN, F_EFF, F_FB_PF, F_HEALTH, F_KQ, F_LM_B,
                         F_LM_L, F_LM_SIZE, F_LM_TOTAL, F_PEN, F_PF, F_PFT, F_PROJ, F_SOLO_STATIC,
                         F_SPF, F_STATIC_EFF, I_ACCT, I_BASE, I_BLNUM, I_BMAX, I_BLPEND, I_BLPOT, I_BLWAIT,
                         I_BOXMAX, I_CAP, I_CLS, I_EQ, I_FAM, I_FBSRC, I_GIDX, I_LOAD, I_RATE, I_SRC,
                         I_THR, I_VER, I_W, NB, NF, NI)
from .estimates import PENDING_MS


@njit(cache=True, error_model="numpy", nogil=True)
def scan(F, I, B, medians, ratios, npend_all, pool_all, acct, self_route, vision, keep, P, R, kv_gb,
         calibrate, max_ttft, long_prompt, long_weight, npend, owned, admitted, cand, raw, calibrated, c):
    """The whole scan of one request in one call (a call into compiled code costs a few µs, as
    much as a stage's loop): gather the fleet-wide cells, the gates (domain §2.2), then admission,
    TTFT and its gate, and cost. `medians`: the fleet decode median per family code; `ratios`: the
    calibrator ratio per (family code, prefill source code); `acct`: the requester's account code
    in the index, or -1; `keep`: the allowed/excluded mask, or empty. Writes the rows' pending
    count, owned, admitted and candidate masks, raw and calibrated TTFT and cost into the last
    seven arrays (the index's buffers: returning new arrays would cost about 0.7 µs each to box).
    Returns (eligible, with headroom, too large, KV-admissible, admitted, TTFT rejections, best
    TTFT row, any admitted row without backend capacity)."""
    n = F.shape[1]
    pool = np.empty(n, dtype=np.int64)
    elig = np.empty(n, dtype=np.bool_)
    use_keep = keep.shape[0] > 0
    for i in range(n):
        g = I[I_GIDX, i]
        npend[i] = npend_all[g]
        pool[i] = pool_all[g]
        o = acct >= 0 and I[I_ACCT, i] == acct
        owned[i] = o
        if self_route:
            e = o and B[B_GATESELF, i] and B[B_OKSTATE, i]
        elif acct >= 0:
            e = (B[B_GATEOWN, i] if o else B[B_GATEPUB, i]) and B[B_OKSTATE, i]
        else:
            e = B[B_PREPUB, i]
        if vision:
            e = e and B[B_VISION, i]
        if use_keep:
            e = e and keep[i]
        elig[i] = e
    n_elig, n_ph, too_large, n_kvs, n_adm = admission(F, I, B, elig, npend, pool, P + R, kv_gb, admitted)
    eff = decode_rates(F, I, B, medians)
    ttft(F, I, B, eff, ratios, P, calibrate, raw, calibrated)
    rejected, best, no_bc = ttft_gate(B, admitted, calibrated, max_ttft, cand)
    cost(F, I, eff, npend, P, R, long_prompt, long_weight, c)
    return n_elig, n_ph, too_large, n_kvs, n_adm, rejected, best, no_bc


@njit(cache=True, error_model="numpy", nogil=True)
def admission(F, I, B, elig, npend, pool, T, kv_gb, admitted):
    """Headroom, hardware fit and KV admission (domain §2.6–2.10) into the `admitted` mask.
    Returns (rows eligible, rows eligible with headroom, too large, KV-admissible, admitted)."""
    n = elig.shape[0]
    admitted[:] = False
    n_elig = n_ph = too_large = n_kvs = n_adm = 0
    for i in range(n):
        if not elig[i]:
            continue
        n_elig += 1
        load = I[I_LOAD, i] if B[B_HASMC, i] else npend[i]
        if not (load < I[I_CAP, i] and npend[i] < I[I_BOXMAX, i]):
            continue
        n_ph += 1
        if B[B_TL, i]:
            too_large += 1
        if not B[B_KVS, i]:
            continue
        n_kvs += 1
        ok = T <= I[I_THR, i] and T * I[I_RATE, i] <= pool[i]
        if ok and B[B_LM, i]:
            if B[B_LMUNL, i] and npend[i] == 0:
                if B[B_LMFFL, i]:
                    ok = B[B_LMFFLOK, i]
                else:
                    ok = F[F_LM_SIZE, i] + kv_gb + 4 <= F[F_LM_TOTAL, i]
            else:
                ok = F[F_LM_L, i] >= F[F_LM_B, i] + kv_gb
        admitted[i] = ok
        n_adm += ok
    return n_elig, n_ph, too_large, n_kvs, n_adm


@njit(cache=True, error_model="numpy", nogil=True)
def decode_rates(F, I, B, medians):
    """Every row's decode rate (`estimates.effective_tps`): its slot's observed rate (the column),
    else the fleet median of its family when positive, else its static rate. (A compiled call per
    row would cost more than the loop: numba does not inline it.)"""
    n = F.shape[1]
    eff = np.empty(n)
    for i in range(n):
        if B[B_EFFRING, i]:
            med = medians[I[I_FAM, i]]
            eff[i] = med if med > 0 else F[F_STATIC_EFF, i]
        else:
            eff[i] = F[F_EFF, i]
    return eff


@njit(cache=True, error_model="numpy", nogil=True)
def ttft(F, I, B, eff, ratios, P, calibrate, raw, out):
    """Raw and calibrated TTFT of every row (domain §2.13) into `raw` and `out`; `ratios` is the
    calibrator's ratio by (family code, prefill source code)."""
    n = F.shape[1]
    w_any = False
    for i in range(n):
        if I[I_W, i] != 0:
            w_any = True
            break
    with_w = P > 0 and w_any
    finite = True
    for i in range(n):
        pft = F[F_PFT, i]
        d1 = 1000 / (eff[i] if eff[i] > 0 else 1.0)
        if with_w:
            x = F[F_PEN, i] + P * I[I_W, i] / pft * 1000 + P / pft * 1000 + d1
        else:
            x = F[F_PEN, i] + P / pft * 1000 + d1
        raw[i] = x
        if not np.isfinite(x):
            finite = False
    for i in range(n):
        x = raw[i]
        if finite:
            keep = B[B_HASBC, i]
        else:
            keep = B[B_HASBC, i] and x > 0 and np.isfinite(x)
        if not keep:
            raw[i] = 0.0
    if not calibrate:
        out[:] = raw
        return
    for i in range(n):
        x, ratio, pen = raw[i], ratios[I[I_FAM, i], I[I_SRC, i]], F[F_PEN, i]
        if x <= 0 or ratio == 1.0:
            out[i] = x
        elif 0 <= pen and pen < x:
            out[i] = pen + (x - pen) * ratio
        else:
            out[i] = x


@njit(cache=True, error_model="numpy", nogil=True)
def ttft_gate(B, admitted, ttft, max_ttft, cand):
    """The candidates into `cand`; returns (TTFT rejections, first row with the lowest positive
    TTFT or -1, any admitted row without backend capacity)."""
    n = admitted.shape[0]
    cand[:] = admitted
    rejected, best, no_bc = 0, -1, False
    for i in range(n):
        if not admitted[i]:
            continue
        if B[B_NOBC, i]:
            no_bc = True
        if not B[B_HASBC, i]:
            continue
        t = ttft[i]
        if t > 0 and (best < 0 or t < ttft[best]):
            best = i
        if max_ttft > 0 and t > max_ttft:
            rejected += 1
            cand[i] = False
    if best > 0 and ttft[best] == np.inf:
        best = -1  # numpy's argmin over an all-inf column answers row 0, which is not eligible
    return rejected, best, no_bc


@njit(cache=True, error_model="numpy", nogil=True)
def cost(F, I, eff, npend, P, R, long_prompt, long_weight, out):
    """Cost of every row (domain §2.11), without the affinity bonus, into `out`."""
    n = F.shape[1]
    for i in range(n):
        rate = eff[i]
        num = I[I_BLNUM, i]
        wait = I[I_BLWAIT, i]
        if wait > 0:
            wr = wait * R
            pot = I[I_BLPOT, i]
            num = pot + wr + max(0, I[I_BLPEND, i] - pot - wr)
        this_req = P / F[F_SPF, i] * 1000 + R / rate * 1000
        if long_prompt:
            this_req = this_req + long_weight * (P / F[F_PF, i] * 1000 + F[F_CPEN, i])
        out[i] = F[F_KQ, i] + PENDING_MS * npend[i] + num / rate * 1000 + this_req + F[F_HEALTH, i]


@njit(cache=True, error_model="numpy", nogil=True)
def _narrowed(pool, keep):
    """pool & keep when that leaves a row, else pool."""
    x = pool & keep
    return x if x.any() else pool


@njit(cache=True, error_model="numpy", nogil=True)
def narrow_and_cheapest(cand, owned, prefer_owner, avoid_code, min_decode, F, I, cost, npend, near_tie_ms,
                        pool_out, equivalent):
    """Narrowing (domain §2.12: owned rows, then rows of another version than `avoid_code`, then
    rows fast enough, each only if any row is left), then `cheapest` on what is left. Writes the
    pool into `pool_out` and the equivalent rows into the head of `equivalent`; returns (lowest
    cost, number of equivalent rows)."""
    pool = cand
    if prefer_owner:
        pool = _narrowed(pool, owned)
    if avoid_code >= 0:
        pool = _narrowed(pool, I[I_VER] != avoid_code)
    if min_decode > 0:
        pool = _narrowed(pool, F[F_PROJ] >= min_decode)
    pool_out[:] = pool
    return cheapest(pool, cost, I, npend, near_tie_ms, equivalent)


@njit(cache=True, error_model="numpy", nogil=True)
def cheapest(pool, cost, I, npend, near_tie_ms, out):
    """Selection among the pool by cost (domain §2.16): (lowest cost, the number of rows within
    `near_tie_ms` of it that share the lowest (effective queue, total pending) key, written in row
    order into `out`). A NaN or infinite lowest cost comes back as is, with no rows (the scalar
    path decides)."""
    n = pool.shape[0]
    best = np.inf
    seen = False
    for i in range(n):
        if pool[i]:
            x = cost[i]
            if x != x:  # NaN: numpy's min is NaN
                return x, 0
            if not seen or x < best:
                best, seen = x, True
    if not np.isfinite(best):
        return best, 0
    low = np.int64(0)
    found = False
    for i in range(n):
        if pool[i] and abs(cost[i] - best) <= near_tie_ms:
            key = (I[I_EQ, i] << 32) + npend[i]
            if not found or key < low:
                low, found = key, True
    m = 0
    for i in range(n):
        if pool[i] and abs(cost[i] - best) <= near_tie_ms and (I[I_EQ, i] << 32) + npend[i] == low:
            out[m] = i
            m += 1
    return best, m


@njit(cache=True, error_model="numpy", nogil=True)
def refresh_prefill(F, I, B, medians, counts, min_samples, max_prefill, median_code):
    """Rows that read the prefill median (B_PFRING): their class's median when it is positive and
    has `min_samples`, else their fallback rate and source; capped at `max_prefill`."""
    for i in range(F.shape[1]):
        if B[B_PFRING, i]:
            c = I[I_CLS, i]
            med = medians[c]
            ok = med > 0 and counts[c] >= min_samples
            pf = np.minimum(med if ok else F[F_FB_PF, i], max_prefill)
            F[F_PF, i] = pf
            I[I_SRC, i] = median_code if ok else I[I_FBSRC, i]
            F[F_PFT, i] = pf if pf > 0 else 1.0


@njit(cache=True, error_model="numpy", nogil=True)
def refresh_cap(F, I, B, has_rate, rates, dedicated, fallback, floor, k, overcommit):
    """The quality cap of every row (domain §2.6; `admission.effective_cap`): the class's solo
    rate, else the static one, bucketed by the decode floor, times the overcommit, at most the
    slot's base. False when a value is not finite (math.floor would raise: the scalar path decides)."""
    for i in range(F.shape[1]):
        base = I[I_BASE, i]
        cls = I[I_CLS, i]
        per_model = has_rate[cls]
        if not (B[B_DECPOS, i] or per_model or dedicated):
            I[I_CAP, i] = base
            continue
        rate = rates[cls] if per_model else F[F_SOLO_STATIC, i]
        basef = float(base)
        limit = max(1.0, basef if base > 0 else fallback)
        if floor <= 0 or k <= 0 or rate <= 0:
            qc = limit
        elif rate <= floor:
            qc = 1.0
        else:
            b = np.floor((rate / floor - 1) / k)
            if not np.isfinite(b):
                return False
            qc = max(1.0, min(limit, b))
        prod = qc * overcommit
        if not np.isfinite(prod):
            return False
        I[I_CAP, i] = int(min(max(1.0, np.ceil(prod)), basef))
    return True


@njit(cache=True, error_model="numpy", nogil=True)
def capacity(F, I, B, medians, ratios, npend_all, pool_all, pooled_all, P, calibrate, raw, ttft_out):
    """The capacity feed of the index's model (domain §2.10.7; `Router.capacity`'s loop, with the
    TTFT of a `P`-token prompt computed as for a decision): (routable providers, remaining
    concurrency, remaining tokens, best estimated TTFT). Routable providers come back as -1 when a
    value is beyond what int64 holds exactly (a clipped pool, a sum past 2^62; the scalar loop
    decides) or a byte-mode rate is 0 (the scalar loop raises, as before)."""
    eff = decode_rates(F, I, B, medians)
    ttft(F, I, B, eff, ratios, P, calibrate, raw, ttft_out)
    routable = concurrency = tokens = 0
    best = 0.0
    for i in range(F.shape[1]):
        # the public gates and a usable slot state (B_PREPUB); not thermally critical (neither flag)
        if not B[B_PREPUB, i] or not (B[B_TL, i] or B[B_KVS, i]):
            continue
        g = I[I_GIDX, i]
        npend = npend_all[g]
        remaining = -1  # pooledRemainingTokens: -1 when the box reports no pool
        if pooled_all[g]:
            pool, rate = pool_all[g], I[I_RATE, i]
            if pool >= BIG or rate <= 0:
                return -1, 0, 0, 0.0
            remaining = max(0, pool) // rate
        bmax, used = I[I_BMAX, i], I[I_BLNUM, i]  # a budget slot's max and used + queued
        if (bmax > 0 and used >= bmax) or remaining == 0:
            continue
        cap, boxmax = I[I_CAP, i], I[I_BOXMAX, i]
        load = I[I_LOAD, i] if B[B_HASMC, i] else npend
        if not (load < cap and npend < boxmax):
            continue
        routable += 1
        concurrency += max(0, min(cap - load, boxmax - npend))
        add = 0
        if bmax > 0:
            head = max(0, bmax - used)
            add = min(head, remaining) if remaining >= 0 else head
        elif remaining > 0:
            add = remaining
        if tokens > BIG - add:
            return -1, 0, 0, 0.0
        tokens += add
        if B[B_HASBC, i]:
            t = ttft_out[i]
            if t > 0 and (best == 0.0 or t < best):
                best = t
    return routable, concurrency, tokens, best


def warm_up() -> None:
    """Compile (or load from numba's cache) every loop for the column types the fast path uses,
    so a worker's first decision does not wait for it (≈ 2.5 s without a cache, 0.3 s with)."""
    F, I, B = np.ones((NF, 1)), np.zeros((NI, 1), dtype=np.int64), np.zeros((NB, 1), dtype=np.bool_)
    one, mask, x = np.ones(1, dtype=np.int64), np.ones(1, dtype=np.bool_), np.ones(1)
    scan(F, I, B, x, np.ones((1, 4)), one, one, 0, False, True, mask, 1, 1, 0.5, True, 1.0, True, 1.0,
         one, mask, mask, mask, x, x, x)
    narrow_and_cheapest(mask, mask, True, 0, 1.0, F, I, x, one, 3000.0, mask, one)
    refresh_prefill(F, I, B, np.ones(1), one, 5, 20000.0, 1)
    refresh_cap(F, I, B, mask, np.ones(1), False, 4.0, 15.0, 1.0, 1.0)
    capacity(F, I, B, x, np.ones((1, 4)), one, one, mask, 500, True, x, x)
