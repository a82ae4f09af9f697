"""The layout kernels/native/bf16_gemm.cpp reads, packed once at load from a plain bf16 [out, in] weight.

Output rows in groups of 16; for each group its k-pairs in order, each one zmm of bf16 pairs (lane 2i + s
holds output 16g + i at k = 2p + s), zero-padded to whole groups and whole pairs: [ceil(N/16), ceil(K/2),
32]. A pure reshuffle (no value changes; padding only where N % 16 or K % 2), and it replaces the plain
weight, so memory does not grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 16


@dataclass(frozen=True)
class PackedBf16Weight:
    data: torch.Tensor  # bf16 [ceil(N/16), ceil(K/2), 32]
    shape: tuple[int, int]  # (N, K) of the plain weight

    def nbytes(self) -> int:
        return self.data.nbytes

    def unpack(self) -> torch.Tensor:
        """The plain [N, K] weight back (tests; and a torch fallback, should one ever be needed)."""
        n, k = self.shape
        groups, pairs, _ = self.data.shape
        return self.data.view(groups, pairs, GROUP, 2).permute(0, 2, 1, 3).reshape(groups * GROUP, pairs * 2)[:n, :k]


def can_pack(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def pack(weight: torch.Tensor) -> PackedBf16Weight:
    n, k = weight.shape
    groups, pairs = -(-n // GROUP), -(-k // 2)
    w = weight
    if groups * GROUP != n or pairs * 2 != k:
        w = F.pad(w, (0, pairs * 2 - k, 0, groups * GROUP - n))
    data = w.reshape(groups, GROUP, pairs, 2).permute(0, 2, 1, 3).contiguous().view(groups, pairs, 2 * GROUP)
    return PackedBf16Weight(data, (n, k))
