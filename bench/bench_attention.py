"""Decode attention alone: the torch path against the native op, K/V cold, beside the machine's bandwidth.

    python -m bench.bench_attention [--threads 1] [--rounds 5] [--batch 16]

For each shape (query heads / KV heads, head_dim 64) and context length, one call per layer over as
many layers' caches as make ~256 MiB of K/V, so every layer's K/V comes from DRAM as in a real decode
step; the torch path and the native op alternate round by round and the best round of each is kept.
Prints the time per layer call, the ratio, and the K/V bytes each implementation read per second
beside a one-thread streaming read of this machine (bench_model's measure_bandwidth).
"""

from __future__ import annotations

import argparse
import time

import torch

import kernels.native
from bench.bench_model import measure_bandwidth
from kernels import reference

SHAPES = ((9, 3, 64, "SmolLM2-135M"), (8, 4, 64, "8/4"))
CONTEXTS = (128, 512, 1024, 2048, 4096)
BLOCK = 16
COLD_BYTES = 256 << 20


def make_layers(batch: int, context: int, hq: int, hkv: int, d: int, seed: int):
    """Per layer: (q, k_cache, v_cache, tables, lens) with each sequence's blocks scattered in its cache."""
    per_seq = -(-context // BLOCK)
    layer_bytes = 2 * batch * per_seq * BLOCK * hkv * d * 2
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(max(2, -(-COLD_BYTES // layer_bytes))):
        nb = batch * per_seq
        k = torch.randn(nb, BLOCK, hkv, d, generator=g).bfloat16()
        v = torch.randn(nb, BLOCK, hkv, d, generator=g).bfloat16()
        tables = torch.randperm(nb, generator=g).view(batch, per_seq).int()
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, hq, d, generator=g).bfloat16()
        layers.append((q, k, v, tables, lens))
    return layers


def per_call(fn, layers, scale: float) -> float:
    t = time.perf_counter()
    for q, k, v, tables, lens in layers:
        fn(q, k, v, tables, lens, scale)
    return (time.perf_counter() - t) / len(layers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = kernels.native.load("decode_attention")
    if ops is None:
        raise SystemExit("the native decode attention is not available here (see the log line above)")
    bw = measure_bandwidth()
    print(f"machine: {args.threads} thread(s), memory read {bw / 1e9:.1f} GB/s; batch {args.batch}, "
          f"block size {BLOCK}, bf16, K/V cold; best of {args.rounds} alternating rounds")
    print("| shape | context | torch | native | torch / native | torch K/V GB/s | native K/V GB/s | native / memory read |")
    print("|---|---|---|---|---|---|---|---|")
    impls = {"torch": reference._decode_attention, "native": ops.decode_attention}
    for hq, hkv, d, label in SHAPES:
        for ctx in CONTEXTS:
            layers = make_layers(args.batch, ctx, hq, hkv, d, seed=ctx)
            scale = d ** -0.5
            best = {name: float("inf") for name in impls}
            for name, fn in impls.items():  # warm-up (oneDNN primitives, first-touch of the scratch)
                per_call(fn, layers[:1], scale)
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    best[name] = min(best[name], per_call(fn, layers, scale))
            kv_bytes = 2 * args.batch * ctx * hkv * d * 2
            t, n = best["torch"], best["native"]
            print(f"| {hq}/{hkv} x {d} ({label}) | {ctx} | {t * 1e3:.3f} ms | {n * 1e3:.3f} ms | {t / n:.2f}x "
                  f"| {kv_bytes / t / 1e9:.1f} | {kv_bytes / n / 1e9:.1f} | {kv_bytes / n / bw:.2f} |")
            del layers


if __name__ == "__main__":
    main()
