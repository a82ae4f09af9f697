"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, readable top to bottom.

Every hot op goes through `kernels` (Triton on GPU; native C++ or torch on CPU). q/k/v and
gate/up projections are concatenated at load so a layer runs four GEMMs:
qkv, o, gate_up, down. The forward pass takes one packed, unpadded batch of
tokens from any mix of prefill chunks and decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import structlog
import torch

from phaseserve import kernels
from phaseserve.kernels.native_quant_i8 import PackedQuantI8Weight
from phaseserve.workers.kv_cache import KVCache
from phaseserve.workers.loader import ModelConfig, ModelLoadError
from phaseserve.workers.lora import LoraStep
from phaseserve.workers.quantization import Quantization, embed

log = structlog.get_logger(__name__)


@dataclass
class AttentionGroup:
    """A contiguous run of packed tokens [token_start, token_end) whose sequences share one
    paged_attention call. The CPU path gives decodes (one query each) their own group so that
    they are attended in one batched call."""

    token_start: int
    token_end: int
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32, relative to token_start
    max_query_len: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    groups: list[AttentionGroup]
    logits_indices: torch.Tensor  # [R] int64: the packed rows whose next token is sampled, ascending
    # the step's LoRA rows by adapter (workers/lora.py); None when every row runs the base model
    lora: LoraStep | None = None


def rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, computed exactly as transformers' ROPE_INIT_FUNCTIONS do."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(cfg: ModelConfig, max_positions: int, device) -> torch.Tensor:
    """[max_positions, head_dim]: cos of every frequency, then sin (fp32)."""
    inv_freq = rotary_inv_freq(cfg)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], index: int, quant: Quantization):
        prefix = f"model.layers.{index}."
        self.index = index
        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = w.pop(prefix + name, None)
            if t is None and required:
                raise ModelLoadError(f"checkpoint is missing weight {prefix + name}")
            return t

        self.cfg = cfg
        self.input_norm = take("input_layernorm.weight")
        self.post_attn_norm = take("post_attention_layernorm.weight")
        q, k, v = (take(f"self_attn.{n}_proj.weight") for n in "qkv")
        biases = [take(f"self_attn.{n}_proj.bias", required=cfg.qkv_bias) for n in "qkv"]
        self.qkv = quant.linear([q, k, v], torch.cat(biases).contiguous() if biases[0] is not None else None)
        self.o = quant.linear([take("self_attn.o_proj.weight")], take("self_attn.o_proj.bias", required=False))
        mlp_biases = [take(f"mlp.{n}_proj.bias", required=cfg.mlp_bias) for n in ("gate", "up", "down")]
        self.gate_up = quant.linear([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")],
                                    torch.cat(mlp_biases[:2]).contiguous() if cfg.mlp_bias else None)
        self.down = quant.linear([take("mlp.down_proj.weight")], mlp_biases[2])
        self.q_size = cfg.num_heads * cfg.head_dim
        self.head_split = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        self.qkv_heads = sum(self.head_split)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, h, residual, inp: StepInputs, cos_sin, k_cache, v_cache):
        cfg = self.cfg
        if residual is None:
            residual = h
            x, _ = kernels.rms_norm(h, self.input_norm, cfg.rms_norm_eps)
        else:
            x, residual = kernels.rms_norm(h, self.input_norm, cfg.rms_norm_eps, residual)

        lora = inp.lora  # each LoRA row's low-rank product is added to the linears' outputs
        qkv = self.qkv(x)
        if lora is not None:
            qkv = lora.apply(qkv, x, self.index, "qkv")
        T = qkv.shape[0]
        # heads of q, k and v as views of qkv: one view and one split, fewer dispatches than a split and 3 views
        q, k, v = qkv.view(T, self.qkv_heads, cfg.head_dim).split_with_sizes(self.head_split, 1)
        q, k = kernels.rotary_and_write_kv(inp.positions, q, k, v, cos_sin, k_cache, v_cache, inp.slot_mapping)
        groups = inp.groups
        if len(groups) == 1:  # one call over every token: no slice of q, no cat
            g = groups[0]
            attn = kernels.paged_attention(q, k_cache, v_cache, g.block_tables, g.seq_lens, g.query_start_loc,
                                           self.scale, g.max_query_len)
        else:
            attn = torch.cat([
                kernels.paged_attention(q[g.token_start:g.token_end], k_cache, v_cache, g.block_tables, g.seq_lens,
                                        g.query_start_loc, self.scale, g.max_query_len)
                for g in groups
            ])
        attn = attn.reshape(T, self.q_size)
        h = self.o(attn)
        if lora is not None:
            h = lora.apply(h, attn, self.index, "o")

        x, residual = kernels.rms_norm(h, self.post_attn_norm, cfg.rms_norm_eps, residual)
        if lora is None:
            return self.down(kernels.silu_and_mul(self.gate_up(x))), residual
        act = kernels.silu_and_mul(lora.apply(self.gate_up(x), x, self.index, "gate_up"))
        return lora.apply(self.down(act), act, self.index, "down"), residual

    def takes_decode_layer(self) -> bool:
        """True when kernels.decode_layer can run this layer: float32 norms, and every linear bias-free and packed
        for int8 activations (kernels/native_quant_i8.py)."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        return (all(isinstance(getattr(lin, "weight", None), PackedQuantI8Weight) and lin.bias is None
                    for lin in linears)
                and self.input_norm.dtype == self.post_attn_norm.dtype == torch.float32)

    def decode(self, h, residual, inp: StepInputs, cos_sin, k_cache, v_cache):
        """forward for a decode step (one attention group of one query per sequence) in one native call: the
        same bits (kernels.decode_layer)."""
        g = inp.groups[0]
        return kernels.decode_layer(h, residual, self.input_norm, self.post_attn_norm, self.cfg.rms_norm_eps,
                                    self.qkv.weight, self.o.weight, self.gate_up.weight, self.down.weight,
                                    inp.positions, cos_sin, k_cache, v_cache, inp.slot_mapping, g.block_tables,
                                    g.seq_lens, self.scale, self.cfg.num_heads)


class LlamaFamilyModel:
    """Embedding -> N pre-norm decoder layers -> final norm -> lm_head (on the sampled rows only).

    `quantization` (workers/quantization.py) decides which linears keep quantized weights, `activation_quant`
    whether they quantize float32 activations to int8; `dtype` is the activations' dtype (the checkpoint's
    tensors are already in it)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 device: str | torch.device = "cpu", *, quantization: str = "none",
                 dtype: torch.dtype | None = None, activation_quant: str = "none"):
        w = dict(weights)
        self.cfg = cfg
        self.device = torch.device(device)
        embed_weight = w.pop("model.embed_tokens.weight", None)
        if embed_weight is None:
            raise ModelLoadError("checkpoint is missing weight model.embed_tokens.weight")
        self.dtype = dtype or embed_weight.dtype
        quant = Quantization(quantization, self.dtype, self.device, activation_quant)
        self.quantization = quantization
        self.activation_quant = quant.activation_quant  # "int8" | "none": what --activation-quant means here
        self.embed = quant.embedding(embed_weight)
        self.layers = [DecoderLayer(cfg, w, i, quant) for i in range(cfg.num_layers)]
        self.norm = w.pop("model.norm.weight", None)
        if self.norm is None:
            raise ModelLoadError("checkpoint is missing weight model.norm.weight")
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None:
            if not cfg.tie_word_embeddings:
                raise ModelLoadError("checkpoint is missing weight lm_head.weight (and embeddings are not tied)")
            lm_head = embed_weight
        self.lm_head = quant.linear([lm_head])  # packed copy: a tied embedding stays plain for the lookup
        del embed_weight, lm_head
        quant.log_summary([self.lm_head] + [m for layer in self.layers
                                            for m in (layer.qkv, layer.o, layer.gate_up, layer.down)], self.embed)
        unused = [k for k in w if not k.endswith("rotary_emb.inv_freq")]
        if unused:
            log.warning("checkpoint tensors not used by the model", count=len(unused), first=unused[:5])
        self.cos_sin_cache = build_cos_sin_cache(cfg, max_positions, self.device)
        # whether decode steps run every layer in one call (kernels.DecodeLayers): decided on the first decode
        self._layer_in_one_call: bool | None = None
        self._decode_layers: kernels.DecodeLayers | None = None

    def _decode_in_one_call(self, inp: StepInputs, h: torch.Tensor, kv: KVCache) -> bool:
        """True for a decode step (one attention group, one query per sequence) of a model whose layers all take
        kernels.decode_layer here."""
        groups = inp.groups
        if len(groups) != 1 or groups[0].max_query_len != 1 or groups[0].seq_lens.shape[0] != h.shape[0]:
            return False
        if self._layer_in_one_call is None:
            cfg = self.cfg
            self._layer_in_one_call = (
                h.device.type == "cpu" and h.dtype == torch.float32 and kv.k[0].dtype == torch.float32
                and self.cos_sin_cache.dtype == torch.float32
                and all(layer.takes_decode_layer() for layer in self.layers)
                and kernels.decode_layer_available(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
            if self._layer_in_one_call:
                layers = self.layers
                self._decode_layers = kernels.DecodeLayers(
                    [(lay.input_norm, lay.post_attn_norm, (lay.qkv.weight, lay.o.weight, lay.gate_up.weight,
                                                           lay.down.weight)) for lay in layers],
                    cfg.rms_norm_eps, layers[0].scale, cfg.num_heads)
        return self._layer_in_one_call

    @torch.inference_mode()
    def forward(self, inp: StepInputs, kv: KVCache, *, fp32: bool = True) -> torch.Tensor:
        """Logits [R, vocab] for the rows in `inp.logits_indices`: in fp32, or with fp32=False as the lm_head
        gives them (the activations' dtype; the sampler upcasts only what it needs, a greedy batch nothing)."""
        h = embed(self.embed, inp.input_ids, self.dtype)
        # a step with LoRA rows runs layer by layer: the one-call decode has no place for the adapters' products
        # (its base rows get the same bits either way)
        if inp.lora is None and self._decode_in_one_call(inp, h, kv):  # every layer in one native call: the same bits
            g = inp.groups[0]
            h, residual = self._decode_layers(h, inp.positions, self.cos_sin_cache, kv.k, kv.v, inp.slot_mapping,
                                              g.block_tables, g.seq_lens)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                h, residual = layer.forward(h, residual, inp, self.cos_sin_cache, kv.k[i], kv.v[i])
        # only the rows that sample need the final norm and the (large) lm_head GEMM; when every row
        # samples (a decode step) the indices are 0..T-1 and need no gather
        rows = inp.logits_indices
        if rows.shape[0] != h.shape[0]:
            h = h.index_select(0, rows)
            residual = residual.index_select(0, rows)
        h, _ = kernels.rms_norm(h, self.norm, self.cfg.rms_norm_eps, residual)
        logits = self.lm_head(h)
        return logits.float() if fp32 else logits
