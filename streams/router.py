"""The routing core: `Router.apply(entry)` folds one journal entry into the state and returns what
it caused (decisions, reservations, telemetry). Pure Python: no Kafka, no Faust, no clock, no global
random, no environment. Time is the journal's (rules §1), randomness is a sha256 draw seeded by the
request identity (rules §2), configuration is the recorded `Config` (rules §3).

Outputs are `(type_name, record)` pairs:
- ("RouteDecision", {...}) and ("Reservation", {...}) — the wire records of events.md;
- ("Rejected", {"reason", "detail"}) — the entry was refused (the adapter dead-letters it);
- ("Tripwire", {"provider_id", "model", "reported"}) and
  ("PrefillShadow", {"decision", "gate", "model"}) — telemetry for metrics.
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict, deque
from bisect import insort, bisect_left
from dataclasses import dataclass, field

from . import admission as adm
from . import estimates as est
from .calibration import TtftCalibrator
from .candidates import FastPath
from .config import DEFAULT, Config, ConfigError
from .provider import TRUST_RANK, ProviderEventError, ProviderState, Slot
from .rings import TpsRegistry
from .serve_counter import ServeCounter
from .persistence import DEDUP_BUCKET, key as pkey
from .versions import compare_versions

DEFAULT_MAX_TOKENS = 256
CAPACITY_FEED_PROMPT = 500
NEAR_TIE_MS = 3_000.0
EVENT_DEDUP_WINDOW = 100_000
REQUEST_DEDUP_WINDOW = 200_000
AFFINITY_MAX = 10_000
MAX_ID_LIST = 1024
MAX_REQUEST_TOKENS = 2**31 - 1  # prompt_tokens / max_tokens above it: invalid_request (reservations stay Avro longs)

TIME_FIELD = {
    "ProviderRegistered": "registered_at_ms", "Heartbeat": "sent_at_ms",
    "ProviderDisconnected": "at_ms", "RouteRequest": "sent_at_ms", "Completion": "completed_at_ms",
    "ConfigChange": "changed_at_ms", "Tick": "at_ms",
}
OUTPUT_TYPES = ("RouteDecision", "Reservation", "ModelCapacity", "DeadLetter")


def draw(request_id: str, attempt: int, k: int) -> float:
    """Random draw k for a decision (rules §2): uniform in [0, 1), from sha256."""
    digest = hashlib.sha256(f"{request_id}|{attempt}|{k}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / 2**53


def _num(e: dict, name: str, kind=float):
    """A request's numeric field: finite, not a bool (0 when absent)."""
    v = e.get(name) or 0
    if type(v) is int:  # the decoder's, nearly always (a bool is not an int here)
        return kind(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(name)
    return kind(v)


def _opt_str(e: dict, name: str) -> str | None:
    """A request's optional string field: None when absent or empty, at most 256 characters."""
    v = e.get(name)
    if v is None or v == "":
        return None
    if not isinstance(v, str) or len(v) > 256:
        raise ValueError(name)
    return v


def retry_after_for_depth(depth: int) -> int:
    return 2 if depth <= 0 else min(30, max(2, 3 * depth))


@dataclass(slots=True)
class Request:
    """A RouteRequest after validation and stamping (rules §5)."""
    request_id: str
    attempt: int
    model: str
    prompt: int          # ≥ 0, as used in costs
    max_tokens: int      # > 0 (256 when unset)
    max_ttft_ms: float   # stamped hard ceiling, 0 = none
    min_decode_tps: float
    deadline_ms: float   # deadline(prompt), for the shadow telemetry
    account_id: str | None
    consumer_key: str | None
    affinity_key: str | None
    self_route_only: bool
    prefer_owner: bool
    requires_vision: bool
    allowed: frozenset
    excluded: frozenset
    avoid_version: str | None
    sent_at_ms: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.attempt)

    @property
    def tokens(self) -> int:
        return self.prompt + self.max_tokens


@dataclass(slots=True)
class Candidate:
    p: ProviderState
    slot: Slot | None
    cost: float
    ttft: float          # calibrated; 0 without backend capacity
    raw_ttft: float
    prefill_source: str
    penalty: float
    eff_queue: int
    total_pending: int
    projected_tps: float
    health: float


@dataclass
class Scan:
    candidates: list = field(default_factory=list)
    capacity_rejections: int = 0
    too_large: int = 0
    ttft_rejections: int = 0
    eligible: int = 0
    best_ttft: float = 0.0
    best_source: str = "none"
    has_ttft: bool = True
    admitted: list = field(default_factory=list)  # (p, slot) that passed admission, for the shadow
    affinity_pid: str | None = None


@dataclass(slots=True)
class Queued:
    request: Request
    enqueued_at_ms: float


class _NoChanges:
    """A dirty-key set that keeps nothing: an offline replay persists no state."""
    __slots__ = ()

    def add(self, key) -> None:
        pass

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())

    def clear(self) -> None:
        pass


class Router:
    """`fast=False` keeps every decision on the scalar scan (the reference the fast path is tested
    against, and what `explain` traces). `track_changes=False` (offline replays) keeps no record of
    the persistence keys each entry changed: nothing would collect them, and over a day they grow
    to millions."""

    def __init__(self, config: Config = DEFAULT, fast: bool = True, track_changes: bool = True):
        self.fast: FastPath | None = None
        self.config = config
        self.now = 0
        self.offset = -1
        self.providers: dict[str, ProviderState] = {}
        self.by_model: dict[str, list[str]] = {}           # model -> sorted online provider ids
        self.liveness: OrderedDict[str, float] = OrderedDict()  # in last_seen order
        self.rings = TpsRegistry()
        self.calibrator = TtftCalibrator()
        self.serves = ServeCounter()
        self.affinity: OrderedDict[tuple, tuple[str, float]] = OrderedDict()
        self.queues: dict[str, deque[Queued]] = {}
        self.reservations: dict[tuple[str, int], str] = {}
        self.seen_requests: OrderedDict[tuple[str, int], int] = OrderedDict()  # -> insertion seq
        self.seen_events: OrderedDict[str, int] = OrderedDict()
        self.counters: Counter = Counter()
        self.tripwires: Counter = Counter()
        # Persistence (streams/persistence.py): keys changed since the adapter last saved, and
        # insertion sequence numbers that let a restored router keep every map's order.
        self.dirty: set[tuple] = set()  # key parts; joined into persistence keys by take_dirty
        self.seq = 0
        self.liveness_seq: dict[str, int] = {}
        self.affinity_seq: dict[tuple, int] = {}
        self.fast = FastPath(self) if fast else None
        if not track_changes:
            self.dirty = self.calibrator.dirty = self.serves.dirty = _NoChanges()
            for family in (self.rings.decode, self.rings.solo, self.rings.prefill):
                family.dirty = self.dirty

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, value: Config) -> None:
        self._config = value
        if self.fast is not None:
            self.fast.reset()

    # === the fold ==================================================================================
    def apply(self, offset: int, journal_time_ms: int | None, type_name: str, record: dict) -> list:
        """Apply one journal entry. Never raises on bad input: refusals come back as outputs."""
        self.offset = offset
        self.dirty.add(("meta",))
        out: list = []
        if type_name in OUTPUT_TYPES:
            return out
        handler = self._HANDLERS.get(type_name)
        if handler is None:
            self.counters["entries_unknown_type"] += 1
            return [("Rejected", {"reason": "unknown_type", "detail": str(type_name)[:64]})]
        self._advance_time(journal_time_ms, record.get(TIME_FIELD[type_name]))
        self._expire_stale_providers(out)
        self._expire_queue_timeouts(out)
        try:
            handler(self, record, out)
        except ProviderEventError as e:
            self.counters[f"rejected_{e.reason}"] += 1
            out.append(("Rejected", {"reason": e.reason, "detail": str(e)}))
        except ConfigError as e:
            self.counters["rejected_bad_config"] += 1
            out.append(("Rejected", {"reason": "bad_config", "detail": str(e)}))
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
            self.counters["rejected_malformed"] += 1
            out.append(("Rejected", {"reason": "malformed", "detail": f"{type(e).__name__}: {e}"[:200]}))
        return out

    def _advance_time(self, journal_time_ms, record_time) -> None:
        t = journal_time_ms if journal_time_ms is not None else record_time
        if type(t) is int:  # the journal's own time, nearly always
            if t > self.now:
                self.now = t
        elif isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > self.now:
            self.now = int(t)

    # --- time-driven work (rules §1) -----------------------------------------------------------------
    def _expire_stale_providers(self, out: list) -> None:
        stale_ms = self.config.provider_stale_ms
        while self.liveness:
            pid, seen = next(iter(self.liveness.items()))
            if self.now - seen <= stale_ms:
                break
            self.counters["providers_stale"] += 1
            self._drop_provider(pid, out)

    def _expire_queue_timeouts(self, out: list) -> None:
        queued = [m for m, q in self.queues.items() if q]
        if not queued:
            return
        wait = self.config.queue_max_wait_ms
        for model in sorted(queued):
            q = self.queues[model]
            while q and self.now - q[0].enqueued_at_ms > wait:
                item = q.popleft()
                self.dirty.add(("q", model))
                self.counters["queue_timeouts"] += 1
                out.append(self._reject(item.request, "queue_timeout", 429, retry_after_for_depth(len(q))))

    # --- idempotence --------------------------------------------------------------------------------
    def _duplicate_event(self, event_id) -> bool:
        if not event_id:
            return False
        if event_id in self.seen_events:
            self.counters["duplicate_events"] += 1
            return True
        seq = self.seen_events[event_id] = self._next_seq()
        self.dirty.add(("eb", seq // DEDUP_BUCKET))
        if len(self.seen_events) > EVENT_DEDUP_WINDOW:
            self.dirty.add(("eb", self.seen_events.popitem(last=False)[1] // DEDUP_BUCKET))
        return False

    # --- persistence support ------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _refresh_liveness(self, p: ProviderState) -> None:
        p.last_seen = self.now
        self.liveness.pop(p.provider_id, None)
        self.liveness[p.provider_id] = self.now
        self.liveness_seq[p.provider_id] = self._next_seq()
        self.dirty.add(("p", p.provider_id))

    def add_restored_provider(self, p: ProviderState, seen_seq: int) -> None:
        """Restore support: add a provider in liveness order (callers sort by `seen_seq`)."""
        self.providers[p.provider_id] = p
        self.liveness[p.provider_id] = p.last_seen
        self.liveness_seq[p.provider_id] = seen_seq
        for model in p.models:
            insort(self.by_model.setdefault(model, []), p.provider_id)
        for k in p.pending:
            self.reservations[k] = p.provider_id
        if self.fast is not None:
            self.fast.provider_added(p)

    def take_dirty(self) -> set[str]:
        """The persistence keys changed since the last call (components report their own)."""
        dirty = {pkey(*k) for k in self.dirty}
        for family in ("decode", "solo", "prefill"):
            ring_family = getattr(self.rings, family)
            dirty.update(pkey("r", family, m, c) for m, c in ring_family.dirty)
            ring_family.dirty.clear()
        dirty.update(pkey(*k) for k in self.calibrator.dirty)
        self.calibrator.dirty.clear()
        dirty.update(pkey("s", pid) for pid in self.serves.dirty)
        self.serves.dirty.clear()
        self.dirty = set()
        return dirty

    # --- providers ----------------------------------------------------------------------------------
    def _on_registered(self, event: dict, out: list) -> None:
        state = ProviderState(event, self.config, self.now)  # validates first
        if self._duplicate_event(state.session):
            return
        released = False
        if state.provider_id in self.providers:  # a new session: the old one's reservations go
            self.counters["provider_new_session"] += 1
            released = self._drop_provider(state.provider_id, out, drain=False)
        self.providers[state.provider_id] = state
        self._refresh_liveness(state)
        for model in state.models:
            insort(self.by_model.setdefault(model, []), state.provider_id)
        if self.fast is not None:
            self.fast.provider_added(state)
        self.counters["providers_registered"] += 1
        if released:
            self._drain(state, out)

    def _drop_provider(self, pid: str, out: list, drain: bool = True) -> bool:
        p = self.providers.pop(pid, None)
        self.liveness.pop(pid, None)
        self.liveness_seq.pop(pid, None)
        if p is None:
            return False
        self.dirty.add(("p", pid))
        self.dirty.add(("pd", pid))
        for model in p.models:
            ids = self.by_model.get(model)
            if ids:
                i = bisect_left(ids, pid)
                if i < len(ids) and ids[i] == pid:
                    del ids[i]
        for key in p.pending:
            self.reservations.pop(key, None)
        if self.fast is not None:
            self.fast.provider_removed(p)
        had_pending = bool(p.pending)
        if drain:
            self._drain(p, out)
        return had_pending

    def _on_heartbeat(self, event: dict, out: list) -> None:
        p = self.providers.get(event.get("provider_id") or "")
        if p is None:
            self.counters["heartbeats_unknown_provider"] += 1
            return
        backend, trips = p.parse_heartbeat(event, self.config)  # validate before any change
        metrics = p.parse_metrics(event)
        if self._duplicate_event(event.get("event_id")):
            return
        self._refresh_liveness(p)
        seq = event.get("seq") or 0
        if seq > 0:
            if seq <= p.last_seq:  # an old frame only proves the provider is alive
                self.counters["heartbeats_stale_seq"] += 1
                return
            p.last_seq = seq
        before = self.fast.snapshot(p) if self.fast is not None else None
        p.set_metrics(metrics)
        p.backend = backend
        for model, reported in trips:
            self.tripwires[model] += 1
            out.append(("Tripwire", {"provider_id": p.provider_id, "version": p.version, "model": model,
                                     "reported": reported}))
        if backend is not None:
            self._record_rates(p, backend.slots)
        if self.fast is not None:
            self.fast.provider_changed(p, before)
        self.counters["heartbeats_applied"] += 1
        self._drain(p, out)

    def _record_rates(self, p: ProviderState, slots: list[Slot]) -> None:
        load = 0
        for s in slots:
            load += s.num_running + s.num_waiting
        solo_eligible = load <= 1
        for s in slots:
            if s.observed_decode_tps > 0:
                self.rings.decode.record(s.model, p.family, s.observed_decode_tps)
                if solo_eligible and s.num_running > 0:
                    self.rings.solo.record(s.model, p.chip_class, s.observed_decode_tps)
            v = s.observed_prefill_tps
            if v > 0 and p.last_prefill.get(s.model) != v:
                if self.rings.prefill.record(s.model, p.chip_class, v):
                    p.last_prefill[s.model] = v

    def _on_disconnected(self, event: dict, out: list) -> None:
        if self._duplicate_event(event.get("event_id")):
            return
        pid = event.get("provider_id") or ""
        if pid in self.providers:
            self._drop_provider(pid, out)
            self.counters["disconnects"] += 1
        else:
            self.counters["disconnects_unknown_provider"] += 1

    # --- completions (rules §7) ----------------------------------------------------------------------
    def _on_completion(self, event: dict, out: list) -> None:
        if self._duplicate_event(event.get("event_id")):
            return
        key = (event.get("request_id") or "", int(event.get("attempt") or 0))
        status = event.get("status") or ""
        pid = self.reservations.pop(key, None)
        if pid is None:
            if status == "cancelled" and self._remove_queued(key):
                self.counters["queue_cancelled"] += 1
            else:
                self.counters["completions_unmatched"] += 1
            return
        named = event.get("provider_id") or ""
        if named and named != pid:
            self.counters["completions_provider_mismatch"] += 1
        p = self.providers.get(pid)
        if p is not None:
            self.dirty.add(("pd", pid))
            gone = p.remove_pending(key)
            if gone is not None and self.fast is not None:
                self.fast.pending_changed(p, gone.model)
        ttft = event.get("ttft_ms") or 0.0
        if status == "ok" and isinstance(ttft, (int, float)) and ttft > 0:
            if self.calibrator.observe(key, float(ttft), self.now):
                self.counters["calibrator_observations"] += 1
        else:
            self.calibrator.forget(key)
        self.counters["completions"] += 1
        if p is not None:
            self._drain(p, out)

    def _remove_queued(self, key) -> bool:
        for q in self.queues.values():
            for item in q:
                if item.request.key == key:
                    q.remove(item)
                    self.dirty.add(("q", item.request.model))
                    return True
        return False

    # --- config and ticks ----------------------------------------------------------------------------
    def _on_config(self, event: dict, out: list) -> None:
        settings = event.get("settings") or {}
        if not isinstance(settings, dict):
            raise ConfigError("settings", "not a map")
        self.config = self.config.patched(settings)
        self.counters["config_changes"] += 1

    def _on_tick(self, event: dict, out: list) -> None:
        self.counters["ticks"] += 1

    # === requests ==================================================================================
    def _on_request(self, event: dict, out: list) -> None:
        rid = event.get("request_id")
        attempt = event.get("attempt")
        key = (rid if isinstance(rid, str) else "", attempt if isinstance(attempt, int) else 0)
        if key in self.seen_requests:
            self.counters["duplicate_requests"] += 1
            return
        seq = self.seen_requests[key] = self._next_seq()
        self.dirty.add(("rqb", seq // DEDUP_BUCKET))
        if len(self.seen_requests) > REQUEST_DEDUP_WINDOW:
            self.dirty.add(("rqb", self.seen_requests.popitem(last=False)[1] // DEDUP_BUCKET))
        req, why = self._stamp(event)
        if req is None:
            self.counters["invalid_requests"] += 1
            out.append(self._decision(key[0], key[1], str(event.get("model") or "")[:256], "rejected",
                                      "invalid_request", 400, None))
            return
        budget = self.config.route_wait_budget_ms
        if budget > 0 and self.now - req.sent_at_ms > budget:
            out.append(self._reject(req, "expired", 503, self._retry_after(req.model)))
            return
        self._decide(req, out, from_queue=False)

    def _stamp(self, e: dict) -> tuple[Request | None, str]:
        c = self.config
        try:
            rid, model = e.get("request_id"), e.get("model")
            if not isinstance(rid, str) or not rid or len(rid) > 256:
                return None, "request_id"
            if not isinstance(model, str) or not model or len(model) > 256:
                return None, "model"
            attempt, prompt, max_tokens = _num(e, "attempt", int), _num(e, "prompt_tokens", int), \
                _num(e, "max_tokens", int)
            max_ttft, min_decode = _num(e, "max_ttft_ms"), _num(e, "min_decode_tps")
            account, consumer, aff, avoid = (_opt_str(e, "account_id"), _opt_str(e, "consumer_key"),
                                             _opt_str(e, "cache_affinity_key"), _opt_str(e, "avoid_version"))
            allowed, excluded = e.get("allowed_provider_ids") or [], e.get("excluded_provider_ids") or []
            if len(allowed) > MAX_ID_LIST or len(excluded) > MAX_ID_LIST:
                return None, "id_list"
            sent = _num(e, "sent_at_ms", int)
        except (ValueError, TypeError, OverflowError) as err:
            return None, str(err)
        self_route, prefer_owner = bool(e.get("self_route_only")), bool(e.get("prefer_owner"))
        if attempt < 0 or prompt < 0 or max_tokens < 0 or max_ttft < 0 or min_decode < 0:
            return None, "negative"
        if prompt > MAX_REQUEST_TOKENS or max_tokens > MAX_REQUEST_TOKENS:
            return None, "too_many_tokens"
        if (self_route or prefer_owner) and not account:
            return None, "owner_without_account"
        prompt = max(0, prompt)
        deadline = c.deadline_base_ms + 1.0 * prompt
        if max_ttft <= 0 and c.ttft_hard_reject and not (self_route or prefer_owner):
            max_ttft = deadline
        return Request(
            request_id=rid, attempt=attempt, model=model, prompt=prompt,
            max_tokens=max_tokens if max_tokens > 0 else DEFAULT_MAX_TOKENS,
            max_ttft_ms=max_ttft, min_decode_tps=min_decode if min_decode > 0 else c.min_decode_tps,
            deadline_ms=deadline, account_id=account, consumer_key=consumer, affinity_key=aff,
            self_route_only=self_route, prefer_owner=prefer_owner,
            requires_vision=bool(e.get("requires_vision")), allowed=frozenset(allowed),
            excluded=frozenset(excluded), avoid_version=avoid, sent_at_ms=sent), ""

    # --- the candidate scan (domain §2.12) ------------------------------------------------------------
    def _is_owner(self, p: ProviderState, req: Request) -> bool:
        return p.account_id is not None and req.account_id is not None and p.account_id == req.account_id

    def passes_gates(self, p: ProviderState, req: Request) -> bool:
        """Structural gates (domain §2.2, rules §4) for a provider advertising the model."""
        c = self.config
        owner = self._is_owner(p, req)
        if p.status == "draining":
            return False
        if p.private_only and not (owner and req.self_route_only):
            return False
        floor_rank = 0 if owner else TRUST_RANK[c.min_trust]
        if TRUST_RANK[p.trust] < floor_rank:
            return False
        pattern = c.is_dedicated(req.model)
        if pattern is not None and not req.self_route_only:
            if any(pattern not in m.lower() for m in p.models):
                return False
        floor = c.version_floor(req.model)
        if floor is not None and (not p.version or compare_versions(p.version, floor) < 0):
            return False
        if req.requires_vision and not p.models[req.model].is_vision:
            return False
        return True

    def scan(self, req: Request, recalibrate: bool | None = None, trace: list | None = None) -> Scan:
        c = self.config
        if recalibrate is None:
            recalibrate = c.prefill_fallback_mode == "enforce"
        res = Scan()
        affinity = self._affinity_lookup(req)
        res.affinity_pid = affinity
        for pid in self.by_model.get(req.model, ()):
            p = self.providers[pid]
            if req.self_route_only and not self._is_owner(p, req):
                continue
            if req.allowed and pid not in req.allowed:
                continue
            if pid in req.excluded:
                continue
            if not self.passes_gates(p, req):
                if trace is not None:
                    trace.append({"provider_id": pid, "verdict": "gated"})
                continue
            res.eligible += 1
            verdict = self._consider(p, req, recalibrate, res, affinity)
            if trace is not None:
                trace.append(verdict)
        return res

    def _consider(self, p: ProviderState, req: Request, recalibrate: bool, res: Scan, affinity) -> dict:
        c, rings, model = self.config, self.rings, req.model
        slot = p.backend.by_model.get(model) if p.backend is not None else None
        state = est.slot_state(p, slot)
        if state in ("crashed", "reloading"):
            return {"provider_id": p.provider_id, "verdict": "slot_" + state}
        if not adm.has_headroom(p, model, slot, c, rings):
            res.capacity_rejections += 1
            return {"provider_id": p.provider_id, "verdict": "no_headroom",
                    "cap": adm.effective_cap(p, model, slot, c, rings),
                    "load": adm.pending_load_for_model(p, model, slot)}
        if p.thermal == "critical":
            return {"provider_id": p.provider_id, "verdict": "thermal_critical"}
        loaded = slot is not None and slot.loaded
        if not loaded and not adm.hardware_fits(p, model):
            res.too_large += 1
            return {"provider_id": p.provider_id, "verdict": "too_large"}
        if not adm.free_memory_admits(p, model, slot, req.prompt, req.max_tokens):
            res.capacity_rejections += 1
            return {"provider_id": p.provider_id, "verdict": "kv_budget",
                    "pooled_remaining": adm.pooled_remaining_tokens(p, model, slot)}
        eff = est.effective_tps(p, model, slot, c, rings)
        prefill, source = est.resolve_prefill(p, model, slot, c, rings, recalibrate)
        raw = est.raw_ttft_ms(p, model, slot, req.prompt, prefill, eff)
        penalty = est.state_penalty(state)
        ratio = self.calibrator.ratio(model, p.family, source) if c.ttft_calibration else 1.0
        ttft = self.calibrator.apply(raw, penalty, ratio)
        has_bc = p.backend is not None
        res.admitted.append((p, slot))
        if not has_bc:
            res.has_ttft = False
        elif ttft > 0 and (res.best_ttft == 0.0 or ttft < res.best_ttft):
            res.best_ttft, res.best_source = ttft, source
        info = {"provider_id": p.provider_id, "ttft_ms": ttft, "raw_ttft_ms": raw,
                "prefill_tps": prefill, "prefill_source": source, "calibration": ratio,
                "effective_tps": eff}
        if req.max_ttft_ms > 0 and has_bc and ttft > req.max_ttft_ms:
            res.ttft_rejections += 1
            info["verdict"] = "ttft_too_slow"
            return info
        cost = est.cost_ms(p, model, slot, c, req.prompt, req.max_tokens, eff, prefill)
        health = est.health_ms(p)
        if affinity == p.provider_id and c.affinity_bonus_ms > 0:
            cost -= min(c.affinity_bonus_ms, cost)
        res.candidates.append(Candidate(
            p=p, slot=slot, cost=cost, ttft=ttft if has_bc else 0.0, raw_ttft=raw,
            prefill_source=source if has_bc else "none", penalty=penalty,
            eff_queue=est.effective_queue(p, model, slot), total_pending=len(p.pending),
            projected_tps=est.projected_decode_tps(p, slot, c), health=health))
        info.update(verdict="candidate", cost_ms=cost)
        return info

    # --- narrowing and selection (domain §2.12, §2.16, §2.17) -----------------------------------------
    def _narrow(self, req: Request, cands: list[Candidate]) -> list[Candidate]:
        if req.prefer_owner:
            owned = [x for x in cands if self._is_owner(x.p, req)]
            cands = owned or cands
        if req.avoid_version:
            other = [x for x in cands if x.p.version != req.avoid_version]
            cands = other or cands
        if req.min_decode_tps > 0:
            fast = [x for x in cands if x.projected_tps >= req.min_decode_tps]
            cands = fast or cands
        return cands

    def band_members(self, req: Request, cands: list[Candidate]) -> list[Candidate]:
        margin = self.config.band_margin_ms
        members = []
        for x in cands:
            if req.max_ttft_ms > 0:
                if x.p.backend is None or x.ttft > req.max_ttft_ms - margin:
                    continue
            elif not (x.slot is not None and x.slot.loaded):
                continue
            if req.min_decode_tps > 0 and x.projected_tps < req.min_decode_tps:
                continue
            members.append(x)
        return members

    def _select(self, req: Request, cands: list[Candidate], affinity: str | None) -> tuple[Candidate, str, int]:
        c = self.config
        if c.band:
            band = self.band_members(req, cands)
            if band:
                pos, how = self._band_choice(req, [x.p.provider_id for x in band], [x.health for x in band],
                                             affinity)
                return band[pos], how, len(band)
        best = cands[0]
        for x in cands[1:]:
            if x.cost < best.cost:
                best = x
        # `or [best]`: with an infinite (or NaN) cost, |cost − best| is NaN and nothing would be
        # a near tie; the best itself always is (finite costs never take this branch)
        near = [x for x in cands if abs(x.cost - best.cost) <= NEAR_TIE_MS] or [best]
        winner = near[0]
        for x in near[1:]:
            if x.eff_queue < winner.eff_queue or (
                    x.eff_queue == winner.eff_queue and x.total_pending < winner.total_pending):
                winner = x
        how = "cheapest"
        equivalent = [x for x in near if x.eff_queue == winner.eff_queue
                      and x.total_pending == winner.total_pending
                      and abs(x.cost - winner.cost) <= NEAR_TIE_MS]
        if len(equivalent) > 1:
            winner = equivalent[math.floor(draw(req.request_id, req.attempt, 0) * len(equivalent))]
            how = "near_tie_random"
        if affinity is not None:
            for x in near:
                if x.p.provider_id == affinity:
                    return x, "affinity", 0
        return winner, how, 0

    def _band_choice(self, req: Request, ids: list[str], healths: list[float], affinity: str | None
                     ) -> tuple[int, str]:
        """Pick among band members (in band order): the affinity provider, the only member, or a
        weighted draw (domain §2.17, rules §2). Returns (position, selected_by)."""
        for i, pid in enumerate(ids):
            if pid == affinity:
                return i, "affinity"
        if len(ids) == 1:
            return 0, "band"
        respect_health = self.config.band_respect_health
        weights = []
        for pid, health in zip(ids, healths):
            w = 1.0 / (1.0 + self.serves.read(pid, self.now))
            if respect_health:
                w = w / (1.0 + health / 1000.0)
            weights.append(w)
        x_draw = draw(req.request_id, req.attempt, 1) * sum(weights)
        for i, w in enumerate(weights):
            x_draw -= w
            if x_draw < 0:
                return i, "band"
        return len(ids) - 1, "band"

    # --- the decision --------------------------------------------------------------------------------
    def _fast_candidate(self, res, i: int) -> Candidate:
        return Candidate(**res.candidate_fields(i))

    def _decide(self, req: Request, out: list, from_queue: bool) -> bool:
        """Decide one request; True if it was routed. A queued re-decision that does not fit
        emits nothing (the request keeps its place). The fast path (streams/candidates.py) decides
        when it can; otherwise, or when it declines, the scalar scan does."""
        c = self.config
        res = pick = None
        if self.fast is not None:
            res = self.fast.scan(req)
            if res is not None and res.candidates:
                pick = self.fast.select(req, res, draw)
                if pick is None:
                    res = None
        if res is None:
            res = self.scan(req)
        if c.prefill_fallback_mode == "shadow" and not from_queue:
            self._shadow(req, res, out)
        if res.candidates:
            if pick is not None:
                row, how, band_n = pick
                winner = self._fast_candidate(res, row)
            else:
                pool = self._narrow(req, res.candidates)
                winner, how, band_n = self._select(req, pool, res.affinity_pid)
            self._reserve(req, winner)
            out.append(self._decision(
                req.request_id, req.attempt, req.model, "routed", None, 200, None,
                provider_id=winner.p.provider_id, ttft=winner.ttft, source=winner.prefill_source,
                cost=winner.cost, selected_by="queue_drain" if from_queue else how,
                band_members=band_n, scan=res))
            out.append(("Reservation", self._reservation(req, winner)))
            return True
        if from_queue:
            return False
        model = req.model
        if res.ttft_rejections > 0:
            over = math.ceil((res.best_ttft - req.max_ttft_ms) / 1000)
            retry = min(30, max(2, max(over, self._retry_after(model))))
            out.append(self._decision(req.request_id, req.attempt, model, "rejected", "ttft_too_slow",
                                      429, retry, ttft=res.best_ttft, source=res.best_source, scan=res))
        elif res.capacity_rejections > 0:
            queue = self.queues.setdefault(model, deque())
            if c.queue_before_shed and c.is_dedicated(model) is None:
                if len(queue) >= c.queue_max_depth:
                    out.append(self._decision(req.request_id, req.attempt, model, "rejected", "queue_full",
                                              429, self._retry_after(model), scan=res))
                else:
                    queue.append(Queued(req, self.now))
                    self.dirty.add(("q", model))
                    out.append(self._decision(req.request_id, req.attempt, model, "queued", None, 202,
                                              None, scan=res))
            else:
                out.append(self._decision(req.request_id, req.attempt, model, "rejected", "machine_busy",
                                          429, self._retry_after(model), scan=res))
        elif res.too_large > 0:
            out.append(self._decision(req.request_id, req.attempt, model, "rejected", "model_too_large",
                                      503, None, scan=res))
        else:
            out.append(self._decision(req.request_id, req.attempt, model, "rejected", "no_provider",
                                      503, self._retry_after(model), scan=res))
        return False

    def _shadow(self, req: Request, res: Scan, out: list) -> None:
        """#453 shadow telemetry: for a request whose live best TTFT misses its deadline, would the
        anchor have admitted it? Routing is unchanged."""
        if not res.has_ttft or res.best_ttft <= req.deadline_ms:
            return
        best = 0.0
        for p, slot in res.admitted:
            eff = est.effective_tps(p, req.model, slot, self.config, self.rings)
            prefill, source = est.resolve_prefill(p, req.model, slot, self.config, self.rings, True)
            raw = est.raw_ttft_ms(p, req.model, slot, req.prompt, prefill, eff)
            ratio = self.calibrator.ratio(req.model, p.family, source) if self.config.ttft_calibration else 1.0
            t = self.calibrator.apply(raw, est.state_penalty(est.slot_state(p, slot)), ratio)
            if t > 0 and (best == 0.0 or t < best):
                best = t
        decision = "would_admit" if 0 < best <= req.deadline_ms else "would_shed"
        gate = "hard" if self.config.ttft_hard_reject else "soft"
        self.counters[f"prefill_shadow_{decision}"] += 1
        out.append(("PrefillShadow", {"decision": decision, "gate": gate, "model": req.model}))

    def _reserve(self, req: Request, winner: Candidate) -> None:
        p = winner.p
        self.dirty.add(("pd", p.provider_id))
        p.add_pending(req.key, req.model, req.tokens, self.now)
        if p.status == "idle":
            p.status = "serving"
            self.dirty.add(("p", p.provider_id))
        if self.fast is not None:
            self.fast.pending_changed(p, req.model)
        self.reservations[req.key] = p.provider_id
        self.serves.record(p.provider_id, self.now)
        if winner.penalty == 0 and not req.requires_vision and winner.raw_ttft > 0:
            self.calibrator.note_prediction(req.key, req.model, p.family, winner.prefill_source,
                                            winner.raw_ttft, self.now, self._next_seq())
        if req.consumer_key and req.affinity_key:
            pin = (req.consumer_key, req.model, req.affinity_key)
            self.affinity.pop(pin, None)
            self.affinity[pin] = (p.provider_id, self.now)
            self.affinity_seq[pin] = self._next_seq()
            self.dirty.add(("a", *pin))
            while len(self.affinity) > AFFINITY_MAX:
                old = self.affinity.popitem(last=False)[0]
                self.affinity_seq.pop(old, None)
                self.dirty.add(("a", *old))

    def _affinity_lookup(self, req: Request) -> str | None:
        if not (req.consumer_key and req.affinity_key) or self.config.affinity_bonus_ms <= 0:
            return None
        hit = self.affinity.get((req.consumer_key, req.model, req.affinity_key))
        if hit is None or self.now - hit[1] >= self.config.affinity_ttl_ms:
            return None
        return hit[0]

    def _reservation(self, req: Request, winner: Candidate) -> dict:
        rate = winner.slot.kv_bytes_per_token if winner.slot is not None else 0
        return {"request_id": req.request_id, "attempt": req.attempt,
                "provider_id": winner.p.provider_id, "model": req.model, "tokens": req.tokens,
                "kv_bytes": req.tokens * rate, "reserved_at_ms": self.now,
                "journal_offset": self.offset}

    def _retry_after(self, model: str) -> int:
        q = self.queues.get(model)
        return retry_after_for_depth(len(q) if q else 0)

    def _reject(self, req: Request, reason: str, status: int, retry: int | None):
        return self._decision(req.request_id, req.attempt, req.model, "rejected", reason, status, retry)

    def _decision(self, request_id, attempt, model, outcome, reason, status, retry, *, provider_id=None,
                  ttft=0.0, source="none", cost=0.0, selected_by="", band_members=0, scan=None):
        self.counters[f"decisions_{outcome}_{reason or 'ok'}"] += 1
        return ("RouteDecision", {
            "request_id": request_id, "attempt": attempt, "outcome": outcome,
            "provider_id": provider_id, "model": model, "reason": reason, "http_status": status,
            "retry_after_s": retry, "estimated_ttft_ms": float(ttft), "prefill_source": source,
            "cost_ms": float(cost), "selected_by": selected_by, "band_members": band_members,
            "candidates": len(scan.candidates) if scan else 0,
            "capacity_rejections": scan.capacity_rejections if scan else 0,
            "too_large": scan.too_large if scan else 0,
            "ttft_rejections": scan.ttft_rejections if scan else 0,
            "journal_offset": self.offset, "config_id": self.config.config_id,
            "decided_at_ms": self.now})

    # --- queue drain (rules §6) ----------------------------------------------------------------------
    def _drain(self, p: ProviderState, out: list) -> None:
        for model in sorted(p.models):
            q = self.queues.get(model)
            if not q:
                continue
            keep: deque[Queued] = deque()
            while q:
                item = q.popleft()
                if not self._decide(item.request, out, from_queue=True):
                    keep.append(item)
            self.queues[model] = keep
            self.dirty.add(("q", model))

    # === capacity feed (domain §2.10.7) =============================================================
    def capacity(self, model: str) -> dict:
        """The per-model capacity feed (domain §2.10.7), from the model's candidate index when the
        fast path has one (one compiled pass), else by the loop below (the same figures)."""
        got = self.fast.capacity(model, CAPACITY_FEED_PROMPT) if self.fast is not None else None
        if got is None:
            got = self._capacity_scan(model)
        routable, concurrency, tokens, best_ttft = got
        return {"model": model, "routable_providers": routable, "remaining_concurrency": concurrency,
                "remaining_tokens": tokens, "estimated_ttft_ms": best_ttft, "at_ms": self.now,
                "journal_offset": self.offset}

    def _capacity_scan(self, model: str) -> tuple[int, int, int, float]:
        c, rings = self.config, self.rings
        probe = Request(request_id="", attempt=0, model=model, prompt=CAPACITY_FEED_PROMPT,
                        max_tokens=DEFAULT_MAX_TOKENS, max_ttft_ms=0.0, min_decode_tps=0.0,
                        deadline_ms=0.0, account_id=None, consumer_key=None, affinity_key=None,
                        self_route_only=False, prefer_owner=False, requires_vision=False,
                        allowed=frozenset(), excluded=frozenset(), avoid_version=None, sent_at_ms=0)
        recalibrate = c.prefill_fallback_mode == "enforce"
        routable, concurrency, tokens, best_ttft = 0, 0, 0, 0.0
        for pid in self.by_model.get(model, ()):
            p = self.providers[pid]
            if not self.passes_gates(p, probe) or p.thermal == "critical":
                continue
            slot = p.backend.by_model.get(model) if p.backend is not None else None
            if est.slot_state(p, slot) in ("crashed", "reloading"):
                continue
            remaining = adm.pooled_remaining_tokens(p, model, slot)
            budget_ok = slot is None or slot.budget_max <= 0 or \
                slot.budget_used + slot.queued_budget < slot.budget_max
            cap = adm.effective_cap(p, model, slot, c, rings)  # once: headroom and concurrency
            if not (adm.has_headroom(p, model, slot, c, rings, cap) and budget_ok and remaining != 0):
                continue
            routable += 1
            concurrency += max(0, min(cap - adm.pending_load_for_model(p, model, slot),
                                      p.box_max_concurrency(c) - len(p.pending)))
            if slot is not None and slot.budget_max > 0:
                head = max(0, slot.budget_max - slot.budget_used - slot.queued_budget)
                tokens += min(head, remaining) if remaining >= 0 else head
            elif remaining > 0:
                tokens += remaining
            if p.backend is not None:
                eff = est.effective_tps(p, model, slot, c, rings)
                prefill, source = est.resolve_prefill(p, model, slot, c, rings, recalibrate)
                raw = est.raw_ttft_ms(p, model, slot, CAPACITY_FEED_PROMPT, prefill, eff)
                ratio = self.calibrator.ratio(model, p.family, source) if c.ttft_calibration else 1.0
                t = self.calibrator.apply(raw, est.state_penalty(est.slot_state(p, slot)), ratio)
                if t > 0 and (best_ttft == 0.0 or t < best_ttft):
                    best_ttft = t
        return routable, concurrency, tokens, best_ttft

    def models(self) -> list[str]:
        return sorted(m for m, ids in self.by_model.items() if ids)

    _HANDLERS = {
        "ProviderRegistered": _on_registered, "Heartbeat": _on_heartbeat,
        "ProviderDisconnected": _on_disconnected, "RouteRequest": _on_request,
        "Completion": _on_completion, "ConfigChange": _on_config, "Tick": _on_tick,
    }
