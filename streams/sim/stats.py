"""Figures both modes report: percentiles, outcome labels, traffic spread."""
from __future__ import annotations

import math
from collections import Counter


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not len(values):
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def outcome_label(d: dict) -> str:
    return d["outcome"] if d["outcome"] in ("routed", "queued") else f"rejected:{d['reason']}"


def spread(served: Counter, specs) -> dict:
    """How routed requests spread over machines: the top 10 % of machines' share (of all machines
    and of the routable, hardware-trusted ones), machines that served nothing, and a Gini index."""
    counts = sorted((served.get(s.machine, 0) for s in specs), reverse=True)
    total = sum(counts)
    n = len(counts)
    top_n = max(1, round(n * 0.1))
    routable = [s for s in specs if s.trust == "hardware"]
    r_counts = sorted((served.get(s.machine, 0) for s in routable), reverse=True)
    r_top = max(1, round(len(r_counts) * 0.1)) if r_counts else 0
    r_total = sum(r_counts)
    return {"top10_share": (sum(counts[:top_n]) / total) if total else 0.0, "top_n": top_n,
            "routable_top10_share": (sum(r_counts[:r_top]) / r_total) if r_total else 0.0,
            "served_nothing": sum(1 for c in counts if c == 0),
            "routable_served_nothing": sum(1 for c in r_counts if c == 0),
            "routable": len(routable), "machines": n, "total": total, "gini": gini(r_counts)}


def gini(counts) -> float:
    xs = sorted(counts)
    n, total = len(xs), sum(xs)
    if n == 0 or total == 0:
        return 0.0
    cum = sum((i + 1) * x for i, x in enumerate(xs))
    return (2 * cum) / (n * total) - (n + 1) / n


def fmt(v: float, digits: int = 1) -> str:
    return "-" if v != v else f"{v:,.{digits}f}"
