"""One PNG comparing benchmark results: latency percentiles per metric and output throughput per server."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def load_results(paths) -> list[dict]:
    out = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        out.extend(data if isinstance(data, list) else data.get("runs", [data]))
    return out


def plot_results(results: list[dict], out_path: str | Path, title: str | None = None) -> Path:
    """Grouped bars: for each latency metric its p50/p90/p99 per run; then output tok/s per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not results:
        raise ValueError("nothing to plot")
    labels = [r.get("label") or r.get("backend", "?") for r in results]
    pcts = results[0].get("percentiles", [50, 90, 99])
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4 * (len(PANELS) + 1), 4.2))
    x = np.arange(len(pcts))
    width = 0.8 / len(results)
    for ax, (key, name) in zip(axes, PANELS):
        for i, (r, label) in enumerate(zip(results, labels)):
            m = r["metrics"]
            vals = [m.get(f"p{p:g}_{key}_ms") for p in pcts]
            if any(v is None for v in vals):
                continue  # the in-process engine has no latencies
            ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=label, color=f"C{i}")
        ax.set_xticks(x, [f"p{p:g}" for p in pcts])
        ax.set_title(f"{name} (ms)")
        ax.grid(axis="y", alpha=0.3)
    ax = axes[-1]
    tput = [r["metrics"]["output_throughput"] for r in results]
    colors = [f"C{i}" for i in range(len(results))]
    ax.bar(np.arange(len(results)), tput, color=colors)
    ax.set_xticks(np.arange(len(results)), labels, rotation=20, ha="right")
    ax.set_title("output tokens / s")
    ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
