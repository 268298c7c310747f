"""Routing settings: names, defaults, normalisation, patches and the config id.

The routing core never reads the environment. A worker builds a `Config` from its environment once
(`Config.from_env`, an adapter concern), records it in the journal as a ConfigChange, and every
later change arrives as a ConfigChange patch (rules §3). Names and defaults are the seed's
(`EIGENINFERENCE_*`, domain §3) plus the settings this project adds (rules §3).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

PREFIX = "EIGENINFERENCE_"


class ConfigError(ValueError):
    """A setting that cannot be parsed, is non-finite, or does not exist."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.setting = name


# --- value parsers -------------------------------------------------------------------------------
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def _float(raw: str) -> float:
    v = float(raw.strip())
    if not math.isfinite(v):
        raise ValueError(f"not finite: {raw!r}")
    return v


def _int(raw: str) -> int:
    v = _float(raw)
    if v != int(v):
        raise ValueError(f"not an integer: {raw!r}")
    return int(v)


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0, "h": 3600000.0}


def _duration_ms(raw: str) -> float:
    """Milliseconds as a number, or a Go duration string such as `30s`, `10m`, `1h30m`."""
    v = raw.strip()
    try:
        return _float(v)
    except ValueError:
        pass
    sign = -1.0 if v.startswith("-") else 1.0
    body = v.lstrip("+-")
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f"not a duration: {raw!r}")
    return sign * total


def _text(raw: str) -> str:
    return raw.strip()


# --- CSV maps (domain §2.6.4, §2.9) ---------------------------------------------------------------
def parse_model_float_map(raw: str) -> dict[str, float]:
    """`build=float,...`; keys lowercased; malformed, non-finite or ≤ 0 entries are skipped."""
    out: dict[str, float] = {}
    for entry in raw.split(","):
        entry = entry.strip()
        if "=" not in entry:
            continue
        key, _, value = entry.partition("=")
        key = key.strip().lower()
        if not key:
            continue
        try:
            f = float(value.strip())
        except ValueError:
            continue
        if not math.isfinite(f) or f <= 0:
            continue
        out[key] = f
    return out


def parse_version_floors(raw: str) -> tuple[tuple[str, str], ...]:
    """`pattern=version,...` in order; malformed entries are skipped (no floor, never a wrong one)."""
    out = []
    for entry in raw.split(","):
        entry = entry.strip()
        if "=" not in entry:
            continue
        pattern, _, version = entry.partition("=")
        pattern, version = pattern.strip().lower(), version.strip()
        if pattern and version:
            out.append((pattern, version))
    return tuple(out)


def parse_patterns(raw: str) -> tuple[str, ...]:
    v = raw.strip()
    if v.lower() == "none":
        return ()
    return tuple(p.strip().lower() for p in v.split(",") if p.strip())


# --- the settings table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    attr: str
    default: str
    parse: Callable[[str], Any]
    normalise: Callable[[Any], Any] = staticmethod(lambda v: v)  # type: ignore[assignment]


def _positive_or(default: float):
    return lambda v: v if v > 0 else default


def _at_least(lo, default):
    return lambda v: v if v >= lo else default


def _enum(allowed: tuple[str, ...], fallback: str):
    return lambda v: v.lower() if v.lower() in allowed else fallback


SETTINGS: dict[str, Setting] = {
    "QUALITY_CONCURRENCY_CAP": Setting("quality_cap", "true", _bool),
    "QUALITY_CONCURRENCY_OVERCOMMIT": Setting("overcommit", "1.2", _float, lambda v: v if v > 0 else 1.0),
    "QUALITY_CONCURRENCY_OVERCOMMIT_BY_MODEL": Setting("overcommit_by_model", "", parse_model_float_map),
    "QUALITY_CAP_PER_MODEL_TPS": Setting("per_model_tps", "true", _bool),
    "QUALITY_CAP_SOLO_MIN_SAMPLES": Setting("solo_min_samples", "5", _int, lambda v: max(1, v)),
    "MODEL_SOLO_TPS_SEED": Setting("solo_seed", "", parse_model_float_map),
    "WARM_POOL_DECODE_FLOOR_TPS": Setting("decode_floor", "15", _float),
    "WARM_POOL_FALLBACK_QUALITY_CONCURRENCY": Setting("fallback_concurrency", "4", _int, lambda v: max(1, v)),
    "DEDICATED_MODELS": Setting("dedicated", "", parse_patterns),
    "V2_VERSION_FLOOR": Setting("v2_floor", "", _text),
    "V2_MAX_CONCURRENCY_CEILING": Setting("v2_ceiling", "4", _int, _at_least(1, 4)),
    "MODEL_VERSION_FLOORS": Setting("version_floors", "", parse_version_floors),
    "TTFT_PREFILL_MEDIANS": Setting("prefill_medians", "true", _bool),
    "TTFT_PREFILL_MIN_SAMPLES": Setting("prefill_min_samples", "5", _int, lambda v: max(1, v)),
    "PREFILL_FALLBACK_MODE": Setting("prefill_fallback_mode", "off", _text, _enum(("off", "shadow", "enforce"), "off")),
    "PREFILL_FALLBACK_TPS": Setting("prefill_anchor_tps", "6500", _float, _positive_or(6500.0)),
    "MAX_PREFILL_TPS": Setting("max_prefill_tps", "20000", _float, _positive_or(20000.0)),
    "PREFILL_DECODE_RATIO": Setting("prefill_decode_ratio", "12", _float, _positive_or(12.0)),
    "TTFT_CALIBRATION": Setting("ttft_calibration", "on", _bool),
    "TTFT_HARD_REJECT": Setting("ttft_hard_reject", "false", _bool),
    "TTFT_LIVE_DEADLINE_BASE_MS": Setting("deadline_base_ms", "5000", _float, _positive_or(5000.0)),
    "MIN_DECODE_TPS": Setting("min_decode_tps", "15", _float, _at_least(0, 15.0)),
    "SATISFICING_BAND": Setting("band", "false", _bool),
    "SATISFICING_TTFT_MARGIN_MS": Setting("band_margin_ms", "1000", _float, lambda v: max(0.0, v)),
    "SATISFICING_RESPECT_HEALTH": Setting("band_respect_health", "false", _bool),
    "LONG_PROMPT_TOKENS": Setting("long_prompt_tokens", "0", _int, lambda v: max(0, v)),
    "LONG_PROMPT_PREFILL_WEIGHT": Setting("long_prompt_weight", "2.0", _float, lambda v: v if v >= 1 else 1.0),
    "CACHE_AFFINITY_TTL": Setting("affinity_ttl_ms", "10m", _duration_ms, _positive_or(600000.0)),
    "CACHE_AFFINITY_BONUS_MS": Setting("affinity_bonus_ms", "1500", _float, lambda v: v if 0 <= v <= 10000 else 1500.0),
    "QUEUE_BEFORE_SHED": Setting("queue_before_shed", "true", _bool),
    "COLD_DISPATCH": Setting("cold_dispatch", "true", _bool),
    "QUEUE_MAX_DEPTH": Setting("queue_max_depth", "10", _int, _positive_or(10)),
    "QUEUE_MAX_WAIT": Setting("queue_max_wait_ms", "30s", _duration_ms, _positive_or(30000.0)),
    "MIN_TRUST": Setting("min_trust", "hardware", _text, _enum(("none", "self_signed", "hardware"), "hardware")),
    "DECODE_FLOOR_USE_FLEET_MEDIAN": Setting("decode_floor_fleet_median", "false", _bool),
    "COMBINED_ADMISSION_CAP": Setting("combined_admission_cap", "false", _bool),
    "EFFECTIVE_TPS_LOAD_FACTOR": Setting("k", "0.27", _float, lambda v: max(0.0, v)),
    "PROVIDER_STALE_MS": Setting("provider_stale_ms", "90000", _duration_ms, _positive_or(90000.0)),
    "TICK_INTERVAL_MS": Setting("tick_interval_ms", "1000", _duration_ms, _positive_or(1000.0)),
    "ROUTE_WAIT_BUDGET_MS": Setting("route_wait_budget_ms", "0", _duration_ms, lambda v: max(0.0, v)),
}

NAMES = tuple(PREFIX + short for short in SETTINGS)


def _short(name: str) -> str:
    if not name.startswith(PREFIX) or name[len(PREFIX):] not in SETTINGS:
        raise ConfigError(name, "unknown setting")
    return name[len(PREFIX):]


class Config:
    """Immutable, normalised settings. Attribute names are in `SETTINGS[...].attr`."""

    __slots__ = ("raw", "config_id", "__dict__")

    def __init__(self, raw: Mapping[str, str] | None = None):
        values: dict[str, str] = {}
        for name, value in (raw or {}).items():
            short = _short(name)
            if not isinstance(value, str):
                raise ConfigError(name, f"value must be a string, got {type(value).__name__}")
            if value != "":
                values[PREFIX + short] = value
        parsed = {}
        for short, s in SETTINGS.items():
            text = values.get(PREFIX + short, s.default)
            try:
                parsed[s.attr] = s.normalise(s.parse(text))
            except (ValueError, OverflowError) as e:
                raise ConfigError(PREFIX + short, str(e)) from None
        object.__setattr__(self, "raw", MappingProxyType(dict(sorted(values.items()))))
        self.__dict__.update(parsed)
        everything = {PREFIX + short: values.get(PREFIX + short, s.default) for short, s in SETTINGS.items()}
        digest = hashlib.sha256(json.dumps(everything, sort_keys=True).encode()).hexdigest()
        object.__setattr__(self, "config_id", digest[:16])

    def __setattr__(self, key, value):
        raise AttributeError("Config is immutable")

    def patched(self, settings: Mapping[str, str]) -> "Config":
        """Apply a ConfigChange patch: present keys replace, "" resets to default, absent unchanged."""
        merged = dict(self.raw)
        for name, value in settings.items():
            short = _short(name)
            if value == "":
                merged.pop(PREFIX + short, None)
            else:
                merged[PREFIX + short] = value
        return Config(merged)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Config":
        """Adapter helper: the EIGENINFERENCE_* variables of an environment mapping."""
        return cls({k: v for k, v in environ.items() if k.startswith(PREFIX)})

    def is_dedicated(self, model: str) -> str | None:
        m = model.lower()
        for pattern in self.dedicated:
            if pattern in m:
                return pattern
        return None

    def version_floor(self, model: str) -> str | None:
        m = model.lower()
        for pattern, version in self.version_floors:
            if pattern in m:
                return version
        return None

    def overcommit_for(self, model: str) -> float:
        return self.overcommit_by_model.get(model.lower(), self.overcommit)

    def __repr__(self):
        return f"Config({dict(self.raw)!r}, id={self.config_id})"

    def __eq__(self, other):
        return isinstance(other, Config) and other.config_id == self.config_id

    def __hash__(self):
        return hash(self.config_id)


DEFAULT = Config()
