"""One linear layer, dense against quantized: time per call at SmolLM2-135M's shapes, one thread.

    python -m bench.bench_quant_linear [--rows 1,4,16,64,256] [--cold-mb 64] [--dtype bfloat16 | float32]

Columns: the bf16 `Linear` (workers/linear.py: the native bf16 GEMM where it runs, else oneDNN-packed), torch's own weight-only kernels
(`_weight_int8pack_mm`: int8 per output channel; `_weight_int4pack_mm_for_cpu`: int4 in groups of 32
with bf16 scales and zeros) and phaseserve's `QuantizedLinear` (kernels.quant_linear: the native
AVX512-BF16 op where it runs) at int8 and int4. Each shape has enough distinct copies of its weights
(--cold-mb of bf16) that the calls, cycling through them, read weights from DRAM as a model's step does;
the best of 3 passes counts. Ratios are bf16 time / that column's time (above 1: faster than bf16).

--dtype float32 (the activations of a CPU without AVX512-BF16; run it with PHASESERVE_CPU_ISA=avx2 to see
what such a CPU runs): phaseserve's `QuantizedLinear` in float32 (the native AVX2 op where it runs) at int8
and int4 against the fp32 `Linear` (oneDNN-packed fp32 weights: what an unquantized fp32 model runs) and the
torch reference quant_linear (dequantize to fp32, then F.linear), as ratios other / ours (above 1: ours is
faster); beside them the GB/s of quantized weight bytes ours reads and its GFLOP/s, with this machine's
one-thread memory bandwidth and fp32 matmul rate; and the same linear with its activations quantized to int8
(`--activation-quant int8`: kernels/native/quant_gemm_i8.cpp, integer dot products), its GB/s, GFLOP/s
(int8-equivalent: 2 x rows x weights / time) and its speed-up over the float32 op.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.bench_model import measure_bandwidth, measure_matmul
from phaseserve.kernels import reference
from phaseserve.kernels.quant import quantize
from phaseserve.workers.linear import Linear, QuantizedLinear

SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576)]  # o, qkv, gate_up, down, lm_head


def torch_int8pack(w: torch.Tensor):
    scale = w.abs().amax(1) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale.bfloat16())


def torch_int4pack(w: torch.Tensor, group: int = 32):
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    # torch's formula: w = (q - 8) * scale + zero
    scales_zeros = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous().bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def time_calls(fns, x) -> float:
    for f in fns:
        f(x)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for f in fns:
            f(x)
        best = min(best, (time.perf_counter() - t) / len(fns))
    return best


def interleaved_best(impls: dict, x, rounds: int = 5) -> dict[str, float]:
    """Microseconds per call of each implementation: the best of `rounds` passes, the implementations taking
    turns (on a shared machine a neighbour's burst then hits them alike, not one column)."""
    for fns in impls.values():
        for f in fns:
            f(x)
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(rounds):
        for name, fns in impls.items():
            t = time.perf_counter()
            for f in fns:
                f(x)
            best[name] = min(best[name], (time.perf_counter() - t) / len(fns) * 1e6)
    return best


def float32_table(rows: list[int], cold_mb: float) -> None:
    bandwidth, flops = measure_bandwidth(), measure_matmul(torch.float32)
    from bench.bench_model import machine_line

    print(f"this machine, one thread: memory bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"fp32 matmul (2048^3) {flops / 1e9:.0f} GFLOP/s; {machine_line()}")
    print("| shape | rows | kind | ours us | GB/s | GFLOP/s | fp32 dense / ours | reference / ours "
          "| int8 act us | GB/s | GFLOP/s | int8 act speed-up |")
    print("| --- | --: | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for n, k in SHAPES:
        copies = max(1, int(cold_mb * 1e6 / (n * k * 2)))
        ws = [torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02 for i in range(copies)]
        dense = [Linear(w) for w in ws]
        for kind in ("int8", "int4"):
            qws = [quantize(w, kind) for w in ws]
            ours = [QuantizedLinear(q, dtype=torch.float32) for q in qws]
            int8 = [QuantizedLinear(q, dtype=torch.float32, activations="int8") for q in qws]
            ref = [lambda x, q=q: reference.quant_linear(x, q) for q in qws]
            nbytes = ours[0].nbytes()
            for t in rows:
                x = torch.randn(t, k)
                us = interleaved_best({"ours": ours, "int8": int8, "dense": dense, "ref": ref}, x)
                print(f"| {n}x{k} (x{copies}) | {t} | {kind} | {us['ours']:.1f} | {nbytes / us['ours'] / 1e3:.1f} | "
                      f"{2 * t * n * k / us['ours'] / 1e3:.1f} | {us['dense'] / us['ours']:.2f}x | "
                      f"{us['ref'] / us['ours']:.2f}x | {us['int8']:.1f} | {nbytes / us['int8'] / 1e3:.1f} | "
                      f"{2 * t * n * k / us['int8'] / 1e3:.1f} | {us['ours'] / us['int8']:.2f}x |", flush=True)
        del ws, dense


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_quant_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--cold-mb", type=float, default=64, help="bf16 MB of distinct weight copies per shape")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the activations' dtype")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    if args.dtype == "float32":
        float32_table(rows, args.cold_mb)
        return
    kinds = ["bf16", "torch int8pack", "torch int4pack", "int8", "int4"]
    print("| shape | rows | " + " | ".join(f"{k} us" for k in kinds) + " |")
    print("| --- | --: | " + " | ".join("--:" for _ in kinds) + " |")
    for n, k in SHAPES:
        copies = max(1, int(args.cold_mb * 1e6 / (n * k * 2)))
        ws = [torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02 for i in range(copies)]
        impls = {
            "bf16": [Linear(w.bfloat16()) for w in ws],
            "torch int8pack": [torch_int8pack(w) for w in ws],
            "torch int4pack": [torch_int4pack(w) for w in ws],
            "int8": [QuantizedLinear(quantize(w, "int8")) for w in ws],
            "int4": [QuantizedLinear(quantize(w, "int4")) for w in ws],
        }
        del ws
        for t in rows:
            x = torch.randn(t, k).bfloat16()
            us = {name: time_calls(fns, x) * 1e6 for name, fns in impls.items()}
            cells = [f"{us['bf16']:.1f}"] + [f"{us[c]:.1f} ({us['bf16'] / us[c]:.2f}x)" for c in kinds[1:]]
            print(f"| {n}x{k} (x{copies}) | {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
