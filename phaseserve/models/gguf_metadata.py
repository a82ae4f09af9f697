"""A GGUF file's metadata and tensor list, read once: what the folder writer and the worker's loader share.

No torch here: the gateway imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# ggml types the worker can turn into weights (gguf.quants dequantizes the block types)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(ValueError):
    """The file is not a GGUF this server can run; the message says what was found and what is supported."""


# ----------------------------------------------------------------------------- reading


def _reader(path: Path):
    """gguf.GGUFReader reading through a plain ndarray view of its memory map: slicing an np.memmap
    runs memmap.__array_finalize__ for each of the vocabulary and merge strings, a large share of the
    read for a large vocabulary. The map stays open as the view's base."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def __setattr__(self, name, value):
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)
            super().__setattr__(name, value)

    return Reader(path)


class GGUFMetadata:
    """The metadata and tensor table of one GGUF file (memory-mapped; tensor data is not read)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {path} does not exist")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self.reader = _reader(self.path)
        except Exception as e:  # a truncated or corrupt file fails anywhere inside the reader
            raise GGUFError(f"{path} could not be read as GGUF ({type(e).__name__}: {e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self.get("general.architecture")
        if not isinstance(self.architecture, str):
            raise GGUFError(f"{path} has no general.architecture in its metadata")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, e.g. arch("block_count")."""
        return self.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch(key)
        if value is None:
            raise GGUFError(f"{self.path} has no {self.architecture}.{key} in its metadata")
        return value

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """In torch order (rows first); GGUF stores the fastest-moving dimension first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama/qwen2 GGUF tensor, or None for one the model does not use as a weight."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] not in ("weight", "bias"):
        return None
    leaf = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}.get(parts[2])
    return None if leaf is None else f"model.layers.{parts[1]}.{leaf}.{parts[3]}"


# tensors a converter writes that are not weights: rope_freqs is read into config.json's rope_scaling
NON_WEIGHT_TENSORS = {"rope_freqs.weight"}


def check_tensors(meta: GGUFMetadata) -> None:
    """Every tensor has a name and a type the worker can load; raise GGUFError naming the first that does not."""
    for name, t in meta.tensors.items():
        if name in NON_WEIGHT_TENSORS:
            continue
        if hf_tensor_name(name) is None:
            raise GGUFError(f"{meta.path}: tensor {name!r} is not part of a {meta.architecture} model this server "
                            "runs (expected token_embd, output_norm, output and blk.N.attn_*/ffn_* tensors)")
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"{meta.path}: tensor {name!r} has type {t.tensor_type.name}; supported tensor types: "
                            f"{', '.join(SUPPORTED_TENSOR_TYPES)}")
