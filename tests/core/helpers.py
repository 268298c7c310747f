"""Event builders and a tiny journal driver for the routing-core tests.

Every builder returns a journal line as a plain dict: `{"type": <record name>, ...record fields}`
(the JSON Lines form of events.md). `Journal` pops "type" and the optional "journal_offset" /
"journal_time_ms" keys, feeds the record to `Router.apply`, and keeps every output.

Defaults are the common fixture of domain §4: an Apple M3 Max (family "M3", tier "Max"), 64 GB,
400 GB/s, hardware trust, version 0.7.5, no prefill benchmark; heartbeats report memory pressure
0.1, cpu 0.1, thermal nominal, a backend with 64 GB total and nothing active, so the health
penalty of the fixture is 4000·0.1 + 1500·0.1 = 550 ms.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

from streams.config import Config
from streams.router import Router

GPT_OSS = "gpt-oss-20b"
GEMMA = "gemma-4-26b-qat-4bit"
QWEN = "qwen3.5-35b"

FIXTURE_HEALTH_MS = 550.0
EXAMPLES = Path("/work/shared/spec/examples")

_ids = itertools.count(1)


def _event_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


# --- settings ----------------------------------------------------------------------------------------
def settings(**short) -> dict[str, str]:
    """settings(SATISFICING_BAND="true") -> {"EIGENINFERENCE_SATISFICING_BAND": "true"}."""
    return {f"EIGENINFERENCE_{k}": str(v) for k, v in short.items()}


def config(**short) -> Config:
    return Config(settings(**short))


# --- provider events -----------------------------------------------------------------------------------
def model_entry(model: str, size_gb: float = 0.0, min_ram_gb: float = 0.0, is_vision: bool = False) -> dict:
    return {"id": model, "size_bytes": int(size_gb * 1e9), "min_ram_gb": min_ram_gb, "is_vision": is_vision}


def registered(pid: str, decode_tps: float = 0.0, models=(GPT_OSS,), *, version: str = "0.7.5",
               family: str = "M3", tier: str = "Max", memory_gb: float = 64.0, bandwidth: float = 400.0,
               trust: str = "hardware", account_id: str | None = None, private_only: bool = False,
               prefill_tps: float = 0.0, at_ms: int = 0, event_id: str | None = None,
               chip_name: str | None = None) -> dict:
    """ProviderRegistered. `models` items are ids or full `model_entry` dicts."""
    entries = [m if isinstance(m, dict) else model_entry(m) for m in models]
    return {
        "type": "ProviderRegistered", "event_id": event_id or _event_id(f"reg-{pid}"),
        "provider_id": pid, "registered_at_ms": at_ms, "version": version, "account_id": account_id,
        "trust_level": trust, "private_only": private_only,
        "hardware": {"chip_name": chip_name if chip_name is not None else f"Apple {family} {tier}".strip(),
                     "chip_family": family, "chip_tier": tier, "memory_gb": memory_gb,
                     "memory_bandwidth_gbs": bandwidth, "gpu_cores": 40},
        "decode_tps": decode_tps, "prefill_tps": prefill_tps, "models": entries,
    }


def slot(model: str = GPT_OSS, state: str = "running", **fields) -> dict:
    """A backend slot; fields use the wire names (num_running, active_token_budget_max, ...).
    Short aliases: running, waiting, budget_max, budget_used, queued_budget, potential, kv,
    decode (observed_decode_tps), prefill (observed_prefill_tps)."""
    alias = {"running": "num_running", "waiting": "num_waiting", "budget_max": "active_token_budget_max",
             "budget_used": "active_token_budget_used", "queued_budget": "queued_token_budget",
             "potential": "max_tokens_potential", "kv": "kv_bytes_per_token",
             "decode": "observed_decode_tps", "prefill": "observed_prefill_tps"}
    s = {"model": model, "state": state, "num_running": 0, "num_waiting": 0, "max_concurrency": 0,
         "active_tokens": 0, "max_tokens_potential": 0, "observed_decode_tps": 0.0,
         "observed_prefill_tps": 0.0, "active_token_budget_used": 0, "active_token_budget_max": 0,
         "queued_token_budget": 0, "kv_bytes_per_token": 0, "model_load_time_ms": 0}
    for k, v in fields.items():
        s[alias.get(k, k)] = v
    return s


_NO_SLOTS = object()


def heartbeat(pid: str, seq: int = 0, slots=_NO_SLOTS, *, at_ms: int = 0, status: str = "idle",
              memory_pressure: float = 0.1, cpu_usage: float = 0.1, thermal: str = "nominal",
              total_memory_gb: float = 64.0, gpu_active_gb: float = 0.0,
              free_for_load_gb: float | None = None, legacy: bool = False,
              event_id: str | None = None) -> dict:
    """Heartbeat. `slots` defaults to one idle-running gpt-oss slot (the §4 fixture); `legacy=True`
    sends no backend_capacity at all."""
    if slots is _NO_SLOTS:
        slots = [slot(GPT_OSS)]
    backend = None if legacy else {
        "total_memory_gb": total_memory_gb, "gpu_memory_active_gb": gpu_active_gb,
        "free_for_load_gb": free_for_load_gb, "slots": list(slots)}
    return {
        "type": "Heartbeat", "event_id": event_id or _event_id(f"hb-{pid}"), "provider_id": pid,
        "seq": seq, "sent_at_ms": at_ms, "status": status,
        "warm_models": [s["model"] for s in (slots or []) if s["state"] in ("running", "idle")],
        "system_metrics": {"memory_pressure": memory_pressure, "cpu_usage": cpu_usage,
                           "thermal_state": thermal},
        "backend_capacity": backend,
    }


def disconnected(pid: str, at_ms: int = 0, reason: str = "closed", event_id: str | None = None) -> dict:
    return {"type": "ProviderDisconnected", "event_id": event_id or _event_id(f"dc-{pid}"),
            "provider_id": pid, "at_ms": at_ms, "reason": reason}


# --- requests and completions ----------------------------------------------------------------------------
def request(rid: str, model: str = GPT_OSS, prompt: int = 100, max_tokens: int = 256, *, at_ms: int = 0,
            attempt: int = 0, max_ttft_ms: float = 0.0, min_decode_tps: float = 0.0, **fields) -> dict:
    r = {"type": "RouteRequest", "request_id": rid, "attempt": attempt, "model": model,
         "prompt_tokens": prompt, "max_tokens": max_tokens, "max_ttft_ms": max_ttft_ms,
         "min_decode_tps": min_decode_tps, "account_id": None, "consumer_key": None,
         "cache_affinity_key": None, "self_route_only": False, "prefer_owner": False,
         "requires_vision": False, "allowed_provider_ids": [], "excluded_provider_ids": [],
         "avoid_version": None, "reply_to": "", "sent_at_ms": at_ms}
    r.update(fields)
    return r


def completion(rid: str, provider_id: str = "", model: str = GPT_OSS, status: str = "ok", *,
               attempt: int = 0, ttft_ms: float = 0.0, at_ms: int = 0, prompt: int = 100,
               completion_tokens: int = 10, event_id: str | None = None) -> dict:
    return {"type": "Completion", "event_id": event_id or _event_id(f"done-{rid}"), "request_id": rid,
            "attempt": attempt, "provider_id": provider_id, "model": model, "status": status,
            "prompt_tokens": prompt, "completion_tokens": completion_tokens, "ttft_ms": ttft_ms,
            "completed_at_ms": at_ms}


def tick(at_ms: int) -> dict:
    return {"type": "Tick", "at_ms": at_ms}


def config_change(changes: dict[str, str], at_ms: int = 0, config_id: str = "test") -> dict:
    """ConfigChange; `changes` keys may be short ("SATISFICING_BAND") or full names."""
    full = {k if k.startswith("EIGENINFERENCE_") else f"EIGENINFERENCE_{k}": v for k, v in changes.items()}
    return {"type": "ConfigChange", "config_id": config_id, "settings": full, "changed_at_ms": at_ms,
            "author": "test"}


# --- the random draw of rules §2, computed independently of the core ---------------------------------------
def u(request_id: str, attempt: int, k: int) -> float:
    digest = hashlib.sha256(f"{request_id}|{attempt}|{k}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / 2**53


def near_tie_pick(request_id: str, ids: list[str], attempt: int = 0) -> str:
    return ids[math.floor(u(request_id, attempt, 0) * len(ids))]


# --- the journal driver ------------------------------------------------------------------------------------
class Journal:
    """Feeds journal lines to a Router with increasing offsets and keeps the outputs."""

    def __init__(self, config: Config | None = None, **short_settings):
        if config is None:
            config = Config(settings(**short_settings))
        self.router = Router(config)
        self.offset = 0
        self.outputs: list[tuple[str, dict]] = []
        self.seqs: dict[str, int] = {}

    def apply(self, *lines: dict) -> list[tuple[str, dict]]:
        """Apply lines in order; returns the outputs of these lines only."""
        out = []
        for line in lines:
            record = dict(line)
            type_name = record.pop("type")
            offset = record.pop("journal_offset", self.offset)
            jtime = record.pop("journal_time_ms", None)
            out += self.router.apply(offset, jtime, type_name, record)
            self.offset = offset + 1
        self.outputs += out
        return out

    # convenient views
    @staticmethod
    def decisions_in(outputs) -> list[dict]:
        return [r for t, r in outputs if t == "RouteDecision"]

    @property
    def decisions(self) -> list[dict]:
        return self.decisions_in(self.outputs)

    def decide(self, line: dict) -> dict:
        """Apply one RouteRequest and return its (single) decision."""
        ds = self.decisions_in(self.apply(line))
        assert len(ds) == 1, ds
        return ds[0]

    def route(self, rid: str, model: str = GPT_OSS, prompt: int = 100, max_tokens: int = 256, **kw) -> dict:
        kw.setdefault("at_ms", self.router.now)
        return self.decide(request(rid, model, prompt, max_tokens, **kw))

    def release(self, decision: dict, status: str = "ok", ttft_ms: float = 0.0) -> list:
        """Complete a routed decision (frees its reservation)."""
        return self.apply(completion(decision["request_id"], decision["provider_id"], decision["model"],
                                     status, attempt=decision["attempt"], ttft_ms=ttft_ms,
                                     at_ms=self.router.now))

    def provider(self, pid: str = "box-a", decode_tps: float = 0.0, models=(GPT_OSS,), slots=_NO_SLOTS,
                 hb: dict | None = None, **reg) -> None:
        """Register a provider and send its first heartbeat (the §4 fixture unless overridden)."""
        at = self.router.now
        self.seqs[pid] = 1
        self.apply(registered(pid, decode_tps, models, at_ms=at, **reg),
                   heartbeat(pid, 1, slots, at_ms=at, **(hb or {})))

    def beat(self, pid: str, slots=_NO_SLOTS, **kw) -> list:
        """Send the provider's next sequenced heartbeat at the current time."""
        self.seqs[pid] = self.seqs.get(pid, 0) + 1
        kw.setdefault("at_ms", self.router.now)
        return self.apply(heartbeat(pid, self.seqs[pid], slots, **kw))

    # state views
    def p(self, pid: str):
        return self.router.providers[pid]

    def slot(self, pid: str, model: str = GPT_OSS):
        b = self.router.providers[pid].backend
        return b.by_model.get(model) if b is not None else None

    @property
    def config(self) -> Config:
        return self.router.config


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_journal_file(path: Path) -> list[dict]:
    """Replay a JSON Lines journal (offset = `journal_offset` or line index) and return the
    RouteDecision records in emission order."""
    router = Router()
    decisions = []
    for index, line in enumerate(read_jsonl(path)):
        type_name = line.pop("type")
        offset = line.pop("journal_offset", index)
        jtime = line.pop("journal_time_ms", None)
        decisions += [r for t, r in router.apply(offset, jtime, type_name, line) if t == "RouteDecision"]
    return decisions
