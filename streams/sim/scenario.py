"""A resolved run: preset + fleet size + rate + duration + seed + settings + arrivals source.

Shared by the offline and live modes (and the demo). Settings are layered: the preset's, then the
EIGENINFERENCE_* variables of the environment (as a worker reads them), then `--setting NAME=VALUE`.
The gateway stamps requests from the effective settings: `max_ttft_ms` when the hard TTFT gate is
on, `min_decode_tps` = EIGENINFERENCE_MIN_DECODE_TPS (default 15).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from ..config import DEFAULT, PREFIX, Config
from . import arrivals as arr
from . import presets as ps
from .fleet import ProviderSpec, build_fleet


@dataclass
class Scenario:
    preset: ps.Preset
    providers: int
    rate: float               # arrivals per second (all models)
    duration_s: float
    seed: int
    heartbeat_s: float
    settings: dict            # effective worker settings (recorded as the run's ConfigChange)
    trace: str | None = None
    trace_scale: float | None = None   # None: fitted so the trace's rate equals `rate`
    tick_ms: int = 1000
    retries: int = 0
    traffic: dict = field(default_factory=dict)

    @property
    def config(self) -> Config:
        return DEFAULT.patched(self.settings)

    @property
    def hard_ttft(self) -> bool:
        return self.config.ttft_hard_reject

    @property
    def min_decode_tps(self) -> float:
        return self.config.min_decode_tps

    @property
    def deadline_base_ms(self) -> float:
        return self.config.deadline_base_ms

    def fleet(self) -> list[ProviderSpec]:
        return build_fleet(list(self.preset.groups), self.providers, self.seed, cover_models=tuple(self.preset.mix))

    def traffic_model(self) -> arr.Traffic:
        kw = dict(self.preset.traffic)
        kw.update(self.traffic)
        return arr.Traffic(rate=self.rate, mix=dict(self.preset.mix), **kw)

    def effective_trace_scale(self, rows) -> float:
        if self.trace_scale is not None:
            return self.trace_scale
        return self.rate / arr.trace_rate(rows)

    def arrivals(self) -> Iterator[arr.Arrival]:
        if self.trace:
            rows = arr.load_trace(self.trace)
            tm = self.traffic_model()
            return arr.replay_trace(rows, self.duration_s, self.seed, tm.mix, scale=self.effective_trace_scale(rows),
                                    omitted_max_share=tm.omitted_max_share, default_max_tokens=tm.default_max_tokens,
                                    consumer=self.trace)
        return arr.synthetic(self.traffic_model(), self.duration_s, self.seed)

    def describe(self) -> dict:
        d = {"preset": self.preset.name, "providers": self.providers, "rate": round(self.rate, 4),
             "duration_s": self.duration_s, "seed": self.seed, "heartbeat_s": self.heartbeat_s,
             "settings": dict(sorted(self.settings.items())), "tick_ms": self.tick_ms, "retries": self.retries}
        if self.trace:
            d["trace"] = self.trace
            d["trace_scale"] = self.trace_scale if self.trace_scale is not None else "fitted to rate"
        return d


def layered_settings(preset: ps.Preset, environ: Mapping[str, str] | None = None,
                     overrides: list[str] | tuple = ()) -> dict:
    settings = dict(preset.settings)
    env = os.environ if environ is None else environ
    for k, v in env.items():
        if k.startswith(PREFIX):
            settings[k] = v
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--setting wants NAME=VALUE, got {item!r}")
        name = name.strip()
        name = name if name.startswith(PREFIX) else PREFIX + name
        settings[name] = value
    settings = {k: v for k, v in settings.items() if v != "" or k in preset.settings}
    DEFAULT.patched(settings)  # raises ConfigError on an unknown name or a bad value
    return settings


def resolve(preset: str = "default", *, providers: int | None = None, rate: float | None = None,
            duration_s: float = 300.0, seed: int = 1, heartbeat_s: float | None = None,
            settings: list[str] | tuple = (), environ: Mapping[str, str] | None = None,
            trace: str | None = None, trace_scale: float | None = None, tick_ms: int = 1000,
            retries: int = 0, traffic: dict | None = None) -> Scenario:
    p = ps.get(preset)
    n = providers if providers is not None else p.providers
    if n < 1:
        raise SystemExit("--providers must be at least 1")
    r = rate if rate is not None else p.rate_per_provider * n
    if r <= 0 or duration_s <= 0:
        raise SystemExit("--rate and --duration must be positive")
    if trace is not None and trace not in arr.TRACES:
        raise SystemExit(f"unknown trace {trace!r}; one of: {', '.join(arr.TRACES)}")
    return Scenario(preset=p, providers=n, rate=r, duration_s=duration_s, seed=seed,
                    heartbeat_s=heartbeat_s if heartbeat_s is not None else p.heartbeat_s,
                    settings=layered_settings(p, environ, settings), trace=trace, trace_scale=trace_scale,
                    tick_ms=tick_ms, retries=retries, traffic=dict(traffic or {}))
