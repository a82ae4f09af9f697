"""The dispatch of a whole decoder layer in one native call (kernels/native/decode_layer_f32.cpp): float32
activations and weights packed for int8 activations, where this CPU runs it; the model runs the layer's
ops one by one elsewhere."""

from __future__ import annotations

import torch

from phaseserve.kernels.dispatch.attention import unsupported_native_attention
from phaseserve.kernels.dispatch.choices import CHOICES, Choice, load_native, torch_vector_floats
from phaseserve.kernels.dispatch.layer_ops import native_layer_ops
from phaseserve.kernels.dispatch.linears import int8_activations_available
from phaseserve.kernels.native_quant_i8 import PackedQuantI8Weight

# decode_layer_f32's (decode_layer, decode_layers) overloads, or None
DECODE_LAYER = Choice("decode layer", lambda _key: load_native(
    "decode_layer_f32", "CPU decode layers in one call (float32, int8 activations)",
    fallback="the layer's ops one by one", wrap=lambda ops: (ops.decode_layer.default, ops.decode_layers.default)))


def decode_layer_available(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when decode_layer runs on this CPU for a model of these shapes: float32 activations, weights packed
    for int8 activations (kernels/native_quant_i8.py), the float32 attention's head shapes."""
    return (int8_activations_available(torch.float32)
            and unsupported_native_attention(torch.float32, num_heads, num_kv_heads, head_dim) is None
            and native_layer_ops(torch.float32) is not None and CHOICES.get(DECODE_LAYER) is not None)


def decode_layer(h: torch.Tensor, residual: torch.Tensor | None, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 eps: float, qkv: PackedQuantI8Weight, o: PackedQuantI8Weight, gate_up: PackedQuantI8Weight,
                 down: PackedQuantI8Weight, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_heads: int):
    """One decoder layer of a decode step (one query per sequence; float32, bias-free linears packed for int8
    activations) in one native call: add_rms_norm, the qkv linear, rotary_and_write_kv, paged_attention, the
    o linear, add_rms_norm, gate_up, silu_and_mul, down, with the bits of those ops run one by one. Returns
    (h, residual) as the layer's forward does. Only where decode_layer_available."""
    return CHOICES.get(DECODE_LAYER)[0](h, residual, input_norm, post_norm, eps, qkv.data, qkv.bits, o.data,
                                        o.bits, gate_up.data, gate_up.bits, down.data, down.bits, positions,
                                        cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                        scale, num_heads, torch_vector_floats())


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
        self.op = CHOICES.get(DECODE_LAYER)[1]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (h, residual)."""
        return self.op(h, self.input_norms, self.post_norms, self.eps, self.weights, self.bits, positions,
                       cos_sin_cache, k_caches, v_caches, slot_mapping, block_tables, seq_lens, self.scale,
                       self.num_heads, torch_vector_floats())
