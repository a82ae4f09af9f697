"""The dispatch of a layer's elementwise ops: Triton on CUDA tensors; on CPU the native layer ops of the
activations' dtype (kernels/native/layer_ops.cpp for bf16, layer_ops_f32.cpp for float32), else torch."""

from __future__ import annotations

import torch

from phaseserve.kernels import reference
from phaseserve.kernels.dispatch.choices import CHOICES, Choice, dtype_name, load_native, torch_vector_floats, triton_ops

# the native file of the layer ops, per activation dtype
LAYER_OPS_SOURCE = {torch.bfloat16: "layer_ops", torch.float32: "layer_ops_f32"}


def _pick(name: str):
    """The op `name` as Triton on CUDA tensors and the torch reference elsewhere."""
    ref = getattr(reference, name)

    def op(x: torch.Tensor, *args, **kwargs):
        if x.is_cuda:
            return getattr(triton_ops(), name)(x, *args, **kwargs)
        return ref(x, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


write_kv_cache = _pick("write_kv_cache")
sample = _pick("sample")


def rotary_embedding(positions, q, k, cos_sin_cache):
    impl = triton_ops() if q.is_cuda else reference
    return impl.rotary_embedding(positions, q, k, cos_sin_cache)


class LayerOps:
    """The native layer ops of one dtype, held as their overloads: a call skips the packet's overload lookup
    (these run four times a layer every step, where a lookup per call shows)."""

    def __init__(self, ops, dtype: torch.dtype):
        self.rms_norm = ops.rms_norm.default
        self.add_rms_norm = ops.add_rms_norm.default
        self.rotary_and_write_kv = ops.rotary_and_write_kv.default
        self.argmax = ops.argmax.default
        silu = ops.silu_and_mul.default
        if dtype == torch.float32:
            block = torch_vector_floats()
            self.silu_and_mul = lambda x: silu(x, block)
        else:
            self.silu_and_mul = silu


def _resolve_layer_ops(dtype: torch.dtype) -> LayerOps | None:
    source = LAYER_OPS_SOURCE.get(dtype)
    return load_native(source, "CPU layer ops (rms_norm, silu_and_mul, rotary_and_write_kv)",
                       why_not=None if source is not None else f"dtype {dtype} (native layer ops: bfloat16, float32)",
                       wrap=lambda loaded: LayerOps(loaded, dtype), dtype=dtype_name(dtype))


# per activation dtype: the native layer ops, or None (torch). Both dtypes' ops give torch's bits (their tests
# assert it), so a test comparing with the torch reference for equality holds either way.
LAYER_OPS = Choice("layer ops", _resolve_layer_ops)


def native_layer_ops(dtype: torch.dtype) -> LayerOps | None:
    """The native layer ops (rms_norm, silu_and_mul, rotary_and_write_kv, argmax) for CPU tensors of `dtype`,
    or None (torch)."""
    return CHOICES.get(LAYER_OPS, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if x.is_cuda:
        triton = triton_ops()
        return triton.rms_norm(x, weight, eps) if residual is None else triton.rms_norm(x, weight, eps, residual)
    ops = CHOICES.get(LAYER_OPS, x.dtype)
    # few, cheap checks per call; the op takes any layout
    if ops is not None and weight.dtype == x.dtype:
        if residual is None:
            return ops.rms_norm(x, weight, eps), None
        if residual.dtype == x.dtype:
            return ops.add_rms_norm(x, residual, weight, eps)
    return reference.rms_norm(x, weight, eps, residual)


rms_norm.__doc__ = reference.rms_norm.__doc__


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return triton_ops().silu_and_mul(x)
    ops = CHOICES.get(LAYER_OPS, x.dtype)
    if ops is not None:
        return ops.silu_and_mul(x)
    return reference.silu_and_mul(x)


silu_and_mul.__doc__ = reference.silu_and_mul.__doc__


def rotary_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding(positions, q, k, cos_sin_cache), then write_kv_cache of the rotated k and v: returns
    the rotated (q, k). The native CPU op does both in one pass and rotates q and k *in place* (they are
    views of the qkv GEMM output, read once more by attention): use the returned tensors, and never count on
    q and k keeping their values."""
    if q.is_cuda:
        return triton_ops().rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    ops = CHOICES.get(LAYER_OPS, q.dtype)
    # the op checks dtypes and layouts itself (cheaper there) and returns False, untouched, for what it
    # does not take: then torch runs
    if ops is not None and ops.rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                                   slot_mapping):
        return q, k
    return reference.rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:
        return reference.argmax(logits)
    ops = CHOICES.get(LAYER_OPS, logits.dtype)
    # logits straight from the lm_head: one pass over them (bf16: instead of an fp32 copy and torch's argmax
    # over it)
    if ops is not None and logits.dim() == 2:
        return ops.argmax(logits)
    return reference.argmax(logits)


argmax.__doc__ = reference.argmax.__doc__
