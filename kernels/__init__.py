"""The one dispatch point for kernels: Triton on CUDA tensors, torch on CPU.

Callers import the ops from here and never choose an implementation themselves.
"""

from __future__ import annotations

import torch

from kernels import reference

_OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache", "paged_attention", "sample")


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


__all__ = list(_OPS)
