"""A linear layer whose weight is laid out once, at load, for the device's fastest GEMM.

bf16 on a CPU with AVX512-BF16: the native GEMM (kernels/native/bf16_gemm.cpp, weight packed in its layout
by kernels.pack_bf16_linear; AMX tiles where the CPU has AMX-BF16), at every row count: decode steps read
the weights once at near DRAM speed and run the multiply-adds under the stream; prefill runs as fast as
oneDNN or faster (docs/model-runner.md). Its rows do not depend on each other or on the thread count.
float32 on an AVX2 CPU (no AVX512-BF16) with a weight of bf16 values (a bf16 checkpoint served in float32):
the weight kept as bf16 for the native op (kernels/native/quant_gemm_f32.cpp, bf16_linear): decode reads half
the bytes of float32, the products are unchanged.
Otherwise (fp32, or no native op) the weight is reordered into oneDNN's blocked layout (what
torch.compile's freezing pass does for CPU linears): the prepacked oneDNN matmul streams the weight several
times faster than `F.linear` on a plain [out, in] bf16 matrix. Results match `F.linear`
(same fp32 accumulation). Either packed weight replaces the plain one, so memory does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phaseserve import kernels
from phaseserve.kernels.quant import QuantizedWeight


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """y = x @ weight.T + bias for x [T, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = bias
        # native bf16 GEMM where this CPU runs it (kernels decides and logs); else oneDNN's packed weight
        self.native = kernels.pack_bf16_linear(weight) if pack else None
        if self.native is not None and bias is not None:
            self.bias = bias.to(torch.bfloat16).contiguous()
        # float32 on an AVX2 CPU: a weight of bf16 values (a bf16 checkpoint) kept as bf16 for the native op
        self.native_f32 = kernels.pack_bf16_weight_f32(weight) if pack and self.native is None else None
        self.packed = self.native is None and self.native_f32 is None and pack and _can_pack(weight)
        # the packed tensor is opaque (layout torch._mkldnn): only the matmul below can read it
        if self.native is not None or self.native_f32 is not None:
            self.weight = None
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        else:
            self.weight = weight

    def numel(self) -> int:
        return self.out_features * self.in_features

    def nbytes(self) -> int:
        held = self.native_f32.nbytes() if self.native_f32 is not None else self.numel() * self.dtype.itemsize
        return held + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return kernels.bf16_linear(x, self.native, self.bias)
        if self.native_f32 is not None:
            y = kernels.bf16_weight_linear_f32(x, self.native_f32)
            return y if self.bias is None else y + self.bias
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]


# oneDNN builds (and JIT-compiles) a matmul primitive for every new row count and caches 1024 of them.
# A serving step's row count is whatever the scheduler packed (decodes + prefill chunks), so unpadded
# every step paid a new primitive, and prefills at random lengths ran slower than at one fixed length, with
# page faults on every step (docs/model-runner.md).
# Up to ROW_QUANTUM rows (small decode batches) row counts are few and stay cached; above, rounding up to
# a multiple of ROW_QUANTUM costs at most ROW_QUANTUM - 1 rows, a small part of a prefill step.
# One row goes as two: oneDNN's one-row fp32 kernel (a matrix-vector product) sums in another order than
# its GEMM, so a row alone in a step would get other bits than among others (tests/test_row_invariance.py).
ROW_QUANTUM = 16


def padded_rows(rows: int) -> int:
    if rows == 1:
        return 2
    return rows if rows <= ROW_QUANTUM else -(-rows // ROW_QUANTUM) * ROW_QUANTUM


class QuantizedLinear:
    """y = x @ W.T + bias for a block-quantized W (kernels/quant.py), kept quantized in memory: the matmul
    (kernels.quant_linear) reads the quantized bytes. Same call interface as Linear."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, activations: str = "none"):
        self.out_features, self.in_features = weight.shape
        self.kind = weight.kind
        self.dtype = dtype
        self.bias = bias
        # activations="int8": the matmul quantizes each row's 32-element blocks to int8 (where it can)
        self.weight = kernels.pack_quantized(weight, dtype, activations)

    def numel(self) -> int:
        return self.out_features * self.in_features

    def nbytes(self) -> int:
        return self.weight.nbytes() + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.quant_linear(x, self.weight)
        return y if self.bias is None else y + self.bias
