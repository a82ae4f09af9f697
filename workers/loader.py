"""Load a local Hugging Face checkpoint folder: config, generation config and safetensors weights
(or, for a folder made from a GGUF by phaseserve.models.gguf_files, the GGUF's tensors).

Returns a `ModelConfig` (the few numbers the model needs, normalized across
architectures and transformers versions) and the raw weights by their HF names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from phaseserve.kernels import cpu_isa
from phaseserve.models.gguf_files import GGUFError, gguf_weights_path
from phaseserve.models.model_files import config_eos_token_ids

log = structlog.get_logger(__name__)

# architecture -> (whether q/k/v carry a bias by design)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The folder is not a checkpoint this loader can run; the message says why."""


@dataclass
class ModelConfig:
    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear"|"llama3", ...} or None
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    checkpoint_dtype: str
    raw: dict = field(repr=False, default_factory=dict)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either the transformers 4.x keys (rope_theta + rope_scaling)
    or the 5.x `rope_parameters` dict."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return theta, params


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (expected a Hugging Face checkpoint folder)")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {cfg_path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta, scaling = _rope(cfg)
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")

    try:
        eos = config_eos_token_ids(model_dir)
    except ValueError as e:  # a generation_config.json that is not JSON
        raise ModelLoadError(str(e)) from e

    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=arch,
        name=model_dir.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        sliding_window=sliding,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        raw=cfg,
    )


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: str | torch.device) -> torch.dtype:
    """The activations' dtype. "auto" follows what the hardware computes natively: the checkpoint's dtype on
    CUDA and on a CPU with AVX512-BF16 (fp16 there turned into bf16, a slow software path on CPU); float32 on
    any other CPU, whatever the checkpoint's dtype (bf16 arithmetic is emulated there, far slower than fp32;
    bf16/fp16 weights are converted on load)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = cfg.checkpoint_dtype if dtype == "auto" else dtype
        name = name.removeprefix("torch.")
        if name not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported (auto, float32, bfloat16, float16)")
        resolved = _DTYPES[name]
        if dtype == "auto" and torch.device(device).type == "cpu" and not cpu_isa.supports("avx512-bf16"):
            resolved = torch.float32
    if resolved == torch.float16 and torch.device(device).type == "cpu":
        resolved = torch.bfloat16
    return resolved


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def load_weights(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                 keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, cast to `dtype`, keyed by their HF names.

    `keep_quantized` only matters for a GGUF folder: its Q8_0/Q4_0/Q4_1 matrices then stay as
    `workers.gguf_weights.QuantizedTensor` blocks instead of being dequantized."""
    model_dir = Path(model_dir)
    try:
        gguf_file = gguf_weights_path(model_dir)
        if gguf_file is not None and not (model_dir / "model.safetensors").is_file() \
                and not (model_dir / "model.safetensors.index.json").is_file():
            from phaseserve.workers.gguf_weights import load_gguf_weights  # gguf's numpy dequantizers only when needed

            return load_gguf_weights(gguf_file, dtype, device, keep_quantized=keep_quantized)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    files = _weight_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    total = sum(f.stat().st_size for f in files)
    # a progress bar only where loading takes a while
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < 512 << 20) as bar:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    weights[name] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
            bar.update(f.stat().st_size)
    return weights


def load_checkpoint(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    keep_quantized: bool = False,
) -> tuple[ModelConfig, dict[str, torch.Tensor], torch.dtype]:
    cfg = read_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    weights = load_weights(model_dir, torch_dtype, device, keep_quantized=keep_quantized)
    log.info("checkpoint loaded", model=cfg.name, arch=cfg.architecture, dtype=str(torch_dtype),
             tensors=len(weights))
    return cfg, weights, torch_dtype
