"""LoRA adapters in PEFT's format: what a folder holds, read without torch (the gateway checks a folder before
any worker loads it; workers/lora.py loads the weights).

A folder holds `adapter_config.json` (peft's LoraConfig: `r`, `lora_alpha`, `target_modules`, `use_rslora`)
and `adapter_model.safetensors`. Served: LoRA on the decoder layers' linears (q/k/v/o and gate/up/down
projections), any rank up to --max-lora-rank, rsLoRA's scaling. Refused with a message naming the key: other
target modules (embeddings, lm_head), `modules_to_save`, DoRA, biases, per-module ranks or alphas (peft's
`rank_pattern` / `alpha_pattern`) and layer subsets (`layers_to_transform`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# the decoder layer's linears an adapter may target: attention's projections (the worker's fused qkv and o)
# and the MLP's (fused gate_up, and down)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default


class LoraError(ValueError):
    """A folder that is not a LoRA adapter this server runs; the message says what is wrong."""


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    base_model: str | None = None

    @property
    def scaling(self) -> float:
        """What peft multiplies the low-rank product by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def _unsupported(cfg: dict) -> str | None:
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} (only LORA adapters are served)"
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            return f"{key} {cfg[key]!r}"
    if cfg.get("use_dora"):
        return "use_dora (DoRA)"
    if cfg.get("bias", "none") != "none":
        return f"bias {cfg['bias']!r} (only 'none')"
    return None


def read_adapter_config(path: str, max_rank: int = DEFAULT_MAX_LORA_RANK) -> AdapterConfig:
    """The adapter folder's config, checked: LoraError naming what is missing or not served."""
    if not path or not os.path.isdir(path):
        raise LoraError(f"no adapter folder at {path!r}")
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise LoraError(f"{path!r} has no {WEIGHTS_FILE}")
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"{path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{CONFIG_FILE} in {path!r} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{CONFIG_FILE} in {path!r} is not a JSON object")
    why = _unsupported(cfg)
    if why:
        raise LoraError(f"adapter {path!r}: {why} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"adapter {path!r}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"adapter {path!r}: rank {r} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # peft also takes one name, or a regex; only plain names are served
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise LoraError(f"adapter {path!r}: target_modules must name some of {', '.join(TARGET_MODULES)}")
    other = sorted(set(targets) - set(TARGET_MODULES))
    if other:
        raise LoraError(f"adapter {path!r}: target_modules {other} are not served "
                        f"(served: {', '.join(TARGET_MODULES)})")
    return AdapterConfig(r, float(alpha), tuple(t for t in TARGET_MODULES if t in targets),
                         bool(cfg.get("use_rslora", False)), cfg.get("base_model_name_or_path"))


def parse_lora_module(spec: str) -> tuple[str, str]:
    """One --lora-modules value, vLLM's forms: `name=path`, or JSON {"name": ..., "path": ...}."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            d = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--lora-modules {spec!r}: not JSON: {e}") from None
        name, path = d.get("name"), d.get("path")
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"--lora-modules {spec!r}: expected a non-empty name and path")
    return name.strip(), path.strip()
