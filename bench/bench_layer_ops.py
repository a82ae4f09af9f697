"""The native layer ops (kernels/native/layer_ops.cpp, or layer_ops_f32.cpp with --dtype float32) against the
torch path they replace, side by side.

    python -m bench.bench_layer_ops [--models small-200m smollm2] [--threads 1] [--rounds 5] [--engine smollm2]
                                    [--engine-threads 2] [--dtype bfloat16|float32]

Per op (through the kernels dispatch, Python included), at each model's shapes and 1 / 16 rows: the median
call time with the native op and with torch. Then each model's decode step at batch 1 and 16 (RunnerBench,
sampling included; per round the fastest of --steps steps) and, with --engine, the engine's output tok/s on workload A (64 requests, 128-token
prompts, 64 output tokens, max 16 sequences). Only the layer ops are switched (attention and GEMMs run as
usual in both), and A and B alternate round by round in one process, so drift on a shared machine hits
both alike. Prints the machine's memory read and matmul rates beside the ratios. --dtype float32 runs the
models in fp32 (run it with PHASESERVE_CPU_ISA=avx2 to time what an AVX2-only CPU runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phaseserve import kernels
from bench.bench_model import CONTEXT, RunnerBench, best, measure_bandwidth, measure_matmul, weight_bytes
from phaseserve.kernels.dispatch.layer_ops import LAYER_OPS
from phaseserve.stack.benchmark.models import resolve_model


DTYPE = torch.bfloat16  # the activations' dtype (--dtype)


def use_native(on: bool) -> None:
    """Switch the layer ops of DTYPE (and nothing else) between native and torch."""
    ops = LAYER_OPS.resolve(DTYPE)  # afresh: an earlier call may have pinned torch
    if on and ops is None:
        raise SystemExit("the native layer ops are unavailable here (see the log line above)")
    kernels.CHOICES.pin(LAYER_OPS, DTYPE, ops if on else None)


def _per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def alternate(figures: dict[str, callable], rounds: int) -> dict[str, tuple[float, float]]:
    """name -> (native, torch) medians over `rounds` rounds, each round timing every figure both ways."""
    got = {name: ([], []) for name in figures}
    for _ in range(rounds):
        for on in (True, False):
            use_native(on)
            for name, fn in figures.items():
                got[name][0 if on else 1].append(fn())
    use_native(True)
    return {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in got.items()}


def op_figures(cfg, rows: int, calls: int) -> dict[str, callable]:
    g = torch.Generator().manual_seed(rows)
    hidden, inter, hq, hkv, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(rows, hidden, generator=g).to(DTYPE)
    res = torch.randn(rows, hidden, generator=g).to(DTYPE)
    w = torch.randn(hidden, generator=g).to(DTYPE)
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(DTYPE)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(DTYPE)
    q, k, v = (t.view(rows, -1, d) for t in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    positions = torch.randint(0, 2048, (rows,), generator=g)
    slots = torch.randperm(64 * 16, generator=g)[:rows]
    cache = torch.randn(4096, d, generator=g)
    kc, vc = torch.zeros(64, 16, hkv, d, dtype=DTYPE), torch.zeros(64, 16, hkv, d, dtype=DTYPE)
    logits = torch.randn(rows, cfg.vocab_size, generator=g).to(DTYPE)
    return {
        f"rms_norm + residual [{rows}, {hidden}]": lambda: _per_call(lambda: kernels.rms_norm(x, w, 1e-5, res), calls),
        f"silu_and_mul [{rows}, {2 * inter}]": lambda: _per_call(lambda: kernels.silu_and_mul(gate_up), calls),
        f"rotary + KV write [{rows}, {hq}+{hkv}+{hkv} heads x {d}]": lambda: _per_call(
            lambda: kernels.rotary_and_write_kv(positions, q, k, v, cache, kc, vc, slots), calls),
        f"argmax [{rows}, {cfg.vocab_size}]": lambda: _per_call(lambda: kernels.argmax(logits), calls),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["small-200m", "smollm2"], help="none: the engine only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (each figure's median over them)")
    ap.add_argument("--steps", type=int, default=3, help="timed decode steps per round (median)")
    ap.add_argument("--engine", default=None, help="also time the engine on workload A with this model")
    ap.add_argument("--engine-threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    bw, mm = measure_bandwidth(), measure_matmul(DTYPE)
    print(f"machine: {args.threads} threads, memory read {bw / 1e9:.1f} GB/s, {args.dtype} matmul {mm / 1e9:.0f} "
          f"GFLOP/s")
    print("| model | figure | native | torch | speed-up of native |")
    print("|---|---|---|---|---|")

    def show(model, results, unit, scale, lower_is_better=True):
        for name, (a, b) in results.items():
            ratio = b / a if lower_is_better else a / b
            print(f"| {model} | {name} | {a * scale:.1f} {unit} | {b * scale:.1f} {unit} | {ratio:.2f}x |", flush=True)

    for name in args.models:
        path = resolve_model(name)
        rb = RunnerBench(path, args.dtype)
        cfg = rb.runner.config
        for rows in (1, 16):
            show(name, alternate(op_figures(cfg, rows, 200), args.rounds), "us", 1e6)
        floor = weight_bytes(rb.runner) / bw
        # the fastest of a round's steps: on a shared machine a neighbour's burst only ever adds time
        steps = {f"decode step, batch {b} (context {CONTEXT}; floor {floor * 1e3:.1f} ms)":
                 (lambda b=b: rb.decode_step_time(b, args.steps, timer=best)) for b in (1, 16)}
        show(name, alternate(steps, args.rounds), "ms", 1e3)
        del rb
    if args.engine:
        show(args.engine, engine_ab(args.engine, args.engine_threads, args.rounds, args.dtype), "tok/s", 1.0,
             lower_is_better=False)


def engine_ab(name: str, threads: int, rounds: int, dtype: str = "auto") -> dict[str, tuple[float, float]]:
    from phaseserve.stack.benchmark.workloads import Vocab, random_workload
    from phaseserve.stack.engine import Engine
    from phaseserve.params import SamplingParams

    path = resolve_model(name)
    specs = random_workload(Vocab.from_model_dir(path), 64, 128, 64, seed=0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True).validate()
    engine = Engine(str(path), dtype=dtype, num_threads=threads, max_num_seqs=16)
    prompts = [list(s.prompt) for s in specs]
    engine.generate(prompts[:1], params)

    def run():
        t = time.perf_counter()
        engine.generate(prompts, params)
        return 64 * 64 / (time.perf_counter() - t)

    return alternate({f"engine, workload A, {threads} threads (output tok/s)": run}, rounds)


if __name__ == "__main__":
    main()
