"""bench/scaling.py's report: the vLLM figure per level, the K/V read floor, the growth of the decode step
with context, the markdown tables and the PNG."""

from __future__ import annotations

import json
from pathlib import Path


def best_vllm(runs: list[dict]) -> dict | None:
    """The vLLM figure per level: the best thread mode's (highest tok/s, lowest step)."""
    vllm = [r for r in runs if r["server"] == "vllm"]
    if not vllm:
        return None
    if len(vllm) == 1:
        return vllm[0]
    conc = [max((r["concurrency"][i] for r in vllm), key=lambda x: x["output_tok_s"])
            for i in range(len(vllm[0]["concurrency"]))]
    ctx = [min((r["context"][i] for r in vllm), key=lambda x: _or_inf(x["step_ms"]))
           for i in range(len(vllm[0]["context"]))]
    return {"label": "vllm-best", "server": "vllm", "concurrency": conc, "context": ctx}


def _or_inf(v):
    return float("inf") if v is None else v


def rounded(v):
    return round(v, 2) if isinstance(v, float) else v


def _fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def _ratio(a, b):
    return a / b if a is not None and b else None


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int | None:
    """K and V of one token over every layer, bf16: what a decode step reads per token of context."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes
    except KeyError:
        return None


def kv_floor_ms(kv_per_token: int, batch: int, context: int, memory_read_gb_s: float) -> float:
    """The time reading the batch's K/V once takes at the measured memory read (the attention's floor)."""
    return batch * context * kv_per_token / (memory_read_gb_s * 1e9) * 1e3


def valid_steps(rows: list[dict]) -> dict[int, float]:
    """context -> decode step, for the levels where it was measured with no request failed (a full batch)."""
    return {r["context"]: r["step_ms"] for r in rows if r.get("step_ms") is not None and not r.get("failed")}


def growth(rows: list[dict], contexts: set[int] | None = None) -> dict | None:
    """The step at the largest context over the step at the smallest, among `contexts` (default: all) where
    it was measured: {"from", "to", "ratio", "ms"} (ms: how much longer the step got)."""
    steps = {c: v for c, v in valid_steps(rows).items() if contexts is None or c in contexts}
    if len(steps) < 2:
        return None
    lo, hi = min(steps), max(steps)
    return {"from": lo, "to": hi, "ratio": steps[hi] / steps[lo], "ms": steps[hi] - steps[lo]}


def format_tables(report: dict) -> str:
    ours = next((r for r in report["runs"] if r["server"] == "phaseserve"), None)
    vllm = report.get("vllm")
    mach = report["machine"]
    lines = [f"machine: {mach['cpus']} cores, memory read {mach['memory_read_gb_s']:.1f} GB/s, bf16 GEMM "
             f"{mach['bf16_gemm_gflop_s']:.0f} GFLOP/s ({mach['threads']} threads), load average "
             f"{mach['load_avg'][0]:.2f} at start", ""]
    if report["runs"]:
        lines += ["| concurrency | server | output tok/s | TPOT p50 ms | TPOT p99 ms | load avg |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for i, level in enumerate(report["concurrency_levels"]):
            for r in report["runs"]:
                row = r["concurrency"][i]
                lines.append(f"| {level} | {r['label']} | {_fmt(row['output_tok_s'])} | {_fmt(row['tpot_p50_ms'])} | "
                             f"{_fmt(row['tpot_p99_ms'])} | {row['load_avg']:.1f} |")
            if ours and vllm:
                o, v = ours["concurrency"][i], vllm["concurrency"][i]
                lines.append(f"| {level} | **phaseserve / vLLM** | **{_fmt(_ratio(o['output_tok_s'], v['output_tok_s']), '{:.2f}x')}** "
                             f"| {_fmt(_ratio(o['tpot_p50_ms'], v['tpot_p50_ms']), '{:.2f}x')} | "
                             f"{_fmt(_ratio(o['tpot_p99_ms'], v['tpot_p99_ms']), '{:.2f}x')} | |")
        lines.append("")
    if report["context_levels"]:
        batch = report["settings"]["context_batch"]
        head = ["context"] + [f"{r['label']} TPOT p50 / decode step ms" for r in report["runs"]]
        if report.get("engine"):
            head.append("phaseserve engine step ms")
        if ours and vllm:
            head.append("step phaseserve / vLLM")
        kv = report.get("kv_bytes_per_token")
        if kv:
            head.append("K/V read floor ms")
        lines += [f"decode at batch {batch}:", "", "| " + " | ".join(head) + " |",
                  "| " + " | ".join("---:" for _ in head) + " |"]
        for i, context in enumerate(report["context_levels"]):
            cells = [str(context)]
            cells += [f"{_fmt(r['context'][i]['tpot_p50_ms'])} / {_fmt(r['context'][i]['step_ms'])}"
                      + (f" ({r['context'][i]['failed']} of {r['context'][i]['requests']} failed)"
                         if r["context"][i].get("failed") else "") for r in report["runs"]]
            if report.get("engine"):
                cells.append(_fmt(report["engine"][i]["step_ms"], "{:.2f}"))
            if ours and vllm:
                cells.append(_fmt(_ratio(valid_steps(ours["context"]).get(context),
                                         valid_steps(vllm["context"]).get(context)), "{:.2f}x"))
            if kv:
                cells.append(f"{kv_floor_ms(kv, batch, context, mach['memory_read_gb_s']):.1f}")
            lines.append("| " + " | ".join(cells) + " |")
        g = report["growth"]
        lines += [""] + [f"growth of the decode step, {k}: " + (
            f"{v['ratio']:.2f}x from context {v['from']} to {v['to']} ({v['ms']:+.1f} ms)" if v else "-")
            for k, v in g.items()]
        if g.get("phaseserve") and g.get("vllm"):
            ours_g, theirs_g = g["phaseserve"], g["vllm"]
            lines.append(f"phaseserve's decode step grows {'slower' if ours_g['ratio'] < theirs_g['ratio'] else 'NOT slower'}"
                         f" than vLLM's in ratio and {'less' if ours_g['ms'] < theirs_g['ms'] else 'MORE'} in "
                         f"milliseconds (context {ours_g['from']} -> {ours_g['to']})")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_scaling(report: dict, out_path: Path) -> Path:
    """Three panels: output tok/s and TPOT p50 against concurrency, decode step against context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    series = list(report["runs"])
    for i, r in enumerate(series):
        color = f"C{i}"
        xs = [row["concurrency"] for row in r["concurrency"]]
        axes[0].plot(xs, [row["output_tok_s"] for row in r["concurrency"]], "o-", color=color, label=r["label"])
        axes[1].plot(xs, [row["tpot_p50_ms"] for row in r["concurrency"]], "o-", color=color, label=r["label"])
        pts = sorted(valid_steps(r["context"]).items())  # a level with failed requests had no full batch
        if pts:
            axes[2].plot(*zip(*pts), "o-", color=color, label=f"{r['label']} (served)")
    if report.get("engine"):
        axes[2].plot([row["context"] for row in report["engine"]], [row["step_ms"] for row in report["engine"]],
                     "s--", color="C0", alpha=0.6, label="phaseserve engine")
    titles = ("output tokens / s", "TPOT p50 (ms)", f"decode step at batch {report['settings']['context_batch']} (ms)")
    levels = (report["concurrency_levels"], report["concurrency_levels"], report["context_levels"])
    for ax, title, xlabel, ticks in zip(axes, titles, ("concurrency", "concurrency", "context (tokens)"), levels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mach = report["machine"]
    fig.suptitle(f"{report['model_name']}: scaling ({mach['cpus']} cores, {mach['memory_read_gb_s']:.1f} GB/s, "
                 f"{mach['bf16_gemm_gflop_s']:.0f} GFLOP/s bf16)")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def growths(runs: list[dict], vllm: dict | None, engine: list[dict] | None) -> dict:
    """Each server's growth over the contexts both servers measured (so the two spans are the same)."""
    ours = next((r for r in runs if r["server"] == "phaseserve"), None)
    both = set(valid_steps(ours["context"])) & set(valid_steps(vllm["context"])) if ours and vllm else None
    return ({k: growth(r["context"], both) for k, r in (("phaseserve", ours), ("vllm", vllm)) if r}
            | ({"phaseserve engine": growth(engine)} if engine else {}))
