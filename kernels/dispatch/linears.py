"""The dispatch of the CPU linears that have native ops: matmuls with quantized weights (bf16 activations
on AVX512-BF16: quant_gemm.cpp; float32 on AVX2 + FMA: quant_gemm_f32.cpp, or with the activations quantized
to int8 in the op: quant_gemm_i8.cpp), bf16 linears (bf16_gemm.cpp) and LoRA's products (lora.cpp). Each
runs Triton or torch where its native op does not."""

from __future__ import annotations

import torch

from phaseserve.kernels import cpu_isa, native_bf16, native_quant, native_quant_f32, native_quant_i8, reference
from phaseserve.kernels.dispatch.choices import CHOICES, Choice, dtype_name, implementation, load_native, log, triton_ops
from phaseserve.kernels.native_bf16 import PackedBf16Weight
from phaseserve.kernels.native_quant_f32 import PackedQuantF32Weight
from phaseserve.kernels.native_quant_i8 import PackedQuantI8Weight
from phaseserve.kernels.quant import QuantizedWeight

# activation dtype -> the native op file of quantized matmuls for it
QUANT_SOURCE = {torch.bfloat16: "quant_gemm", torch.float32: "quant_gemm_f32"}

# per activation dtype: the native quantized-matmul ops, or None
QUANT_GEMM = Choice("quantized matmul", lambda dtype: load_native(
    QUANT_SOURCE.get(dtype), "CPU quantized linear",
    why_not=None if dtype in QUANT_SOURCE else f"dtype {dtype} (native: bfloat16, float32)",
    fallback="torch reference (dequantize, then F.linear)", dtype=dtype_name(dtype)))
# the native quantized matmul that quantizes float32 activations to int8 (AVX2 + FMA), or None
QUANT_GEMM_I8 = Choice("quantized matmul, int8 activations",
                       lambda _key: load_native("quant_gemm_i8", "CPU quantized linear, int8 activations"))


def _quant_linear_overload(packed_type: type):
    # a packed weight exists only where its op loaded; held as its overload: this runs four times a layer
    # every step, where native.load's switch and lock checks would show
    if packed_type is PackedQuantI8Weight:
        return CHOICES.get(QUANT_GEMM_I8).quant_linear.default
    dtype = torch.float32 if packed_type is PackedQuantF32Weight else torch.bfloat16
    return CHOICES.get(QUANT_GEMM, dtype).quant_linear.default


# per packed weight's class: the quant_linear overload that reads it
QUANT_LINEAR_OP = Choice("quant_linear overload", _quant_linear_overload)
# quant_gemm_f32.cpp's bf16_linear overload (bf16-valued float32 weights)
BF16_WEIGHT_F32_OP = Choice("bf16-weight float32 linear",
                            lambda _key: CHOICES.get(QUANT_GEMM, torch.float32).bf16_linear.default)


def native_quant_kernel(dtype: torch.dtype) -> str | None:
    """The native op that runs quant_linear on this CPU for activations of `dtype` (for log lines:
    "native avx512-bf16" for bf16 on AVX512-BF16, "native avx2" for float32 on AVX2 + FMA), or None
    where only the torch reference runs."""
    return implementation(QUANT_SOURCE[dtype]) if CHOICES.get(QUANT_GEMM, dtype) is not None else None


def native_quant_available(dtype: torch.dtype) -> bool:
    """True when this CPU runs quant_linear natively for activations of `dtype`."""
    return native_quant_kernel(dtype) is not None


def int8_activations_available(dtype: torch.dtype) -> bool:
    """True when quant_linear can quantize activations of `dtype` to int8 on this CPU (float32 on AVX2 + FMA)."""
    return dtype == torch.float32 and CHOICES.get(QUANT_GEMM_I8) is not None


def pack_quantized(weight: QuantizedWeight, dtype: torch.dtype, activations: str = "none"):
    """The form of `weight` that quant_linear reads fastest for activations of `dtype`: on a CPU with the
    native op for that dtype, its layout (bf16: kernels/native_quant.py; float32: kernels/native_quant_f32.py,
    or kernels/native_quant_i8.py with activations="int8", where int8_activations_available: the op then
    quantizes each row's 32-element blocks to int8 and multiplies in integers; same bytes, reshuffled; the
    QuantizedWeight is not kept); else the QuantizedWeight itself."""
    if activations not in ("none", "int8"):
        raise ValueError(f"activations must be none or int8, got {activations!r}")
    if weight.qdata.device.type != "cpu":
        return weight
    if activations == "int8" and int8_activations_available(dtype):
        return native_quant_i8.pack(weight)
    if not native_quant_available(dtype):
        return weight
    if dtype == torch.float32:
        return native_quant_f32.pack(weight)
    return native_quant.pack(weight) if native_quant.can_pack(weight) else weight


def quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, in] @ W.T for W from pack_quantized: [T, out] in x's dtype. The native ops sum each output in
    one fixed order, so a row's result does not depend on the other rows or the thread count."""
    if isinstance(weight, QuantizedWeight):
        if x.is_cuda:
            return triton_ops().quant_linear(x, weight)
        return reference.quant_linear(x, weight)
    f32 = isinstance(weight, (PackedQuantF32Weight, PackedQuantI8Weight))
    if x.dtype != (torch.float32 if f32 else torch.bfloat16):
        raise TypeError(f"quant_linear: a weight packed for {'float32' if f32 else 'bfloat16'} activations "
                        f"got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    op = CHOICES.get(QUANT_LINEAR_OP, type(weight))
    if f32:
        return op(x, weight.data, weight.bits, weight.shape[0])
    return op(x, weight.data, weight.bits)


def pack_bf16_weight_f32(weight: torch.Tensor) -> PackedQuantF32Weight | None:
    """A float32 CPU linear weight [out, in] that holds only bf16 values (a bf16 checkpoint served in float32),
    stored as bf16 in the AVX2 op's layout: decode reads half the bytes, and the products are those of the
    float32 weight. Only where float32 is this CPU's fast dtype (the AVX2 level: no AVX512-BF16); else None
    and the caller keeps its oneDNN path (which also runs AVX-512 where the CPU has it)."""
    if (weight.dtype != torch.float32 or cpu_isa.level() != "avx2" or not native_quant_f32.can_pack_bf16(weight)
            or not native_quant_available(torch.float32) or not native_quant_f32.bf16_exact(weight)):
        return None
    return native_quant_f32.pack_bf16(weight)


def bf16_weight_linear_f32(x: torch.Tensor, weight: PackedQuantF32Weight) -> torch.Tensor:
    """x [T, in] float32 @ W.T for W from pack_bf16_weight_f32: [T, out] float32, each row's result
    independent of the other rows and the thread count."""
    if x.dtype != torch.float32:
        raise TypeError(f"bf16_weight_linear_f32: takes float32 activations, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return CHOICES.get(BF16_WEIGHT_F32_OP)(x, weight.data, weight.shape[0])


def _resolve_bf16_gemm(_key: None):
    ops = load_native("bf16_gemm", "CPU bf16 linear", fallback="torch (oneDNN)")
    if ops is not None:  # the op's multiply, the same at every row count: AMX tiles where the CPU has them
        log.info("CPU bf16 linear multiply", multiply="AMX tiles" if ops.amx() else "vdpbf16ps")
    return ops


# bf16_gemm.cpp's loaded ops, or None (torch's oneDNN)
BF16_GEMM = Choice("bf16 linear", _resolve_bf16_gemm)


def pack_bf16_linear(weight: torch.Tensor) -> PackedBf16Weight | None:
    """A bf16 CPU linear weight [out, in] in the layout bf16_linear reads (kernels/native_bf16.py, a pure
    reshuffle that replaces the plain weight), where this CPU runs the native op; else None: the caller
    keeps its torch (oneDNN) path. fp32 and CUDA weights always get None."""
    if not native_bf16.can_pack(weight) or CHOICES.get(BF16_GEMM) is None:
        return None
    return native_bf16.pack(weight)


def bf16_linear(x: torch.Tensor, weight: PackedBf16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] bf16 @ W.T + bias for W from pack_bf16_linear: [T, out] bf16. Each output sums its inputs
    in one fixed order (AMX tiles where the CPU has AMX-BF16, vdpbf16ps elsewhere, at every row count), so a
    row's result does not depend on the other rows or the thread count."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"bf16_linear: takes bfloat16 activations, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return CHOICES.get(BF16_GEMM).bf16_linear(x, weight.data, bias, weight.shape[0])


LORA_TILE_ROWS = reference.LORA_TILE_ROWS


def _bind_lora_width(ops):
    """lora.cpp's op with its vector width bound: AVX512 where the CPU level (and its cap) allows
    avx512-bf16, else AVX2."""
    op, wide = ops.lora_add.default, cpu_isa.supports("avx512-bf16")
    return lambda y, x, rows, ends, a, b, cols: op(y, x, rows, ends, a, b, cols, wide)


# the native LoRA op, or None (torch)
LORA = Choice("LoRA products", lambda _key: load_native("lora", "CPU LoRA products", wrap=_bind_lora_width))


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, ends: list[int], a: list[torch.Tensor],
             b: list[torch.Tensor], cols: list[int]) -> torch.Tensor:
    # on CPU the native op (kernels/native/lora.cpp): every adapter's rows in one call, each row alone in one
    # fixed order, reading the adapters' matrices in their own dtype; the torch reference where it is
    # unavailable or declines (a layout it does not take), and on CUDA.
    if not x.is_cuda:
        native_add = CHOICES.get(LORA)
        if native_add is not None and native_add(y, x, rows, ends, a, b, cols):
            return y
        # torch on one thread: matmuls this small gain nothing from a second one, and an OpenMP region waits
        # for every thread (on a busy machine, for a thread that is not running)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
            try:
                return reference.lora_add(y, x, rows, ends, a, b, cols)
            finally:
                torch.set_num_threads(threads)
    return reference.lora_add(y, x, rows, ends, a, b, cols)


lora_add.__doc__ = reference.lora_add.__doc__
