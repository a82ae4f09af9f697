"""The compute ceiling of a workload: the output tok/s no server can beat on this machine.

A workload's matmul FLOPs (every prompt token through every linear and causal attention, every output
token through every linear, attention over its context and the lm_head), divided by the GEMM rate in the
dtype this CPU serves (bf16 or fp32) measured on every core (a 2048^3 matmul, the rate large GEMMs reach), is a lower bound on its time: it
counts no memory traffic, no elementwise op and no step overhead. Its inverse, times the output tokens,
is an upper bound on output tok/s, so a server's output tok/s over it is the share of the machine's
compute it turned into tokens, and a target ratio against another server is reachable only while
target x that server's share stays under 1.

    python -m bench.ceiling --model small-200m   # workload A's ceiling on this machine
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bench_model import measure_matmul
from phaseserve.workers.loader import ModelConfig, read_config


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """2 x the weights every token multiplies in the decoder layers (qkv, o, gate_up, down)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2.0 * per_layer * cfg.num_layers


def attention_flops(cfg: ModelConfig, queries: float, keys: float) -> float:
    """QK^T and PV of `queries` query tokens against `keys` keys on average, every layer and head."""
    return 4.0 * cfg.num_heads * cfg.head_dim * queries * keys * cfg.num_layers


def workload_flops(cfg: ModelConfig, prompts: int, input_len: float, output_len: float) -> float:
    """Matmul FLOPs of `prompts` requests of `input_len` prompt tokens and `output_len` output tokens. The
    prefill samples the first output token; each later one is a decode step's row."""
    lin = linear_flops_per_token(cfg)
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size
    prefill = input_len * lin + attention_flops(cfg, input_len, (input_len + 1) / 2)
    decodes = max(output_len - 1, 0)
    decode = decodes * lin + attention_flops(cfg, decodes, input_len + output_len / 2)
    return prompts * (prefill + decode + output_len * lm_head)


@dataclass
class Ceiling:
    flops: float  # the workload's matmul FLOPs
    gemm_rate: float  # FLOP/s of a 2048^3 matmul on `threads` threads, in the dtype this CPU serves
    threads: int
    output_tokens: int
    dtype: str = "bf16"

    @property
    def seconds(self) -> float:
        return self.flops / self.gemm_rate

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def describe(self) -> str:
        return (f"compute ceiling {self.output_tok_s:.0f} output tok/s ({self.flops / 1e12:.2f} TFLOP of matmuls at "
                f"{self.gemm_rate / 1e9:.0f} GFLOP/s, {self.dtype} 2048^3 on {self.threads} threads)")


def serving_dtype() -> torch.dtype:
    """What dtype `auto` serves on this CPU (workers/loader.py): bf16 where it computes bf16 natively."""
    from phaseserve.kernels import cpu_isa

    return torch.bfloat16 if cpu_isa.supports("avx512-bf16") else torch.float32


def measure_gemm_rate(threads: int | None = None) -> tuple[float, int]:
    """The GEMM rate in the serving dtype on `threads` threads (default: every core this process may use)."""
    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul(serving_dtype()), threads
    finally:
        torch.set_num_threads(before)


def ceiling(model_dir: str | Path, prompts: int, input_len: float, output_len: float,
            gemm: tuple[float, int] | None = None) -> Ceiling:
    rate, threads = gemm or measure_gemm_rate()
    flops = workload_flops(read_config(model_dir), prompts, input_len, output_len)
    return Ceiling(flops, rate, threads, round(prompts * output_len),
                   "bf16" if serving_dtype() == torch.bfloat16 else "fp32")


def main(argv: list[str] | None = None) -> None:
    from phaseserve.stack.benchmark.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-200m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, help="GEMM threads (default: every core this process may use)")
    args = ap.parse_args(argv)
    c = ceiling(resolve_model(args.model), args.num_prompts, args.input_len, args.output_len,
                measure_gemm_rate(args.threads))
    print(f"{args.model}, {args.num_prompts} x ({args.input_len} in, {args.output_len} out): {c.describe()}")


if __name__ == "__main__":
    main()
