"""bf16 linears: oneDNN's prepacked matmul (torch's path where the native GEMM does not run, on AMX where the
CPU has it) against the native GEMM (kernels/native/bf16_gemm.cpp) with vdpbf16ps and, where the CPU has
AMX-BF16, with AMX tiles (what the dispatch runs there), at the 200M llama's four shapes, by row count and
thread count.

    python -m bench.bench_bf16_linear [--rows 1,4,8,16,32,64,128,256,512] [--threads 1,2] [--rounds 5]
                                      [--per-shape] [--clock auto|thread|wall]

Each shape has 8 copies of its weight (189 MB of bf16 in all), so the calls, cycling through them, read
weights from DRAM as a model's step does. The implementations alternate, a pass over all 32 weights each
(or, with --per-shape, over one shape's 8), for --rounds rounds; the fastest pass of each counts. Time is
the calling thread's CPU time on one thread (other processes' load does not count), wall time on more.
GB/s: weight bytes / time; GMAC/s: M N K / time; the ratios are speeds against AMX's (above 1: AMX faster).
The memory read figure (bench.bench_model's) is printed first: at few rows a pass cannot beat it.
"""

from __future__ import annotations

import argparse
import time

import torch

from phaseserve import kernels
from phaseserve.kernels import native
from phaseserve.kernels.dispatch.linears import BF16_GEMM
from phaseserve.workers.linear import Linear

SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # qkv, o, gate_up, down
COPIES = 8


def onednn_linear(w: torch.Tensor) -> Linear:
    """Linear as it is where the native GEMM does not run: oneDNN's packed weight."""
    with kernels.CHOICES.pinned(BF16_GEMM, None, None):
        lin = Linear(w)
    assert lin.packed and lin.native is None
    return lin


def native_linear(lin: Linear, amx: int):
    """The native op on lin's packed weight, its multiply forced: 0 vdpbf16ps, 1 AMX tiles."""
    assert lin.native is not None, "the native GEMM does not run here"
    op, data, n = native.load("bf16_gemm").bf16_linear.default, lin.native.data, lin.out_features
    return lambda x: op(x, data, None, n, amx)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_bf16_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256,512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-shape", action="store_true", help="a table row per shape, not one for all four")
    p.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                   help="auto: the calling thread's CPU time on one thread, wall time on more")
    args = p.parse_args(argv)
    from bench.bench_model import measure_bandwidth

    ws = [(torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02).bfloat16()
          for n, k in SHAPES for i in range(COPIES)]
    ops = native.load("bf16_gemm")
    assert ops is not None, "the native GEMM does not run here"
    packed = [Linear(w) for w in ws]  # one native copy, read by both of its multiplies
    impls = {"oneDNN": [onednn_linear(w) for w in ws], "vdpbf16ps": [native_linear(lin, 0) for lin in packed]}
    if ops.amx():
        impls["AMX"] = [native_linear(lin, 1) for lin in packed]
    shapes = [(n, k) for n, k in SHAPES for _ in range(COPIES)]
    del ws
    print(f"memory read (bench.bench_model): {measure_bandwidth() / 1e9:.1f} GB/s on {torch.get_num_threads()} "
          f"threads; AMX {'runs' if 'AMX' in impls else 'absent'} here")
    names = list(impls)
    base = "AMX" if "AMX" in impls else "vdpbf16ps"
    head = "| threads | shape | M | " + " | ".join(f"{n} ms | GB/s | GMAC/s" for n in names)
    head += " | " + " | ".join(f"{base} / {n}" for n in names if n != base) + " |"
    print(head)
    print("|" + " --: |" * (head.count("|") - 1))
    groups = [[i for i, s in enumerate(shapes) if s == shape] for shape in SHAPES] if args.per_shape \
        else [list(range(len(shapes)))]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        clock = time.thread_time if (args.clock == "thread" or args.clock == "auto" and threads == 1) \
            else time.perf_counter
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES}}
            for group in groups:
                weight_bytes = sum(2 * shapes[i][0] * shapes[i][1] for i in group)
                macs = sum(shapes[i][0] * shapes[i][1] for i in group)
                best = {name: float("inf") for name in impls}
                for r in range(args.rounds + 1):  # round 0 warms up (oneDNN compiles its primitive)
                    for name, lins in impls.items():
                        t = clock()
                        for i in group:
                            lins[i](xs[shapes[i][1]])
                        if r:
                            best[name] = min(best[name], clock() - t)
                cells = []
                for name in names:
                    s = best[name]
                    cells += [f"{s * 1e3:.2f}", f"{weight_bytes / s / 1e9:.1f}", f"{m * macs / s / 1e9:.0f}"]
                cells += [f"{best[n] / best[base]:.2f}" for n in names if n != base]
                shape = "all" if len(groups) == 1 else "x".join(map(str, shapes[group[0]]))
                print(f"| {threads} | {shape} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
