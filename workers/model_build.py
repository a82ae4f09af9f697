"""Building a runner's model: the checkpoint loaded at its dtype onto its device, its context limit, and
which kernel implementation runs each op family it uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from phaseserve import kernels
from phaseserve.workers.cpu_memory import keep_heap_memory, release_free_heap
from phaseserve.workers.linear import QuantizedLinear
from phaseserve.workers.loader import ModelConfig, load_checkpoint, read_config, resolve_dtype
from phaseserve.workers.model import LlamaFamilyModel


@dataclass
class BuiltModel:
    config: ModelConfig
    model: LlamaFamilyModel
    dtype: torch.dtype
    max_model_len: int


def build_model(model_dir: str | Path, device: torch.device, *, dtype: str | torch.dtype = "auto",
                max_model_len: int | None = None, quantization: str = "auto",
                activation_quant: str = "auto") -> BuiltModel:
    if device.type == "cpu":
        keep_heap_memory()  # no page faults on every layer's activations
    dtype = resolve_dtype(dtype, read_config(model_dir), device)
    if device.type == "cpu":  # compiled side by side while the weights load (a first start only)
        kernels.native.prebuild(kernels.native.runnable(dtype))
    # a GGUF's Q8_0/Q4_0/Q4_1 blocks stay as stored unless every weight is wanted dense
    cfg, weights, dtype = load_checkpoint(model_dir, dtype, device, keep_quantized=quantization != "none")
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:  # no sliding-window attention here: stay where full attention is exact
        limit = min(limit, cfg.sliding_window)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds what the model supports ({limit})")
    max_model_len = max_model_len or limit
    model = LlamaFamilyModel(cfg, weights, max_model_len, device, quantization=quantization, dtype=dtype,
                             activation_quant=activation_quant)
    del weights
    if device.type == "cpu":
        release_free_heap()  # float weights converted at load (quantized) are gone: return their memory
    return BuiltModel(cfg, model, dtype, max_model_len)


def kernel_implementations(model: LlamaFamilyModel, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Which implementation runs each op family `model` uses (attention, layer_ops, and linear and
    quant_linear where it has linears of that kind): triton on CUDA; on CPU what kernels chose so far
    (a runner's warm-up runs every op once); quant_linear's ends in ", int8 activations" where
    --activation-quant int8 is in effect."""
    linears = [model.lm_head] + [lin for layer in model.layers
                                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    quantized = sum(isinstance(lin, QuantizedLinear) for lin in linears)
    used = {"attention": True, "layer_ops": True, "linear": quantized < len(linears), "quant_linear": quantized > 0}
    families = [f for f in kernels.native.FAMILIES if used[f]]
    if device.type == "cuda":
        return {f: "triton" for f in families}
    found = kernels.native.implementations(families, dtype)
    if quantized and model.activation_quant == "int8":  # --activation-quant int8 in effect
        found["quant_linear"] += ", int8 activations"
    return found
