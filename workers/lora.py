"""LoRA adapters on a worker: loaded on demand from their folders, a bounded number kept (least recently used
evicted), and a step's rows grouped by adapter for kernels.lora_add.

An adapter's weights are laid out once, at load, per decoder layer and per fused linear of the model (qkv,
o, gate_up, down): A [in, R] and B [R, out] with R = --max-lora-rank times the linear's modules (qkv: 3),
each module's rank padded with zeros to --max-lora-rank and the modules it does not target left zero, and
the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded into B; float32 (kernels.lora_add computes in
float32 and rounds the sum once to the model's dtype). Every adapter's matrices then have
the same shapes, so the op's shapes never depend on which adapters share a step (one numerics,
docs/lora.md).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

import kernels
from phaseserve.lora import TARGET_MODULES, WEIGHTS_FILE, LoraError, read_adapter_config
from phaseserve.wire import LoraRef
from workers.loader import ModelConfig

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


@dataclass
class Adapter:
    """One loaded adapter: per layer, per fused linear, (A [in, R], B [R, out])."""

    ref: LoraRef
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def load_adapter(ref: LoraRef, cfg: ModelConfig, max_rank: int, device: torch.device) -> Adapter:
    """The adapter's weights in the layout above; LoraError naming what does not fit the model."""
    from safetensors import safe_open

    acfg = read_adapter_config(ref.path, max_rank)
    shapes = module_shapes(cfg)
    scale = acfg.scaling
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
            layer = {}
            for linear, modules in MODULES.items():
                n_in = shapes[modules[0]][0]
                outs = [shapes[m][1] for m in modules]
                a = torch.zeros(n_in, max_rank * len(modules), dtype=torch.float32)
                b = torch.zeros(max_rank * len(modules), sum(outs), dtype=torch.float32)
                col = 0
                for j, m in enumerate(modules):
                    name = f"{_PREFIX}{i}.{_BLOCK[m]}.{m}"
                    if m in acfg.target_modules and f"{name}.lora_A.weight" in names:
                        wa, wb = f.get_tensor(f"{name}.lora_A.weight"), f.get_tensor(f"{name}.lora_B.weight")
                        if tuple(wa.shape) != (acfg.r, n_in) or tuple(wb.shape) != (outs[j], acfg.r):
                            raise LoraError(f"adapter {ref.path!r}: {name} has A {tuple(wa.shape)} and B "
                                            f"{tuple(wb.shape)}, the model needs ({acfg.r}, {n_in}) and "
                                            f"({outs[j]}, {acfg.r}): an adapter of another base model?")
                        rows = slice(j * max_rank, j * max_rank + acfg.r)
                        a[:, rows] = wa.float().T
                        b[rows, col:col + outs[j]] = wb.float().T * scale
                    col += outs[j]
                layer[linear] = (a.to(device), b.to(device))  # float32 whatever the model's dtype: lora_add's
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

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, device: torch.device):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.cfg, self.max_loras, self.max_rank, self.device = cfg, max_loras, max_rank, device
        self._held: OrderedDict[str, Adapter] = OrderedDict()  # key -> adapter, least recently used first
        self.stacked = StackedAdapters()
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
        adapter = load_adapter(ref, self.cfg, self.max_rank, self.device)
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
                self.stacked.clear()
                self.num_evictions += 1
                log.info("LoRA adapter evicted", name=ref.name, path=ref.path)


class LoraStep:
    """A step's LoRA rows, grouped by adapter in tiles of kernels.LORA_TILE_ROWS: built once a step, read by
    every layer. Rows of the base model are in no tile.

    The adapters with a single tile (a few decodes each: the common case) come first and run as one batched
    matmul over their matrices stacked (`stacked`: per layer and linear, reused while the next steps have the
    same adapters); an adapter with several tiles (a prefill chunk) runs its own, its matrices expanded over
    its tiles, not copied. Every tile is a matrix of the same shape either way."""

    def __init__(self, rows_by_adapter: list[tuple[Adapter, list[int]]], device: torch.device,
                 stacked: StackedAdapters):
        tile = kernels.LORA_TILE_ROWS
        rows: list[int] = []  # the packed row of every tile slot (a slot past a group's rows repeats its first)
        keep: list[int] = []  # the tile slots holding a real row, and that row
        dest: list[int] = []
        ordered = sorted(rows_by_adapter, key=lambda g: (len(g[1]) > tile, g[0].ref.key))  # one-tile groups first
        self.singles = [adapter for adapter, group in ordered if len(group) <= tile]
        self.multis: list[tuple[int, int, Adapter]] = []  # (first tile, end tile, adapter)
        for adapter, group in ordered:
            first = len(rows) // tile
            for t in range(0, len(group), tile):
                part = group[t:t + tile]
                keep += range(len(rows), len(rows) + len(part))
                dest += part
                rows += part + [part[0]] * (tile - len(part))
            if len(group) > tile:
                self.multis.append((first, len(rows) // tile, adapter))
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.keep = torch.tensor(keep, dtype=torch.int64, device=device)
        self.dest = torch.tensor(dest, dtype=torch.int64, device=device)
        self.stacked = stacked.of([a.ref.key for a in self.singles]) if len(self.singles) > 1 else None

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, linear: str) -> torch.Tensor:
        """y (the linear's output for the packed rows x) plus each LoRA row's low-rank product."""
        groups = [(start, end, *adapter.layers[layer][linear]) for start, end, adapter in self.multis]
        if self.stacked is not None:
            w = self.stacked.get((layer, linear))
            if w is None:
                pairs = [a.layers[layer][linear] for a in self.singles]
                w = self.stacked[(layer, linear)] = (torch.stack([a for a, _ in pairs]),
                                                     torch.stack([b for _, b in pairs]))
            groups.insert(0, (0, len(self.singles), *w))
        elif self.singles:
            groups.insert(0, (0, 1, *self.singles[0].layers[layer][linear]))
        return kernels.lora_add(y, x, self.rows, self.keep, self.dest, groups)


class StackedAdapters:
    """The matrices of the one-tile adapters of the last steps, stacked per layer and linear: decode steps
    keep the same adapters for many steps, and stacking them anew each step would copy them all."""

    def __init__(self) -> None:
        self._keys: list[str] | None = None
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, keys: list[str]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The stacks of these adapters in this order (empty when they differ from the last ones: filled as the
        layers ask)."""
        if keys != self._keys:
            self._keys, self._stacks = keys, {}
        return self._stacks

    def clear(self) -> None:
        self._keys, self._stacks = None, {}


assert set(TARGET_MODULES) == {m for ms in MODULES.values() for m in ms}
