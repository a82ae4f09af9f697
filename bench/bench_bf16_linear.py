"""bf16 linears, oneDNN's prepacked matmul against the native GEMM (kernels/native/bf16_gemm.cpp), at the
200M llama's four shapes, by row count and thread count.

    python -m bench.bench_bf16_linear [--rows 1,4,8,16,32,64,128,256,512] [--threads 1,2] [--rounds 5]

Each shape has 8 copies of its weight (189 MB of bf16 in all), so the calls, cycling through them, read
weights from DRAM as a model's step does. oneDNN and native alternate, a pass over all 32 weights each,
for --rounds rounds; the fastest pass of each counts. GB/s: weight bytes / time; GF/s: 2 M N K / time;
ratio: oneDNN time / native time (above 1: native faster).
"""

from __future__ import annotations

import argparse
import time

import torch

import kernels
from workers.linear import Linear

SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # qkv, o, gate_up, down
COPIES = 8


def onednn_linear(w: torch.Tensor) -> Linear:
    """Linear as it is where the native GEMM does not run: oneDNN's packed weight."""
    saved = list(kernels._bf16_gemm_choice)
    kernels._bf16_gemm_choice[:] = [None]
    try:
        lin = Linear(w)
    finally:
        kernels._bf16_gemm_choice[:] = saved
    assert lin.packed and lin.native is None
    return lin


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_bf16_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256,512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    ws = [(torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02).bfloat16()
          for n, k in SHAPES for i in range(COPIES)]
    impls = {"onednn": [onednn_linear(w) for w in ws], "native": [Linear(w) for w in ws]}
    assert all(lin.native is not None for lin in impls["native"]), "the native GEMM does not run here"
    weight_bytes = sum(w.nbytes for w in ws)
    macs = sum(w.numel() for w in ws)
    del ws
    print("| threads | M | oneDNN ms | GB/s | GF/s | native ms | GB/s | GF/s | oneDNN / native |")
    print("| --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES}}
            best = {name: float("inf") for name in impls}
            for r in range(args.rounds + 1):  # round 0 warms up (oneDNN compiles its primitive)
                for name, lins in impls.items():
                    t = time.perf_counter()
                    for lin in lins:
                        lin(xs[lin.in_features])
                    if r:
                        best[name] = min(best[name], time.perf_counter() - t)
            cells = []
            for name in impls:
                s = best[name]
                cells += [f"{s * 1e3:.2f}", f"{weight_bytes / s / 1e9:.1f}", f"{2 * m * macs / s / 1e9:.0f}"]
            print(f"| {threads} | {m} | " + " | ".join(cells) + f" | {best['onednn'] / best['native']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
