"""The layout kernels/native/quant_gemm_i8.cpp reads (float32 activations quantized to int8 in the op, integer
dot products on AVX2), packed once at load from a QuantizedWeight.

Outputs in groups of 8; for each group and 32-weight block, its 8 quads (k = 4j .. 4j + 3) in turn, each the
8 outputs' 4 values at those k, byte 4o + i = output o at k = 4j + i (a row's 4 values broadcast to every
output meet them in one vpmaddubsw); then the block's 8 fp16 scales d, then (int4) the 8 fp16 offsets m:
  int8: 8 quads x 32 bytes + 16 = 272 bytes a group block
  int4: 4 x 32 bytes, the p-th holding quad 2p in its low nibbles and quad 2p + 1 in its high ones (byte
        4o + i: output o at k = 8p + i low, 8p + 4 + i high; either nibble is a whole quad for the integer
        dot product, all 8 outputs), + 32 = 160
The last group is padded with zero weights (q = d = m = 0). A pure reshuffle of the QuantizedWeight's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseserve.kernels.quant import BLOCK, QuantizedWeight
from phaseserve.kernels.quant_packing import PackedWeight, bits_of, block_values, on_cpu, per_group

LANES = 8


@dataclass(frozen=True)
class PackedQuantI8Weight(PackedWeight):
    """data: uint8 [ceil(N/8), K/32, block bytes]."""


can_pack = on_cpu


def pack(qw: QuantizedWeight) -> PackedQuantI8Weight:
    out_f, in_f = qw.shape
    groups, blocks = -(-out_f // LANES), in_f // BLOCK
    values = block_values(qw, groups * LANES)
    if qw.kind == "int4":
        # [group, block, p, output o, i, nibble]: output 8g + o at k = 8p + 4 nibble + i
        pairs = values.view(groups, LANES, blocks, BLOCK // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    else:  # [group, block, quad j, output o, i]: output 8g + o at k = 4j + i
        q = values.view(groups, LANES, blocks, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    parts = [q.reshape(groups, blocks, -1), per_group(qw.scales, groups, LANES)]
    if qw.kind == "int4":
        parts.append(per_group(qw.mins, groups, LANES))
    return PackedQuantI8Weight(bits_of(qw), torch.cat(parts, dim=-1).contiguous(), qw.shape)
