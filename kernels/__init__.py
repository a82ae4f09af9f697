"""The one dispatch point for kernels: Triton on CUDA tensors, native C++ where this CPU supports it, torch
otherwise.

Callers import the ops from here and never choose an implementation themselves. Native ops
(kernels/native) run on CPU for attention (decode and prefill chunks), a layer's elementwise work
(rms_norm, silu_and_mul, rotary_and_write_kv) and the greedy argmax: in bf16 where the CPU has AVX512-BF16
(decode_attention.cpp, extend_attention.cpp, layer_ops.cpp), in float32 where it has AVX2 + FMA
(attention_f32.cpp, layer_ops_f32.cpp); and for bf16 linears (kernels/native/bf16_gemm.cpp, on AMX tiles
where the CPU has AMX-BF16) and matmuls
with quantized weights (bf16 activations on AVX512-BF16: quant_gemm.cpp; float32 on AVX2 + FMA:
quant_gemm_f32.cpp, or with the activations quantized to int8 in the op, where a model asks for it:
quant_gemm_i8.cpp). kernels/cpu_isa.py says what the CPU runs (PHASESERVE_CPU_ISA caps it); set
PHASESERVE_NATIVE=0 to run torch everywhere.
"""

from __future__ import annotations

import functools

import structlog
import torch

from kernels import native, reference
from kernels.native_bf16 import PackedBf16Weight
from kernels.native_quant_f32 import PackedQuantF32Weight
from kernels.native_quant_i8 import PackedQuantI8Weight
from kernels.quant import QuantizedWeight

log = structlog.get_logger(__name__)

_OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache", "rotary_and_write_kv", "paged_attention",
        "argmax", "sample", "pack_quantized", "quant_linear", "int8_activations_available", "pack_bf16_linear", "bf16_linear",
        "pack_bf16_weight_f32", "bf16_weight_linear_f32", "decode_layer_available", "decode_layer", "DecodeLayers",
        "lora_add", "LORA_TILE_ROWS")

# What the native attention ops (decode and prefill) handle; anything else takes the torch path.
NATIVE_ATTENTION_HEAD_DIMS = {torch.bfloat16: (32, 64, 128), torch.float32: (16, 32, 64, 128)}
NATIVE_ATTENTION_MAX_GROUP = 16  # query heads per KV head


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


write_kv_cache = _pick("write_kv_cache")
sample = _pick("sample")


def rotary_embedding(positions, q, k, cos_sin_cache):
    impl = _triton() if q.is_cuda else reference
    return impl.rotary_embedding(positions, q, k, cos_sin_cache)


def _load_native(name: str) -> tuple[object | None, str | None]:
    """native.load(name) and, when it gave None, why (for the one log line saying which implementation runs)."""
    ops = native.load(name)
    if ops is not None:
        return ops, None
    return None, ("turned off (PHASESERVE_NATIVE=0)" if not native.enabled()
                  else "native op unavailable (see the log line above)")


# the native files of the dtype-specific CPU ops, per activation dtype
_LAYER_OPS_SOURCE = {torch.bfloat16: "layer_ops", torch.float32: "layer_ops_f32"}
_ATTENTION_SOURCE = {torch.bfloat16: {"decode_attention": "decode_attention", "extend_attention": "extend_attention"},
                     torch.float32: {"decode_attention": "attention_f32", "extend_attention": "attention_f32"}}


def _implementation(source: str | None) -> str:
    """What a log line calls the implementation: "native <the CPU level the file needs>", or "torch"."""
    return "torch" if source is None else f"native {native.REQUIRES[source]}"


def _choose(choices: dict, key, source: str | None, why_not: str | None, event: str,
            fallback: str = "torch", wrap=None, **fields):
    """The loaded native ops of kernels/native/<source>.cpp for `key` (passed through `wrap`, when given), or
    None (torch): decided once per key, logged then (`why_not`, when set, says why no native op can serve it,
    and nothing is loaded)."""
    if key not in choices:
        ops, reason = (None, why_not) if why_not is not None else _load_native(source)
        log.info(event, implementation=_implementation(source) if ops is not None else fallback, reason=reason,
                 **fields)
        choices[key] = None if ops is None else wrap(ops) if wrap else ops
    return choices[key]


@functools.cache  # asked once: decode_layer passes it every layer
def _torch_vector_floats() -> int:
    """Floats per step of torch's vectorized CPU loops (two vectors of the capability its kernels run at): its
    fp32 silu computes exp with Sleef inside those steps and with the C library's expf past the last whole
    one, and layer_ops_f32's silu_and_mul does the same to stay bit-identical."""
    return {"AVX512": 32, "AVX2": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


class _LayerOps:
    """The native layer ops of one dtype (kernels/native/layer_ops.cpp for bf16, layer_ops_f32.cpp for fp32),
    held as their overloads: a call skips the packet's overload lookup (these run four times a layer every
    step, where a lookup per call shows)."""

    def __init__(self, ops, dtype: torch.dtype):
        self.rms_norm = ops.rms_norm.default
        self.add_rms_norm = ops.add_rms_norm.default
        self.rotary_and_write_kv = ops.rotary_and_write_kv.default
        self.argmax = ops.argmax.default
        silu = ops.silu_and_mul.default
        if dtype == torch.float32:
            block = _torch_vector_floats()
            self.silu_and_mul = lambda x: silu(x, block)
        else:
            self.silu_and_mul = silu


# dtype -> the native layer ops for CPU tensors of that dtype, or None for torch
_layer_ops_choice: dict[torch.dtype, _LayerOps | None] = {}


def _native_layer_ops(dtype: torch.dtype) -> _LayerOps | None:
    """The native layer ops (rms_norm, silu_and_mul, rotary_and_write_kv, argmax) for CPU tensors of `dtype`,
    or None (torch). Decided once per dtype and logged then. Both dtypes' ops give torch's bits (their tests
    assert it), so a test comparing with the torch reference for equality holds either way."""
    ops = _layer_ops_choice.get(dtype, False)
    if ops is not False:  # the hot path: one lookup a call
        return ops
    source = _LAYER_OPS_SOURCE.get(dtype)
    return _choose(_layer_ops_choice, dtype, source,
                   None if source is not None else f"dtype {dtype} (native layer ops: bfloat16, float32)",
                   "CPU layer ops (rms_norm, silu_and_mul, rotary_and_write_kv)",
                   wrap=lambda loaded: _LayerOps(loaded, dtype), dtype=str(dtype).removeprefix("torch."))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if x.is_cuda:
        triton = _triton()
        return triton.rms_norm(x, weight, eps) if residual is None else triton.rms_norm(x, weight, eps, residual)
    ops = _native_layer_ops(x.dtype)
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
        return _triton().silu_and_mul(x)
    ops = _native_layer_ops(x.dtype)
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
        return _triton().rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    ops = _native_layer_ops(q.dtype)
    # the op checks dtypes and layouts itself (cheaper there) and returns False, untouched, for what it
    # does not take: then torch runs
    if ops is not None and ops.rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                                   slot_mapping):
        return q, k
    return reference.rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:
        return reference.argmax(logits)
    ops = _native_layer_ops(logits.dtype)
    # logits straight from the lm_head: one pass over them (bf16: instead of an fp32 copy and torch's argmax
    # over it)
    if ops is not None and logits.dim() == 2:
        return ops.argmax(logits)
    return reference.argmax(logits)


argmax.__doc__ = reference.argmax.__doc__


def _unsupported_native_attention(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                  head_dim: int) -> str | None:
    """Why the native attention ops (decode and prefill) cannot take these shapes, or None when they can."""
    if dtype not in _ATTENTION_SOURCE:
        return f"dtype {dtype} (native attention: bfloat16, float32)"
    if head_dim not in NATIVE_ATTENTION_HEAD_DIMS[dtype]:
        return f"head_dim {head_dim} (native: {', '.join(map(str, NATIVE_ATTENTION_HEAD_DIMS[dtype]))})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > NATIVE_ATTENTION_MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    return None


# (op, dtype, heads, kv heads, head_dim) -> the loaded native ops, or None for torch
_attention_choice: dict[tuple, object | None] = {}
_ATTENTION_LOG = {"decode_attention": "CPU decode attention", "extend_attention": "CPU prefill attention"}


def _native_attention(op: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """The loaded native ops serving `op` (decode_attention or extend_attention) for CPU attention in `dtype`
    at these shapes, or None (torch). Decided once per op and shape, and logged then."""
    key = (op, dtype, num_heads, num_kv_heads, head_dim)
    if key in _attention_choice:  # the hot path: every layer of every step
        return _attention_choice[key]
    why_not = _unsupported_native_attention(dtype, num_heads, num_kv_heads, head_dim)
    return _choose(_attention_choice, key, None if why_not else _ATTENTION_SOURCE[dtype][op], why_not,
                   _ATTENTION_LOG[op], dtype=str(dtype).removeprefix("torch."), heads=num_heads,
                   kv_heads=num_kv_heads, head_dim=head_dim)


def _native_decode(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    return _native_attention("decode_attention", dtype, num_heads, num_kv_heads, head_dim)


def _native_extend(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    return _native_attention("extend_attention", dtype, num_heads, num_kv_heads, head_dim)


def decode_reads_own_lengths(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> bool:
    """True when paged_attention's decodes (one query per sequence) on this device read each sequence's own
    context length, so a caller gains nothing from grouping decodes by length. False for the torch path,
    which pads every row of a call to its longest context."""
    if torch.device(device).type == "cuda":
        return True
    return _native_decode(dtype, num_heads, num_kv_heads, head_dim) is not None


def paged_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if q.is_cuda:
        return _triton().paged_attention(q, *args, **kwargs)
    return _cpu_paged_attention(q, *args, **kwargs)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.int()


def _cpu_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, max_query_len: int,
) -> torch.Tensor:
    T, H, D = q.shape
    if k_cache.dtype == q.dtype:
        decode = max_query_len == 1 and T == seq_lens.shape[0]
        ops = (_native_decode if decode else _native_extend)(q.dtype, H, k_cache.shape[2], D)
        if ops is not None:
            if q.stride(2) != 1 or q.stride(1) != D:
                q = q.contiguous()
            # the runner's step tensors are int32 already: .int() would still cost a dispatch per layer
            block_tables, seq_lens = _int32(block_tables), _int32(seq_lens)
            if decode:
                return ops.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
            return ops.extend_attention(q, k_cache, v_cache, block_tables, seq_lens, _int32(query_start_loc), scale)
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len)


paged_attention.__doc__ = reference.paged_attention.__doc__


_decode_layer_choice: dict[None, object | None] = {}  # decode_layer_f32's ops, or None; decided on first use


def _native_decode_layer_ops():
    if None in _decode_layer_choice:  # the hot path: every decode step
        return _decode_layer_choice[None]
    return _choose(_decode_layer_choice, None, "decode_layer_f32", None,
                   "CPU decode layers in one call (float32, int8 activations)", "the layer's ops one by one",
                   wrap=lambda ops: (ops.decode_layer.default, ops.decode_layers.default))


def _native_decode_layer():
    ops = _native_decode_layer_ops()
    return None if ops is None else ops[0]


def decode_layer_available(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when decode_layer runs on this CPU for a model of these shapes: float32 activations, weights packed
    for int8 activations (kernels/native_quant_i8.py), the float32 attention's head shapes."""
    return (int8_activations_available(torch.float32)
            and _unsupported_native_attention(torch.float32, num_heads, num_kv_heads, head_dim) is None
            and _native_layer_ops(torch.float32) is not None and _native_decode_layer() is not None)


def decode_layer(h: torch.Tensor, residual: torch.Tensor | None, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 eps: float, qkv: PackedQuantI8Weight, o: PackedQuantI8Weight, gate_up: PackedQuantI8Weight,
                 down: PackedQuantI8Weight, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_heads: int):
    """One decoder layer of a decode step (one query per sequence; float32, bias-free linears packed for int8
    activations) in one native call (kernels/native/decode_layer_f32.cpp): add_rms_norm, the qkv linear,
    rotary_and_write_kv, paged_attention, the o linear, add_rms_norm, gate_up, silu_and_mul, down, with the
    bits of those ops run one by one. Returns (h, residual) as the layer's forward does. Only where
    decode_layer_available."""
    return _native_decode_layer()(h, residual, input_norm, post_norm, eps, qkv.data, qkv.bits, o.data, o.bits,
                                  gate_up.data, gate_up.bits, down.data, down.bits, positions, cos_sin_cache,
                                  k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, num_heads,
                                  _torch_vector_floats())


class DecodeLayers:
    """Every decoder layer of a decode step in one native call (decode_layers: decode_layer for each layer in
    turn, the first without a residual), its per-model arguments gathered once. `layers`: per layer
    (input_norm, post_norm, (qkv, o, gate_up, down)), the weights as decode_layer takes them. Only where
    decode_layer_available."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor, tuple]], eps: float, scale: float,
                 num_heads: int):
        self.input_norms = [norm for norm, _, _ in layers]
        self.post_norms = [norm for _, norm, _ in layers]
        self.weights = [w.data for _, _, ws in layers for w in ws]
        self.bits = [w.bits for _, _, ws in layers for w in ws]
        self.eps, self.scale, self.num_heads = eps, scale, num_heads
        self.op = _native_decode_layer_ops()[1]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (h, residual)."""
        return self.op(h, self.input_norms, self.post_norms, self.eps, self.weights, self.bits, positions,
                       cos_sin_cache, k_caches, v_caches, slot_mapping, block_tables, seq_lens, self.scale,
                       self.num_heads, _torch_vector_floats())



# activation dtype -> the native op file of quantized matmuls for it
_QUANT_SOURCE = {torch.bfloat16: "quant_gemm", torch.float32: "quant_gemm_f32"}
_quant_choice: dict[torch.dtype, object | None] = {}  # dtype -> the loaded op, or None; decided on first use
# the packed form's class -> the op's quant_linear overload, looked up on its first call
_quant_linear_ops: dict[type, object] = {}


def _native_quant_gemm(dtype: torch.dtype):
    """The native quantized-matmul ops for CPU activations of `dtype`, or None. Decided once per dtype and
    logged then."""
    source = _QUANT_SOURCE.get(dtype)
    return _choose(_quant_choice, dtype, source, None if source else f"dtype {dtype} (native: bfloat16, float32)",
                   "CPU quantized linear", "torch reference (dequantize, then F.linear)",
                   dtype=str(dtype).removeprefix("torch."))


def native_quant_kernel(dtype: torch.dtype) -> str | None:
    """The native op that runs quant_linear on this CPU for activations of `dtype` (for log lines:
    "native avx512-bf16" for bf16 on AVX512-BF16, "native avx2" for float32 on AVX2 + FMA), or None
    where only the torch reference runs."""
    return _implementation(_QUANT_SOURCE[dtype]) if _native_quant_gemm(dtype) is not None else None


def native_quant_available(dtype: torch.dtype) -> bool:
    """True when this CPU runs quant_linear natively for activations of `dtype`."""
    return native_quant_kernel(dtype) is not None


_quant_i8_choice: dict[None, object | None] = {}  # the loaded int8-activation op, or None; decided on first use


def _native_quant_gemm_i8():
    """The native quantized matmul that quantizes float32 activations to int8 (AVX2 + FMA), or None."""
    if None in _quant_i8_choice:
        return _quant_i8_choice[None]
    return _choose(_quant_i8_choice, None, "quant_gemm_i8", None, "CPU quantized linear, int8 activations")


def int8_activations_available(dtype: torch.dtype) -> bool:
    """True when quant_linear can quantize activations of `dtype` to int8 on this CPU (float32 on AVX2 + FMA)."""
    return dtype == torch.float32 and _native_quant_gemm_i8() is not None


def pack_quantized(weight: QuantizedWeight, dtype: torch.dtype, activations: str = "none"):
    """The form of `weight` that quant_linear reads fastest for activations of `dtype`: on a CPU with the
    native op for that dtype, its layout (bf16: kernels/native_quant.py; float32: kernels/native_quant_f32.py,
    or kernels/native_quant_i8.py with activations="int8", where int8_activations_available: the op then
    quantizes each row's 32-element blocks to int8 and multiplies in integers; same bytes, reshuffled; the
    QuantizedWeight is not kept); else the QuantizedWeight itself."""
    from kernels import native_quant, native_quant_f32, native_quant_i8

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


def _quant_linear_op(weight) -> object:
    op = _quant_linear_ops.get(type(weight))
    if op is None:
        # a packed weight exists only where its op loaded; held as its overload, as _LayerOps does: this runs
        # four times a layer every step, where native.load's switch and lock checks would show
        if isinstance(weight, PackedQuantI8Weight):
            ops = _native_quant_gemm_i8()
        else:
            ops = _native_quant_gemm(torch.float32 if isinstance(weight, PackedQuantF32Weight) else torch.bfloat16)
        op = _quant_linear_ops[type(weight)] = ops.quant_linear.default
    return op


def quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, in] @ W.T for W from pack_quantized: [T, out] in x's dtype. The native ops sum each output in
    one fixed order, so a row's result does not depend on the other rows or the thread count."""
    if isinstance(weight, QuantizedWeight):
        if x.is_cuda:
            return _triton().quant_linear(x, weight)
        return reference.quant_linear(x, weight)
    f32 = isinstance(weight, (PackedQuantF32Weight, PackedQuantI8Weight))
    if x.dtype != (torch.float32 if f32 else torch.bfloat16):
        raise TypeError(f"quant_linear: a weight packed for {'float32' if f32 else 'bfloat16'} activations "
                        f"got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if f32:
        return _quant_linear_op(weight)(x, weight.data, weight.bits, weight.shape[0])
    return _quant_linear_op(weight)(x, weight.data, weight.bits)


def pack_bf16_weight_f32(weight: torch.Tensor) -> PackedQuantF32Weight | None:
    """A float32 CPU linear weight [out, in] that holds only bf16 values (a bf16 checkpoint served in float32),
    stored as bf16 in the AVX2 op's layout: decode reads half the bytes, and the products are those of the
    float32 weight. Only where float32 is this CPU's fast dtype (the AVX2 level: no AVX512-BF16); else None
    and the caller keeps its oneDNN path (which also runs AVX-512 where the CPU has it)."""
    from kernels import cpu_isa, native_quant_f32

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
    if not _bf16_weight_f32_op:
        _bf16_weight_f32_op.append(_native_quant_gemm(torch.float32).bf16_linear.default)
    return _bf16_weight_f32_op[0](x, weight.data, weight.shape[0])


_bf16_weight_f32_op: list = []  # [quant_gemm_f32.cpp's bf16_linear overload], looked up on the first call


_bf16_gemm_choice: dict[None, object | None] = {}  # the loaded native ops or None, decided on first use


def _native_bf16_gemm():
    if None in _bf16_gemm_choice:  # the hot path: every bf16 linear
        return _bf16_gemm_choice[None]
    ops = _choose(_bf16_gemm_choice, None, "bf16_gemm", None, "CPU bf16 linear", "torch (oneDNN)")
    if ops is not None:  # the op's multiply, the same at every row count: AMX tiles where the CPU has them
        log.info("CPU bf16 linear multiply", multiply="AMX tiles" if ops.amx() else "vdpbf16ps")
    return ops


def pack_bf16_linear(weight: torch.Tensor) -> PackedBf16Weight | None:
    """A bf16 CPU linear weight [out, in] in the layout bf16_linear reads (kernels/native_bf16.py, a pure
    reshuffle that replaces the plain weight), where this CPU runs the native op; else None: the caller
    keeps its torch (oneDNN) path. fp32 and CUDA weights always get None."""
    from kernels import native_bf16

    if not native_bf16.can_pack(weight) or _native_bf16_gemm() is None:
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
    return _native_bf16_gemm().bf16_linear(x, weight.data, bias, weight.shape[0])


LORA_TILE_ROWS = reference.LORA_TILE_ROWS
_lora_choice: dict[None, object | None] = {}


def _native_lora():
    """The native LoRA op with its vector width bound: AVX512 where the CPU level (and its cap) allows
    avx512-bf16, else AVX2; or None (torch)."""
    if None in _lora_choice:  # the hot path: every linear of every step with LoRA rows
        return _lora_choice[None]
    from kernels import cpu_isa

    def bind(ops):
        op, wide = ops.lora_add.default, cpu_isa.supports("avx512-bf16")
        return lambda y, x, rows, ends, a, b, cols: op(y, x, rows, ends, a, b, cols, wide)

    return _choose(_lora_choice, None, "lora", None, "CPU LoRA products", wrap=bind)


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, ends: list[int], a: list[torch.Tensor],
             b: list[torch.Tensor], cols: list[int]) -> torch.Tensor:
    # on CPU the native op (kernels/native/lora.cpp): every adapter's rows in one call, each row alone in one
    # fixed order, reading the adapters' matrices in their own dtype; the torch reference where it is
    # unavailable or declines (a layout it does not take), and on CUDA.
    if not x.is_cuda:
        native_add = _native_lora()
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


__all__ = list(_OPS) + ["decode_reads_own_lengths", "native_quant_available", "native_quant_kernel"]
