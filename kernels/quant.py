"""The block-quantized weight format that `kernels.quant_linear` reads.

A 2-D weight [out_features, in_features] is cut into blocks of 32 consecutive weights along the input
dim, each with its own fp16 scale d (and for int4 an fp16 offset m):
  int8: w = d * q,      q int8 in [-127, 127]      (GGUF Q8_0, as stored)
  int4: w = d * q + m,  q uint4 in [0, 15]         (GGUF Q4_1 as stored; Q4_0 is m = -8d, exact)
int4 nibbles keep GGUF's order inside a block: byte i holds element i (low nibble) and i + 16 (high).
So a GGUF file's Q8_0 / Q4_0 / Q4_1 weights are split into these tensors byte for byte, without a round
trip through bf16, and a bf16/fp32 weight is quantized the same way llama.cpp quantizes (scales rounded
to fp16 first, then q from the rounded scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
KINDS = ("int8", "int4")
# GGUF type -> (our kind, bytes per block)
GGUF_TYPES = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20)}


class QuantizationError(ValueError):
    """A weight that cannot take the requested quantization (bad shape or type)."""


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str  # "int8" | "int4"
    qdata: torch.Tensor  # int8 [out, in] | uint8 [out, in / 2]
    scales: torch.Tensor  # fp16 [out, in / 32]: d
    mins: torch.Tensor | None  # fp16 [out, in / 32]: m (int4 only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qdata, self.scales, self.mins) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in]: computed in fp32, then rounded once to `dtype`."""
        out_f, in_f = self.shape
        d = self.scales.float().unsqueeze(-1)
        if self.kind == "int8":
            w = self.qdata.view(out_f, -1, BLOCK).float() * d
        else:
            nib = self.qdata.view(out_f, -1, BLOCK // 2)
            q = torch.cat((nib & 0x0F, nib >> 4), dim=-1).float()
            w = q * d + self.mins.float().unsqueeze(-1)
        return w.reshape(out_f, in_f).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `index` only (an embedding lookup of a quantized table). index_select, not
        table[index]: the same rows, several times faster (bench/results, docs/model-runner.md)."""
        part = QuantizedWeight(self.kind, self.qdata.index_select(0, index), self.scales.index_select(0, index),
                               None if self.mins is None else self.mins.index_select(0, index))
        return part.dequantize(dtype)


def _check_shape(shape, what: str) -> None:
    if len(shape) != 2 or shape[1] % BLOCK:
        raise QuantizationError(f"{what}: a quantized weight must be 2-D with in_features a multiple of "
                                f"{BLOCK}, got shape {tuple(shape)}")


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """Block-32 quantization of a float weight [out, in]: int8 symmetric (d = absmax / 127), int4
    asymmetric (m = min, d = (max - min) / 15), with d and m rounded to fp16 before q is chosen."""
    if kind not in KINDS:
        raise QuantizationError(f"unknown quantization {kind!r}; choose one of {', '.join(KINDS)}")
    _check_shape(weight.shape, "quantize")
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // BLOCK, BLOCK)
    if kind == "int8":
        d = (w.abs().amax(-1) / 127).half()
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = (w * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.reshape(out_f, in_f).contiguous(), d.contiguous(), None)
    lo, hi = w.amin(-1), w.amax(-1)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = ((w - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return QuantizedWeight("int4", packed.reshape(out_f, in_f // 2).contiguous(), d.contiguous(),
                           m.contiguous())


def from_gguf(ggml_type: str, raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF block-quantized weight (raw uint8 [out, bytes_per_row], blocks as stored) split into
    this format without touching a value: Q8_0 -> int8, Q4_1 -> int4, Q4_0 -> int4 with m = -8d."""
    if ggml_type not in GGUF_TYPES:
        raise QuantizationError(f"GGUF type {ggml_type} has no int8/int4 mapping (supported: "
                                f"{', '.join(GGUF_TYPES)})")
    _check_shape(shape, f"GGUF {ggml_type} weight")
    kind, block_bytes = GGUF_TYPES[ggml_type]
    out_f, in_f = shape
    nblocks = in_f // BLOCK
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_f, nblocks * block_bytes):
        raise QuantizationError(f"GGUF {ggml_type} weight of shape {shape} needs raw uint8 "
                                f"[{out_f}, {nblocks * block_bytes}], got {raw.dtype} {tuple(raw.shape)}")
    blocks = raw.reshape(out_f, nblocks, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(out_f, nblocks)
    if ggml_type == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(out_f, in_f)
        return QuantizedWeight("int8", q, d, None)
    if ggml_type == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(out_f, nblocks)
        nib = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d); -8d is exact in fp16 (a power-of-two multiple)
        m = d * -8
        nib = blocks[..., 2:]
    return QuantizedWeight("int4", nib.reshape(out_f, in_f // 2).contiguous(), d, m)
