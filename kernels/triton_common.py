"""What the Triton kernels' launchers share (kernels/triton_ops.py, triton_attention.py, triton_sampling.py):
whether triton interprets them, launch sizes, and the views they take their inputs in."""

from __future__ import annotations

import torch
import triton

# Decided when the kernels are decorated, like the decorator itself. The interpreter computes bf16 arithmetic
# (and bf16 tl.dot) wrongly, so on it attention and quant_linear upcast bf16 to fp32 before their dots; a GPU
# keeps the native dot.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def pow2(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(max(int(n), 1)), floor)


def warps(elems: int) -> int:
    # ~8 elements per thread, 1..16 warps
    return min(max(pow2(elems) // 256, 1), 16)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, last] with a unit last stride (copies only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def as_heads(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()
