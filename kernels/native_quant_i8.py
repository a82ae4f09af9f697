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
import torch.nn.functional as F

from kernels.quant import BLOCK, QuantizedWeight

LANES = 8


@dataclass(frozen=True)
class PackedQuantI8Weight:
    bits: int  # 4 | 8
    data: torch.Tensor  # uint8 [ceil(N/8), K/32, block bytes]
    shape: tuple[int, int]

    def nbytes(self) -> int:
        return self.data.nbytes


def can_pack(qw: QuantizedWeight) -> bool:
    return qw.qdata.device.type == "cpu"


def pack(qw: QuantizedWeight) -> PackedQuantI8Weight:
    out_f, in_f = qw.shape
    groups, blocks = -(-out_f // LANES), in_f // BLOCK
    rows = groups * LANES

    def padded(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, rows - out_f)) if rows > out_f else t

    def per_group(t: torch.Tensor) -> torch.Tensor:  # fp16 [N, blocks] -> bytes [groups, blocks, 16]
        return padded(t).view(groups, LANES, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)

    if qw.kind == "int4":
        nib = padded(qw.qdata).view(rows, blocks, BLOCK // 2)
        values = torch.cat((nib & 0x0F, nib >> 4), dim=-1)  # [rows, blocks, 32]: element k of each block
    else:
        values = padded(qw.qdata.view(torch.uint8)).view(rows, blocks, BLOCK)
    if qw.kind == "int4":
        # [group, block, p, output o, i, nibble]: output 8g + o at k = 8p + 4 nibble + i
        pairs = values.view(groups, LANES, blocks, BLOCK // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    else:  # [group, block, quad j, output o, i]: output 8g + o at k = 4j + i
        q = values.view(groups, LANES, blocks, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    parts = [q.reshape(groups, blocks, -1), per_group(qw.scales)]
    if qw.kind == "int4":
        parts.append(per_group(qw.mins))
    return PackedQuantI8Weight(4 if qw.kind == "int4" else 8, torch.cat(parts, dim=-1).contiguous(), qw.shape)
