"""Side-by-side report of two runs of one journal (recorded vs what-if), per model: outcomes by
reason, traffic spread (top-10% share, Gini, share of online providers that served nothing),
predicted TTFT distribution and prefill-source mix. Markdown with PNG plots (matplotlib)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np


def gini(values: list[float]) -> float:
    """Gini coefficient of non-negative values (0 = perfectly even, → 1 = one takes all)."""
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    if n == 0 or x.sum() == 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float((2 * (ranks * x).sum()) / (n * x.sum()) - (n + 1) / n)


def top_share(values: list[float], fraction: float = 0.1) -> float:
    x = sorted(values, reverse=True)
    total = sum(x)
    if not x or total == 0:
        return 0.0
    k = max(1, int(round(len(x) * fraction)))
    return sum(x[:k]) / total


def model_metrics(decisions: list[dict], model: str, providers: dict[str, set]) -> dict:
    mine = [d for d in decisions if d["model"] == model]
    final = [d for d in mine if d["outcome"] != "queued"]
    outcomes = Counter(d["outcome"] if d["outcome"] == "routed" else d["reason"] for d in final)
    routed = [d for d in mine if d["outcome"] == "routed"]
    served = Counter(d["provider_id"] for d in routed)
    online = [pid for pid, models in providers.items() if model in models]
    counts = [served.get(pid, 0) for pid in online]
    ttft = np.array([d["estimated_ttft_ms"] for d in routed if d["estimated_ttft_ms"] > 0])
    pct = (lambda q: float(np.percentile(ttft, q)) if len(ttft) else 0.0)
    return {"requests": len({(d["request_id"], d["attempt"]) for d in mine}), "outcomes": dict(outcomes),
            "routed": len(routed), "top10_share": top_share(counts), "gini": gini(counts),
            "idle_share": (sum(1 for c in counts if c == 0) / len(counts)) if counts else 0.0,
            "providers": len(online), "ttft_p50": pct(50), "ttft_p90": pct(90), "ttft_p99": pct(99),
            "ttft": ttft.tolist(), "prefill_sources": dict(Counter(d["prefill_source"] for d in routed)),
            "served": counts}


def compare_runs(recorded: list[dict], whatif: list[dict], providers: dict[str, set]) -> dict:
    models = sorted({d["model"] for d in recorded} | {d["model"] for d in whatif})
    return {m: {"recorded": model_metrics(recorded, m, providers),
                "whatif": model_metrics(whatif, m, providers)} for m in models}


def write_report(path: str | Path, comparison: dict, *, title: str, settings: dict, method: str,
                 journal: str, entries: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.with_suffix("")
    lines = [f"# {title}", "", f"- journal: `{journal}` ({entries} entries)",
             f"- what-if settings: {', '.join(f'`{k}={v}`' for k, v in settings.items()) or '(none)'}",
             f"- method: {method}", ""]
    for model, runs in comparison.items():
        rec, wi = runs["recorded"], runs["whatif"]
        lines += [f"## {model}", "", "| | recorded | what-if |", "|---|---|---|",
                  f"| requests | {rec['requests']} | {wi['requests']} |"]
        for reason in sorted(set(rec["outcomes"]) | set(wi["outcomes"])):
            lines.append(f"| {reason} | {rec['outcomes'].get(reason, 0)} | {wi['outcomes'].get(reason, 0)} |")
        lines += [f"| top-10% providers' share of routed | {rec['top10_share']:.1%} | {wi['top10_share']:.1%} |",
                  f"| Gini of routed over online providers | {rec['gini']:.3f} | {wi['gini']:.3f} |",
                  f"| online providers that served nothing | {rec['idle_share']:.1%} | {wi['idle_share']:.1%} |",
                  f"| predicted TTFT p50 / p90 / p99 (ms) | {rec['ttft_p50']:.0f} / {rec['ttft_p90']:.0f} / "
                  f"{rec['ttft_p99']:.0f} | {wi['ttft_p50']:.0f} / {wi['ttft_p90']:.0f} / {wi['ttft_p99']:.0f} |"]
        for source in sorted(set(rec["prefill_sources"]) | set(wi["prefill_sources"])):
            lines.append(f"| prefill source {source} | {rec['prefill_sources'].get(source, 0)} | "
                         f"{wi['prefill_sources'].get(source, 0)} |")
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        reasons = sorted(set(rec["outcomes"]) | set(wi["outcomes"]))
        xs = np.arange(len(reasons))
        axes[0].bar(xs - 0.2, [rec["outcomes"].get(r, 0) for r in reasons], 0.4, label="recorded")
        axes[0].bar(xs + 0.2, [wi["outcomes"].get(r, 0) for r in reasons], 0.4, label="what-if")
        axes[0].set_xticks(xs, reasons, rotation=20)
        axes[0].set_title("outcomes")
        axes[0].legend()
        for run, label in ((rec, "recorded"), (wi, "what-if")):
            served = np.sort(np.asarray(run["served"], dtype=float))
            if served.sum() > 0:
                cum = np.concatenate([[0], np.cumsum(served) / served.sum()])
                axes[1].plot(np.linspace(0, 1, len(cum)), cum, label=f"{label} (Gini {run['gini']:.2f})")
            ttft = np.sort(np.asarray(run["ttft"]))
            if len(ttft):
                axes[2].plot(ttft, np.linspace(0, 1, len(ttft)), label=label)
        axes[1].plot([0, 1], [0, 1], "k:", linewidth=0.8)
        axes[1].set_title("traffic spread (Lorenz curve)")
        axes[1].set_xlabel("share of online providers")
        axes[1].legend()
        axes[2].set_title("predicted TTFT (CDF)")
        axes[2].set_xlabel("ms")
        axes[2].set_xscale("symlog")
        axes[2].legend()
        fig.tight_layout()
        png = Path(f"{stem}-{model.replace('/', '_')}.png")
        fig.savefig(png, dpi=90)
        plt.close(fig)
        lines += ["", f"![{model}]({png.name})", ""]
    path.write_text("\n".join(lines) + "\n")
    return path
