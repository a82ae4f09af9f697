"""The layout kernels/native/quant_gemm.cpp reads, packed once at load from a QuantizedWeight.

Output rows in groups of 16; for each group and 32-weight block, 16 k-pairs, each unpacking to one
zmm of bf16 pairs (lane i = output 16g + i, k and k + 1), as oneDNN lays out bf16 weights. int4 nibbles
sit where the kernel's shift-by-part unpack finds them (`int4_element`); after each block's k-pairs come
its fp16 scales (and offsets) of the group's 16 outputs, so a group is one contiguous stream. A pure
reshuffle: no value changes, the bytes per weight are those of the QuantizedWeight (0.625 B/weight for
int4, 1.0625 for int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseserve.kernels.quant import BLOCK, QuantizedWeight
from phaseserve.kernels.quant_packing import PackedWeight, bits_of, block_values, on_cpu, per_group

GROUP = 16
PAIRS = BLOCK // 2


def int4_element(lane: int) -> int:
    """Which nibble of a k-pair's 16 bytes (0..15 low nibbles, 16..31 high) the kernel's unpack puts in
    bf16 lane `lane`: a 128-bit broadcast whose 16-bit words are shifted by 0 / 8 / 4 / 12 in its four
    128-bit parts."""
    part, word = divmod(lane, 8)
    return (16 if part >= 2 else 0) + 2 * word + part % 2


# nibble position -> the lane it feeds
_NIBBLE_LANE = torch.tensor(sorted(range(BLOCK), key=int4_element))


@dataclass(frozen=True)
class PackedQuantWeight(PackedWeight):
    """data: uint8 [N/16, K/32, block bytes]: k-pairs, fp16 scales, (int4) fp16 offsets."""


def can_pack(qw: QuantizedWeight) -> bool:
    return qw.shape[0] % GROUP == 0 and on_cpu(qw)


def pack(qw: QuantizedWeight) -> PackedQuantWeight:
    out_f, in_f = qw.shape
    groups, blocks = out_f // GROUP, in_f // BLOCK
    q = block_values(qw, out_f)
    # [group, block, pair, lane]: lane 2i + s holds output 16g + i at k = 32b + 2p + s
    lanes = q.view(groups, GROUP, blocks, PAIRS, 2).permute(0, 2, 3, 1, 4).reshape(groups, blocks, PAIRS, BLOCK)
    if qw.kind == "int4":
        nibbles = lanes[..., _NIBBLE_LANE]
        pairs = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2:] << 4)
        parts = [pairs.reshape(groups, blocks, -1), per_group(qw.scales, groups, GROUP),
                 per_group(qw.mins, groups, GROUP)]
    else:
        parts = [lanes.reshape(groups, blocks, -1), per_group(qw.scales, groups, GROUP)]
    return PackedQuantWeight(bits_of(qw), torch.cat(parts, dim=-1).contiguous(), qw.shape)
