"""The layout kernels/native/quant_gemm_f32.cpp reads (float32 activations, AVX2 + FMA), packed once at load
from a QuantizedWeight.

Outputs in groups of 8 (one ymm of fp32 lanes, lane i = output 8g + i); for each group and 32-weight block,
the quantized values k by k across the group's 8 outputs, then the block's 8 fp16 scales (and offsets), so a
group is one contiguous stream:
  int8: 32 x 8 bytes (k-major), then 8 fp16 d
  int4: per 4 k, 16 bytes: byte i (< 8) holds lane i's k and k + 1 (low, high nibble), byte 8 + i its k + 2
        and k + 3; then 8 fp16 d and 8 fp16 m
A bf16 weight (`pack_bf16`, bits 16) takes the same groups: 32 k x 8 lanes of bf16 a block, no scales.
The last group is padded with zero weights (q = d = m = 0) when out_features is not a multiple of 8. A pure
reshuffle: no value changes, the bytes per weight are those of the QuantizedWeight (0.625 B/weight for int4,
1.0625 for int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseserve.kernels.quant import BLOCK, QuantizedWeight
from phaseserve.kernels.quant_packing import PackedWeight, bits_of, block_values, on_cpu, padded_rows, per_group

LANES = 8


@dataclass(frozen=True)
class PackedQuantF32Weight(PackedWeight):
    """data: uint8 [ceil(N/8), K/32, block bytes]: quantized values, fp16 scales, (int4) fp16 offsets; bits 16:
    a bf16 weight (pack_bf16)."""


can_pack = on_cpu


def pack(qw: QuantizedWeight) -> PackedQuantF32Weight:
    out_f, in_f = qw.shape
    groups, blocks = -(-out_f // LANES), in_f // BLOCK
    q = block_values(qw, groups * LANES)
    # [group, block, k, lane]: lane i is output 8g + i
    lanes = q.view(groups, LANES, blocks, BLOCK).permute(0, 2, 3, 1)
    if qw.kind == "int4":
        quads = lanes.reshape(groups, blocks, BLOCK // 4, 4, LANES)
        first = quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)  # k, k + 1 of each lane
        second = quads[:, :, :, 2] | (quads[:, :, :, 3] << 4)  # k + 2, k + 3
        values = torch.cat((first, second), dim=-1).reshape(groups, blocks, -1)
        parts = [values, per_group(qw.scales, groups, LANES), per_group(qw.mins, groups, LANES)]
    else:
        parts = [lanes.reshape(groups, blocks, -1), per_group(qw.scales, groups, LANES)]
    return PackedQuantF32Weight(bits_of(qw), torch.cat(parts, dim=-1).contiguous(), qw.shape)


def bf16_exact(weight: torch.Tensor) -> bool:
    """True when a float32 weight holds only bf16 values (a bf16 checkpoint served in float32): storing it as
    bf16 then changes nothing."""
    return bool(torch.equal(weight.bfloat16().float(), weight))


def can_pack_bf16(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.shape[1] % BLOCK == 0
            and weight.dtype in (torch.float32, torch.bfloat16))


def pack_bf16(weight: torch.Tensor) -> PackedQuantF32Weight:
    """A bf16-valued weight [out, in] in the same 8-output groups, as bf16: per group and block, 32 k of 8 lanes
    (512 bytes), no scales (bits 16). Half the bytes of float32."""
    out_f, in_f = weight.shape
    groups, blocks = -(-out_f // LANES), in_f // BLOCK
    w = padded_rows(weight.bfloat16(), groups * LANES)
    lanes = w.view(groups, LANES, blocks, BLOCK).permute(0, 2, 3, 1).contiguous()  # [group, block, k, lane]
    return PackedQuantF32Weight(16, lanes.view(torch.uint8).reshape(groups, blocks, -1), (out_f, in_f))
