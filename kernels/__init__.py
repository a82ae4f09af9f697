"""The one dispatch point for kernels: Triton on CUDA tensors, native C++ where this CPU supports it, torch
otherwise.

Callers import the ops from here and never choose an implementation themselves. Native ops
(kernels/native) run on CPU for attention (decode and prefill chunks), a layer's elementwise work
(rms_norm, silu_and_mul, rotary_and_write_kv) and the greedy argmax: in bf16 where the CPU has AVX512-BF16
(decode_attention.cpp, extend_attention.cpp, layer_ops.cpp), in float32 where it has AVX2 + FMA
(attention_f32.cpp, layer_ops_f32.cpp); and for bf16 linears (kernels/native/bf16_gemm.cpp, on AMX tiles
where the CPU has AMX-BF16) and matmuls with quantized weights (bf16 activations on AVX512-BF16:
quant_gemm.cpp; float32 on AVX2 + FMA: quant_gemm_f32.cpp, or with the activations quantized to int8 in the
op, where a model asks for it: quant_gemm_i8.cpp). kernels/cpu_isa.py says what the CPU runs
(PHASESERVE_CPU_ISA caps it); set PHASESERVE_NATIVE=0 to run torch everywhere.

Each op family's dispatch is a file of kernels/dispatch/; every choice they make is kept in one place,
kernels.dispatch.choices.CHOICES (resolved once per process and key; `CHOICES.reset()` forgets them).
"""

from __future__ import annotations

from phaseserve.kernels.dispatch.attention import decode_reads_own_lengths, paged_attention
from phaseserve.kernels.dispatch.choices import CHOICES
from phaseserve.kernels.dispatch.decode_layer import DecodeLayers, decode_layer, decode_layer_available
from phaseserve.kernels.dispatch.layer_ops import (argmax, rms_norm, rotary_and_write_kv, rotary_embedding, sample,
                                        silu_and_mul, write_kv_cache)
from phaseserve.kernels.dispatch.linears import (LORA_TILE_ROWS, bf16_linear, bf16_weight_linear_f32,
                                      int8_activations_available, lora_add, native_quant_available,
                                      native_quant_kernel, pack_bf16_linear, pack_bf16_weight_f32, pack_quantized,
                                      quant_linear)

__all__ = ["rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache", "rotary_and_write_kv",
           "paged_attention", "argmax", "sample", "pack_quantized", "quant_linear", "int8_activations_available",
           "pack_bf16_linear", "bf16_linear", "pack_bf16_weight_f32", "bf16_weight_linear_f32",
           "decode_layer_available", "decode_layer", "DecodeLayers", "lora_add", "LORA_TILE_ROWS",
           "decode_reads_own_lengths", "native_quant_available", "native_quant_kernel", "CHOICES"]
