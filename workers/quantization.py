"""Which form each linear weight takes in memory: --quantization none | int8 | int4 | auto.

Weights arrive as tensors (safetensors, already in the model dtype) or, from a GGUF file, as
`QuantizedTensor`s (workers/gguf_weights.py: GGUF blocks as stored). This module turns each into what
the model multiplies with: a plain tensor (Linear, bf16/fp32) or a block-quantized QuantizedWeight
(QuantizedLinear, kernels/quant.py).

  none  every weight dequantized / kept in the model dtype
  int8  every linear block-32 int8 (GGUF Q8_0 kept as is; other GGUF types and tensors quantized)
  int4  every linear block-32 int4 (GGUF Q4_0 / Q4_1 kept as is; others quantized)
  auto  a GGUF file's Q8_0 / Q4_0 / Q4_1 weights stay as stored (int8 / int4: no round trip, the
        file's own numbers, and decoding is faster than dense (bench/bench_quant.py)) where a fast
        quantized kernel runs for the model's dtype (CUDA; on CPU bf16 with AVX512-BF16, float32 with
        AVX2 + FMA); every other weight, and everything where no such kernel runs, as in `none`. A
        safetensors checkpoint is thus served exactly as trained; quantizing it is an explicit choice.

--activation-quant none | int8 | auto: what the quantized linears do with float32 activations on CPU.
  none  multiply them as they are (fp32 sums of the unpacked weights: kernels/native/quant_gemm_f32.cpp)
  int8  quantize each row's 32-element blocks to int8 (one fp32 scale a block) and multiply in integers, as
        llama.cpp does on AVX2 (kernels/native/quant_gemm_i8.cpp): faster, and it moves the numbers
  auto  int8 at the avx2 level (float32 activations there; docs/decisions.md says why), none elsewhere (bf16
        activations, or float32 asked for on a CPU whose default is bf16: those keep their numbers)
Only where float32 activations meet quantized weights on a CPU with AVX2 + FMA; elsewhere (bf16, CUDA) int8
is logged and ignored.

Embedding lookups read a few rows a step: a table kept quantized (GGUF, int8/int4) is dequantized row by
row at lookup; a float table stays float. The lm_head follows the linears' rule (tied: from the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from phaseserve import kernels
from phaseserve.kernels.quant import BLOCK, GGUF_TYPES, QuantizationError, QuantizedWeight, from_gguf, quantize
from phaseserve.workers.linear import Linear, QuantizedLinear

log = structlog.get_logger(__name__)

MODES = ("none", "int8", "int4", "auto")
ACTIVATION_MODES = ("none", "int8", "auto")


def is_gguf_quantized(w: Any) -> bool:
    """A GGUF QuantizedTensor (duck-typed: ggml_type, raw, shape, dequantize)."""
    return hasattr(w, "ggml_type") and hasattr(w, "raw") and hasattr(w, "dequantize")


def _quantized_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The fast matmul that reads quantized weights here for activations of `dtype` (its name, for the log),
    or None: Triton on CUDA; on CPU the native op for the dtype (bf16 on AVX512-BF16, float32 on AVX2 + FMA)."""
    if device.type == "cuda":
        return "triton"
    return kernels.native_quant_kernel(dtype)


def _fast_quantized_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    return _quantized_kernel(device, dtype) is not None


def resolve_activations(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """What --activation-quant `requested` means here: "int8" or "none"."""
    if requested not in ACTIVATION_MODES:
        raise QuantizationError(f"unknown activation quantization {requested!r}; choose one of "
                                f"{', '.join(ACTIVATION_MODES)}")
    if requested == "none" or device.type != "cpu":
        return "none"
    if requested == "auto":
        from phaseserve.kernels import cpu_isa

        # int8 activations move perplexity less than the int4 weights they meet already do (docs/decisions.md)
        wanted = cpu_isa.level() == "avx2" and dtype == torch.float32
        return "int8" if wanted and kernels.int8_activations_available(dtype) else "none"
    if not kernels.int8_activations_available(dtype):
        log.warning("int8 activations need float32 activations on a CPU with AVX2 + FMA: multiplying them as "
                    "they are", activation_quant=requested, dtype=str(dtype))
        return "none"
    return "int8"


@dataclass(frozen=True)
class Quantization:
    mode: str
    dtype: torch.dtype  # the model's (activations') dtype
    device: torch.device
    activations: str = "none"  # --activation-quant as asked
    activation_quant: str = field(init=False)  # what it means here: "int8" or "none"

    def __post_init__(self):
        if self.mode not in MODES:
            raise QuantizationError(f"unknown quantization {self.mode!r}; choose one of {', '.join(MODES)}")
        object.__setattr__(self, "activation_quant", resolve_activations(self.activations, self.device, self.dtype))
        if self.mode in ("int8", "int4") and not _fast_quantized_kernel(self.device, self.dtype):
            log.warning("no fast quantized matmul here (needs bf16 on a CPU with AVX512-BF16, float32 on one "
                        "with AVX2 + FMA, or CUDA): every quantized linear dequantizes its weight on each call",
                        quantization=self.mode, dtype=str(self.dtype))

    def _keeps_gguf(self, w: Any) -> bool:
        if w.ggml_type not in GGUF_TYPES:
            return False
        kind = GGUF_TYPES[w.ggml_type][0]
        if self.mode == "auto":
            return _fast_quantized_kernel(self.device, self.dtype)
        return kind == self.mode

    def weight(self, w: Any) -> torch.Tensor | QuantizedWeight:
        """One linear weight in the form this mode gives it."""
        if is_gguf_quantized(w):
            if self._keeps_gguf(w):
                return from_gguf(w.ggml_type, w.raw.to(self.device), tuple(w.shape))
            w = w.dequantize(self.dtype).to(self.device)
        if self.mode in ("int8", "int4"):
            if w.shape[-1] % BLOCK:
                log.debug("linear kept unquantized: in_features is not a multiple of the block",
                         shape=tuple(w.shape), block=BLOCK)
                return w
            return quantize(w, self.mode)
        return w

    def linear(self, parts: list, bias: torch.Tensor | None = None) -> Linear | QuantizedLinear:
        """A linear of the weights `parts` stacked along the output dim (fused qkv, gate_up)."""
        ws = [self.weight(p) for p in parts]
        if all(isinstance(w, torch.Tensor) for w in ws):
            return Linear(ws[0] if len(ws) == 1 else torch.cat(ws), bias)
        kinds = {w.kind if isinstance(w, QuantizedWeight) else None for w in ws}
        if len(kinds) > 1:  # mixed types in one fused linear (GGUF Q4_1 beside Q8_0): one form for all
            dense = [w.dequantize(self.dtype) if isinstance(w, QuantizedWeight) else w for w in ws]
            if self.mode not in ("int8", "int4") or any(d.shape[-1] % BLOCK for d in dense):
                return Linear(torch.cat(dense), bias)
            ws = [quantize(d, self.mode) for d in dense]
        return QuantizedLinear(concat_rows(ws), bias, dtype=self.dtype, activations=self.activation_quant)

    def log_summary(self, linears: list, table: Any) -> None:
        """One line: how many linears took each form, and which matmul runs the quantized ones."""
        kinds: dict[str, int] = {}
        for lin in linears:
            kind = getattr(lin, "kind", str(lin.dtype).removeprefix("torch."))
            kinds[kind] = kinds.get(kind, 0) + 1
        quantized = [lin for lin in linears if isinstance(lin, QuantizedLinear)]
        native = sum(not isinstance(lin.weight, QuantizedWeight) for lin in quantized)
        log.info("linear weights", quantization=self.mode, activation_quant=self.activation_quant, kinds=kinds,
                 embedding=getattr(table, "kind", str(getattr(table, "dtype", "")).removeprefix("torch.")),
                 matmul=("none quantized" if not quantized else _quantized_kernel(self.device, self.dtype)
                         if native == len(quantized) or self.device.type == "cuda" else "torch reference (slow)"),
                 bytes=sum(lin.nbytes() for lin in linears))

    def embedding(self, w: Any) -> torch.Tensor | QuantizedWeight:
        """The lookup table: a GGUF table kept quantized when this mode keeps it, else a float tensor."""
        if is_gguf_quantized(w):
            if self._keeps_gguf(w) or (self.mode in ("int8", "int4") and w.ggml_type in GGUF_TYPES):
                return from_gguf(w.ggml_type, w.raw.to(self.device), tuple(w.shape))
            return w.dequantize(self.dtype).to(self.device)
        return w


def concat_rows(ws: list[QuantizedWeight]) -> QuantizedWeight:
    """QuantizedWeights of one kind stacked along the output dim."""
    if len(ws) == 1:
        return ws[0]
    return QuantizedWeight(ws[0].kind, torch.cat([w.qdata for w in ws]), torch.cat([w.scales for w in ws]),
                           None if ws[0].mins is None else torch.cat([w.mins for w in ws]))


def embed(table: torch.Tensor | QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the table in `dtype` (a quantized table: only those rows dequantized)."""
    if isinstance(table, QuantizedWeight):
        return table.rows(ids, dtype)
    return torch.nn.functional.embedding(ids, table)
