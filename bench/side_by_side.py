"""vLLM and phaseserve on the same model and workload, one after the other, with the same client.

  python -m bench.side_by_side --model bundled                   # workload A (below), both servers
  python -m bench.side_by_side --model small-200m --servers vllm,phaseserve,engine

Workload A (the defaults): random token ids, 64 prompts, 128 in, 64 out, concurrency 16, greedy,
ignore_eos. Any `phaseserve bench` workload flag can be added (--workload, --num-prompts, ...).
Each server is started, benchmarked and stopped before the next starts, so they never share the CPU.
Prints a table, the ratios phaseserve/vLLM and, for the random workload, its compute ceiling (bench/ceiling.py:
the output tok/s no server can pass here) with each server's share of it; for each served stack, its CPU
seconds per 1k output tokens by process (stack/benchmark/proc_cpu.py: /proc CPU time of its process tree over the
measured run, the client's too). Writes JSON and PNG into --out-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.ceiling import Ceiling, ceiling, measure_gemm_rate
from bench.safetensors_folder import safetensors_folder
from bench.servers import DEFAULT_VLLM, VLLM_THREAD_MODES, phaseserve_server, vllm_server
from phaseserve.stack.benchmark import cli as bench_cli
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.stack.benchmark.proc_cpu import ProcessTreeCPU
from phaseserve.redis_server import free_port

SERVERS = ("vllm", "phaseserve", "engine")
TABLE = (("output tok/s", "output_throughput", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
         ("TTFT p50 ms", "p50_ttft_ms", "{:.1f}"), ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"),
         ("TPOT p50 ms", "p50_tpot_ms", "{:.1f}"), ("TPOT p99 ms", "p99_tpot_ms", "{:.1f}"),
         ("ITL p99 ms", "p99_itl_ms", "{:.1f}"), ("E2E p99 ms", "p99_e2el_ms", "{:.0f}"),
         ("failed", "failed", "{}"))
RATIOS = (("output tok/s", "output_throughput"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p99", "p99_tpot_ms"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled, small-200m, smollm2, or anything `phaseserve up --model` takes")
    p.add_argument("--servers", default="vllm,phaseserve",
                   help=f"comma-separated, run in this order; from {', '.join(SERVERS)}")
    p.add_argument("--out-dir", default="bench/results", help="JSON, PNG and server logs go here")
    p.add_argument("--vllm-bin", default=DEFAULT_VLLM,
                   help="the `vllm` of the separate vLLM virtualenv [env PHASESERVE_BENCH_VLLM]")
    p.add_argument("--vllm-threads", choices=VLLM_THREAD_MODES, default="auto",
                   help="vLLM CPU thread binding (see bench/README.md for the measurement)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="vLLM's --dtype: bf16 is its best where the CPU has AVX512-BF16; float32 elsewhere")
    p.add_argument("--max-model-len", type=int, help="both servers (default: the model's, at most 4096)")
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for `phaseserve up` (repeatable, e.g. --phaseserve-arg=--num-kv-blocks=512)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def bench_args(extra: list[str], model: str, label: str, base_url: str, backend: str, name: str | None):
    argv = ["--model", model, "--label", label, "--backend", backend, "--base-url", base_url, "--no-progress"]
    if name:
        argv += ["--served-model-name", name]
    defaults = {"--num-prompts": "64", "--input-len": "128", "--output-len": "64", "--concurrency": "16"}
    for flag, value in defaults.items():
        if not any(a == flag or a.startswith(flag + "=") for a in extra):
            argv += [flag, value]
    return bench_cli.build_parser().parse_args(argv + extra)


def format_table(runs: list[dict]) -> str:
    head = f"{'':<14}" + "".join(f"{r['label']:>14}" for r in runs)
    lines = [head, "-" * len(head)]
    for title, key, fmt in TABLE:
        cells = []
        for r in runs:
            v = r["metrics"].get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>14}")
        lines.append(f"{title:<14}" + "".join(cells))
    return "\n".join(lines)


def ratios(runs: list[dict], base: str = "vllm") -> dict:
    by = {r["label"]: r["metrics"] for r in runs}
    if base not in by:
        return {}
    out = {}
    for label, m in by.items():
        if label == base:
            continue
        out[f"{label}/{base}"] = {title: (m[key] / by[base][key]
                                          if m.get(key) is not None and by[base].get(key) else None)
                                  for title, key in RATIOS}
    return out


def workload_ceiling(model_dir: Path, run: dict, gemm: tuple[float, int]) -> Ceiling | None:
    """The random workload's compute ceiling (bench/ceiling.py), from what the run sent and received."""
    m = run["metrics"]
    if run["workload"].get("workload") != "random" or not m.get("completed"):
        return None
    n = m["completed"]
    return ceiling(model_dir, n, m["total_input_tokens"] / n, m["total_output_tokens"] / n, gemm)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not servers:
        print(f"side_by_side: unknown server(s) {unknown}; choose from {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = f"{Path(args.model).name}-{stamp}"
    name = "bench-model"  # the same served name on both servers
    gemm = measure_gemm_rate()  # before any server starts: the machine's compute, measured quiet
    runs: list[dict] = []
    for server in servers:
        if server == "engine":
            bargs = bench_args(extra, str(model_dir), "engine", "", "engine", None)
            result = bench_cli.run_benchmark(bargs)
        else:
            port = free_port()
            make = vllm_server if server == "vllm" else phaseserve_server
            kwargs = (dict(vllm_bin=args.vllm_bin, threads=args.vllm_threads, kv_cache_gib=args.vllm_kv_gib,
                           dtype=args.vllm_dtype)
                      if server == "vllm" else dict(extra=args.phaseserve_arg))
            # vLLM reads no GGUF here: it serves the same weights dequantized to bf16 safetensors
            served_dir = safetensors_folder(model_dir) if server == "vllm" else model_dir
            proc = make(served_dir, port, name, out / f"{tag}-{server}.log", model_len=args.max_model_len, **kwargs)
            t0 = time.monotonic()
            proc.start(args.startup_timeout)
            try:
                startup = time.monotonic() - t0
                bargs = bench_args(extra, str(model_dir), server, proc.url, "openai", name)
                result = bench_cli.run_benchmark(bargs, ProcessTreeCPU(proc.proc.pid))
            finally:
                proc.stop()
            result["startup_s"] = round(startup, 1)
            if server == "vllm":
                result["vllm_threads"] = args.vllm_threads
                result["vllm_dtype"] = args.vllm_dtype
        bench_cli.print_result(result)
        runs.append(result)
    print()
    print(f"model {model_dir} | workload {runs[0]['workload']}")
    print(format_table(runs))
    rat = ratios(runs)
    for pair, values in rat.items():
        print(f"{pair}: " + ", ".join(f"{k} {v:.2f}x" if v is not None else f"{k} -" for k, v in values.items()))
    payload = {"model": str(model_dir), "runs": runs, "ratios": rat}
    roof = workload_ceiling(model_dir, runs[0], gemm)
    if roof is not None:
        shares = ", ".join(f"{r['label']} {r['metrics']['output_throughput'] / roof.output_tok_s:.2f}" for r in runs)
        print(f"{roof.describe()}; share of it: {shares}")
        payload["ceiling"] = {"output_tok_s": roof.output_tok_s, "tflop": roof.flops / 1e12,
                              "gemm_gflop_s": roof.gemm_rate / 1e9, "threads": roof.threads}
    json_path = out / f"side-by-side-{tag}.json"
    json_path.write_text(json.dumps(payload, indent=1))
    from phaseserve.stack.benchmark.plot import plot_results

    png = plot_results(runs, out / f"side-by-side-{tag}.png", title=f"{Path(args.model).name}: "
                       f"{runs[0]['workload']['workload']} workload")
    print(f"wrote {json_path}\nwrote {png}")
    return 0 if all(r["metrics"]["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
