"""The one dispatch point for kernels: Triton on CUDA tensors, native C++ on a CPU that supports it
(kernels/native), torch otherwise.

Callers import the ops from here and never choose an implementation themselves.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.quant import QuantizedWeight

_OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache", "paged_attention", "sample",
        "pack_quantized", "quant_linear")


def _triton():
    from kernels import triton_ops  # imported lazily: CPU-only installs never load triton

    return triton_ops


def _pick(name: str):
    ref = getattr(reference, name)

    def op(x: torch.Tensor, *args, **kwargs):
        if x.is_cuda:
            return getattr(_triton(), name)(x, *args, **kwargs)
        return ref(x, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


rms_norm = _pick("rms_norm")
silu_and_mul = _pick("silu_and_mul")
write_kv_cache = _pick("write_kv_cache")
paged_attention = _pick("paged_attention")
sample = _pick("sample")


def rotary_embedding(positions, q, k, cos_sin_cache):
    impl = _triton() if q.is_cuda else reference
    return impl.rotary_embedding(positions, q, k, cos_sin_cache)


def _native_quant_gemm():
    from kernels import native

    return native.load("quant_gemm")


def native_quant_available() -> bool:
    """True when this CPU runs quant_linear natively (AVX512-BF16, the op compiled)."""
    return _native_quant_gemm() is not None


def pack_quantized(weight: QuantizedWeight, dtype: torch.dtype):
    """The form of `weight` that quant_linear reads fastest for activations of `dtype`: on a CPU with the
    native op and bf16 activations, the native layout (kernels/native_quant.py, same bytes, reshuffled;
    the QuantizedWeight is not kept); else the QuantizedWeight itself."""
    from kernels import native_quant

    if (weight.qdata.device.type == "cpu" and dtype == torch.bfloat16 and native_quant.can_pack(weight)
            and native_quant_available()):
        return native_quant.pack(weight)
    return weight


def quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, in] @ W.T for W from pack_quantized: [T, out] in x's dtype."""
    if isinstance(weight, QuantizedWeight):
        if x.is_cuda:
            return _triton().quant_linear(x, weight)
        return reference.quant_linear(x, weight)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"quant_linear: a natively packed weight takes bfloat16 activations, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _native_quant_gemm().quant_linear(x, weight.data, weight.bits)


__all__ = list(_OPS) + ["native_quant_available"]
