"""LoRA adapters on a worker: loaded on demand from their folders, a bounded number kept (least recently used
evicted), and a step's rows grouped by adapter for kernels.lora_add.

An adapter's weights are laid out once, at load, per decoder layer and per fused linear of the model (qkv,
o, gate_up, down), in the model's dtype: A [M * r, in], the A matrices of the linear's M modules (qkv: 3)
stacked, and B [r, out], their B matrices transposed side by side in the linear's output columns (each module
expands into its own columns only: no zero blocks), with the scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA) folded into B; a module the adapter does not target has zero rows of A (and zero columns of B), and a
linear none of whose modules it targets has no matrices (None) and is skipped. kernels.lora_add computes each
row alone in float32 and rounds the sum once to the model's dtype, so a row's bits never depend on which
adapters or rows share its step (one numerics, docs/lora.md).
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from phaseserve import kernels
from phaseserve.lora import TARGET_MODULES, WEIGHTS_FILE, LoraError, read_adapter_config
from phaseserve.wire import LoraRef
from phaseserve.workers.loader import ModelConfig

log = structlog.get_logger(__name__)

# the modules of each fused linear, in the order of its output columns
MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
           "down": ("down_proj",)}
_PREFIX = "base_model.model.model.layers."  # peft's names: <prefix><layer>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every module an adapter may target."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def module_columns(cfg: ModelConfig) -> dict[str, list[int]]:
    """Per fused linear, the bounds of its modules' output columns (M + 1 of them: lora_add's `cols`)."""
    shapes = module_shapes(cfg)
    return {linear: [0, *itertools.accumulate(shapes[m][1] for m in modules)] for linear, modules in MODULES.items()}


@dataclass
class Adapter:
    """One loaded adapter: per layer, per fused linear, (A [M * r, in], B [r, out]), or None where the adapter
    targets none of the linear's modules."""

    ref: LoraRef
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor] | None]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for ab in layer.values() if ab for a, b in [ab])


def load_adapter(ref: LoraRef, cfg: ModelConfig, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> Adapter:
    """The adapter's weights in the layout above, in `dtype` (the model's); LoraError naming what does not
    fit the model."""
    from safetensors import safe_open

    acfg = read_adapter_config(ref.path, max_rank)
    shapes = module_shapes(cfg)
    scale, r = acfg.scaling, acfg.r
    layers = []
    try:
        f = safe_open(os.path.join(ref.path, WEIGHTS_FILE), framework="pt", device="cpu")
    except Exception as e:  # a truncated or foreign file: safetensors' own message says which
        raise LoraError(f"adapter {ref.path!r}: {WEIGHTS_FILE} is not readable: {e}") from None
    with f:
        names = set(f.keys())
        unknown = sorted(n for n in names if not n.startswith(_PREFIX))
        if unknown:
            raise LoraError(f"adapter {ref.path!r}: weights outside the decoder layers: {unknown[:3]}")
        for i in range(cfg.num_layers):
            layer: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
            for linear, modules in MODULES.items():
                n_in = shapes[modules[0]][0]
                outs = [shapes[m][1] for m in modules]
                a = torch.zeros(r * len(modules), n_in, dtype=torch.float32)
                b = torch.zeros(r, sum(outs), dtype=torch.float32)
                col, targeted = 0, False
                for j, m in enumerate(modules):
                    name = f"{_PREFIX}{i}.{_BLOCK[m]}.{m}"
                    if m in acfg.target_modules and f"{name}.lora_A.weight" in names:
                        wa, wb = f.get_tensor(f"{name}.lora_A.weight"), f.get_tensor(f"{name}.lora_B.weight")
                        if tuple(wa.shape) != (r, n_in) or tuple(wb.shape) != (outs[j], r):
                            raise LoraError(f"adapter {ref.path!r}: {name} has A {tuple(wa.shape)} and B "
                                            f"{tuple(wb.shape)}, the model needs ({r}, {n_in}) and "
                                            f"({outs[j]}, {r}): an adapter of another base model?")
                        a[j * r:(j + 1) * r] = wa.float()
                        b[:, col:col + outs[j]] = wb.float().T * scale
                        targeted = True
                    col += outs[j]
                layer[linear] = (a.to(device, dtype), b.to(device, dtype)) if targeted else None
            layers.append(layer)
        expected = {f"{_PREFIX}{i}.{_BLOCK[m]}.{m}.lora_{ab}.weight" for i in range(cfg.num_layers)
                    for m in acfg.target_modules for ab in "AB"}
        extra = sorted(names - expected)
        if extra:
            raise LoraError(f"adapter {ref.path!r}: weights the model has no place for: {extra[:3]}")
        if not names:
            raise LoraError(f"adapter {ref.path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return Adapter(ref, layers)


class LoadedAdapters:
    """The adapters a worker holds: at most `max_loras`, the least recently used evicted first, but never one
    the current step uses (a step with more distinct adapters than that holds them all until it is done)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.cfg, self.max_loras, self.max_rank, self.device, self.dtype = cfg, max_loras, max_rank, device, dtype
        self.columns = module_columns(cfg)
        self._held: OrderedDict[str, Adapter] = OrderedDict()  # key -> adapter, least recently used first
        self.num_loads = 0
        self.num_evictions = 0

    def keys(self) -> list[str]:
        """The keys held, least recently used first (WorkerInfo.loras)."""
        return list(self._held)

    def held(self, key: str) -> Adapter:
        """A held adapter by its key (KeyError when it is not held)."""
        return self._held[key]

    def get(self, ref: LoraRef) -> Adapter:
        """The adapter, loaded now if it is not held (LoraError when it cannot be), marked most recently used."""
        adapter = self._held.get(ref.key)
        if adapter is not None:
            self._held.move_to_end(ref.key)
            return adapter
        adapter = load_adapter(ref, self.cfg, self.max_rank, self.device, self.dtype)
        self._held[ref.key] = adapter
        self.num_loads += 1
        log.info("LoRA adapter loaded", name=ref.name, path=ref.path, bytes=adapter.nbytes(), held=len(self._held))
        return adapter

    def evict_beyond_limit(self, in_use: set[str]) -> None:
        """Drop the least recently used adapters past max_loras, sparing those in `in_use`."""
        for key in list(self._held):
            if len(self._held) <= self.max_loras:
                break
            if key not in in_use:
                ref = self._held.pop(key).ref
                self.num_evictions += 1
                log.info("LoRA adapter evicted", name=ref.name, path=ref.path)


class LoraStep:
    """A step's LoRA rows by adapter: built once a step, read by every layer. Rows of the base model are in no
    group. Each linear adds every adapter's products to its rows in one kernels.lora_add."""

    def __init__(self, rows_by_adapter: list[tuple[Adapter, list[int]]], device: torch.device,
                 columns: dict[str, list[int]], dtype: torch.dtype):
        self.adapters = [adapter for adapter, _ in rows_by_adapter]
        self.rows = torch.tensor([row for _, rows in rows_by_adapter for row in rows], dtype=torch.int64,
                                 device=device)
        self.ends = list(itertools.accumulate(len(rows) for _, rows in rows_by_adapter))
        self.columns = columns
        self._none = (torch.empty(0, 0, dtype=dtype, device=device),) * 2  # a linear the adapter leaves alone

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, linear: str) -> torch.Tensor:
        """y (the linear's output for the packed rows x) plus each LoRA row's low-rank product."""
        pairs = [adapter.layers[layer][linear] or self._none for adapter in self.adapters]
        return kernels.lora_add(y, x, self.rows, self.ends, [a for a, _ in pairs], [b for _, b in pairs],
                                self.columns[linear])


assert set(TARGET_MODULES) == {m for ms in MODULES.values() for m in ms}
