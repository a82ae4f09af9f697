"""What the packers of quantized weights share (kernels/native_quant.py for bf16 activations,
native_quant_f32.py for float32, native_quant_i8.py for float32 quantized to int8): the packed form, and the
steps every layout starts from. Each packer keeps only its own order of the values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phaseserve.kernels.quant import BLOCK, QuantizedWeight


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in one native op's layout; its class says which op reads it."""

    bits: int  # 4 | 8 (| 16: a bf16 weight, native_quant_f32.pack_bf16)
    data: torch.Tensor  # uint8 [groups of outputs, K / 32, block bytes]
    shape: tuple[int, int]  # (N, K) of the plain weight

    def nbytes(self) -> int:
        return self.data.nbytes


def on_cpu(qw: QuantizedWeight) -> bool:
    return qw.qdata.device.type == "cpu"


def padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (dim 0): the last group of outputs padded with zero weights."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0])) if rows > t.shape[0] else t


def block_values(qw: QuantizedWeight, rows: int) -> torch.Tensor:
    """uint8 [rows, K / 32, 32]: element k of each 32-weight block (int4: its nibble), zero rows past N."""
    out_f, in_f = qw.shape
    if qw.kind == "int4":
        nib = padded_rows(qw.qdata, rows).view(rows, in_f // BLOCK, BLOCK // 2)
        return torch.cat((nib & 0x0F, nib >> 4), dim=-1)
    return padded_rows(qw.qdata.view(torch.uint8), rows).view(rows, in_f // BLOCK, BLOCK)


def per_group(t: torch.Tensor, groups: int, lanes: int) -> torch.Tensor:
    """fp16 scales or offsets [N, blocks] -> bytes [groups, blocks, 2 * lanes]: a group's values of each block
    side by side (zeros for padded outputs)."""
    blocks = t.shape[1]
    return padded_rows(t, groups * lanes).view(groups, lanes, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)


def bits_of(qw: QuantizedWeight) -> int:
    return 4 if qw.kind == "int4" else 8
