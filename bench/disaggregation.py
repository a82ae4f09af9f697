"""Colocated against disaggregated, on the same cores, on the long-prompt interference mix.

  python -m bench.disaggregation --model bundled
  python -m bench.disaggregation --model small-200m --num-prompts 160 --long-every 3

Layouts, each started with `phaseserve up`, benchmarked and stopped before the next:
- colocated: one mixed worker (chunked prefill beside the decodes) on every core the worker gets;
- disaggregated: one prefill worker and one decode worker, each on its share of the cores, the prompt's
  KV handed over after its first token.
The workload is `--workload interference` (short chat streams at a fixed concurrency, a long prompt every
`--long-every` seconds); with `--baseline` each layout also runs it without long prompts. Reported: the
running streams' ITL p50/p99 and TPOT p50, the long prompts' TTFT p50/p99, output throughput, and the KV
bytes moved from prefill to decode workers (from the gateway's /metrics) per output and per handed-over
prompt token. Any other `phaseserve bench` flag passes through.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

from bench.servers import phaseserve_server
from bench.side_by_side import bench_args
from phaseserve.stack.benchmark import cli as bench_cli
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.redis_server import free_port

LAYOUTS = {  # `phaseserve up` flags, number of workers
    "colocated": (["--workers", "1"], 1),
    "disaggregated": (["--prefill-workers", "1", "--decode-workers", "1"], 2),
}
WORKLOAD = {"--workload": "interference", "--num-prompts": "96", "--concurrency": "8", "--output-len": "128",
            "--long-len": "1536", "--long-every": "4"}


def gauges(base_url: str) -> dict[str, float]:
    """The unlabelled gauges of the gateway's /metrics, by name."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(phaseserve_\w+) (\S+)$", text, re.M)}


def handoff_counters(base_url: str) -> dict[str, float]:
    """phaseserve_kv_handoff_* from the gateway's /metrics."""
    prefix = "phaseserve_kv_"
    return {k[len(prefix):]: v for k, v in gauges(base_url).items() if k.startswith(prefix + "handoff_")}


def wait_for_workers(base_url: str, count: int, timeout: float) -> None:
    """/health answers once one worker is up; a layout is only itself once all of its workers are."""
    deadline = time.monotonic() + timeout
    while gauges(base_url).get("phaseserve_workers_alive", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} workers alive after {timeout:.0f}s")
        time.sleep(0.5)


def summarize(label: str, result: dict, counters: dict[str, float], block_size: int) -> dict:
    short, long = result["groups"].get("short", result["metrics"]), result["groups"].get("long", {})
    out_tokens = result["groups"].get("all", result["metrics"])["total_output_tokens"]
    moved = counters.get("handoff_bytes", 0.0)
    handed_tokens = counters.get("handoff_blocks", 0.0) * block_size  # upper bound: last blocks are partial
    return {
        "layout": label,
        "streams ITL p50 ms": short.get("p50_itl_ms"), "streams ITL p99 ms": short.get("p99_itl_ms"),
        "streams TPOT p50 ms": short.get("p50_tpot_ms"),
        "long TTFT p50 ms": long.get("p50_ttft_ms"), "long TTFT p99 ms": long.get("p99_ttft_ms"),
        "long prompts": long.get("completed", 0),
        "output tok/s": result["groups"].get("all", result["metrics"])["output_throughput"],
        "handoffs": counters.get("handoff_sequences", 0.0),
        "KV MB moved": moved / 1e6,
        "KV bytes / output token": moved / out_tokens if out_tokens else None,
        "KV bytes / prompt token": moved / handed_tokens if handed_tokens else None,
        "failed": result["metrics"]["failed"],
    }


def format_rows(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "layout"]
    head = f"{'':<26}" + "".join(f"{r['layout']:>25}" for r in rows)
    lines = [head, "-" * len(head)]
    for k in keys:
        cells = []
        for r in rows:
            v = r[k]
            cells.append(f"{'-' if v is None else (f'{v:.1f}' if isinstance(v, float) else str(v)):>25}")
        lines.append(f"{k:<26}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disaggregation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled, small-200m, smollm2, or a model path")
    p.add_argument("--layouts", default="colocated,disaggregated", help=f"comma-separated from {', '.join(LAYOUTS)}")
    p.add_argument("--baseline", action="store_true", help="also run each layout without long prompts")
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for every `phaseserve up` (repeatable)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args, extra = p.parse_known_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        print(f"disaggregation: --layouts from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    for flag, value in WORKLOAD.items():
        if not any(a == flag or a.startswith(flag + "=") for a in extra):
            extra += [flag, value]
    model_dir = resolve_model(args.model)
    block_size = 16
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    variants = [(layout, False) for layout in layouts]
    if args.baseline:
        variants = [(layout, base) for layout in layouts for base in (True, False)]
    rows, runs = [], []
    for layout, baseline in variants:
        label = layout + (" (no long)" if baseline else "")
        port = free_port()
        proc = phaseserve_server(model_dir, port, "bench-model", out / f"disagg-{tag}-{layout}.log",
                                 extra=LAYOUTS[layout][0] + args.phaseserve_arg)
        proc.start(args.startup_timeout)
        try:
            wait_for_workers(proc.url, LAYOUTS[layout][1], args.startup_timeout)
            run_extra = extra + (["--long-every", "0"] if baseline else [])
            result = bench_cli.run_benchmark(bench_args(run_extra, str(model_dir), label, proc.url, "openai",
                                                        "bench-model"))
            counters = handoff_counters(proc.url)
        finally:
            proc.stop()
        bench_cli.print_result(result)
        rows.append(summarize(label, result, counters, block_size))
        runs.append({"layout": label, "result": result, "handoff": counters})
    print()
    print(f"model {model_dir} | workload {runs[0]['result']['workload']}")
    print(format_rows(rows))
    path = out / f"disaggregation-{tag}.json"
    path.write_text(json.dumps({"model": str(model_dir), "rows": rows, "runs": runs}, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
