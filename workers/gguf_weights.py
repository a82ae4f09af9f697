"""The tensors of a GGUF file as the Hugging Face weights workers/model.py expects.

Plain types (F32, F16, BF16) are cast to the model's dtype; block-quantized ones
are dequantized by `gguf.quants.dequantize` (exact, in fp32, then cast), or, with
`keep_quantized=True`, the Q8_0 / Q4_0 / Q4_1 matrices stay as their raw GGUF
blocks in a `QuantizedTensor` for int8/int4 matmul kernels.

llama.cpp's converter reorders the rows of every Llama Q and K projection (its
rotary layout pairs neighbouring dimensions; transformers' pairs the two
halves of each head); `unpermute_rows` undoes that, on values or on raw blocks
alike, since it moves whole rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from tqdm import tqdm

from phaseserve.models.gguf_metadata import NON_WEIGHT_TENSORS, GGUFMetadata, check_tensors, hf_tensor_name

log = structlog.get_logger(__name__)

KEEPABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # what keep_quantized leaves as raw blocks
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16}


@dataclass
class QuantizedTensor:   # a GGUF block-quantized 2-D weight, rows = output features
    ggml_type: str          # "Q8_0" | "Q4_0" | "Q4_1"
    raw: torch.Tensor       # uint8 [out_features, bytes_per_row], the GGUF blocks exactly as stored
    shape: tuple[int, int]  # (out_features, in_features)

    def dequantize(self, dtype) -> torch.Tensor:  # via gguf.quants.dequantize, exact
        values = gguf_dequantize(self.raw.cpu().numpy(), GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(values).reshape(self.shape).to(device=self.raw.device, dtype=dtype)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` on dim 0 (transformers' reverse_permute_weights)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _values(tensor, ggml_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor as a float numpy array in torch order (a fresh copy, never the read-only map)."""
    data = tensor.data
    if ggml_type in _PLAIN_TYPES:
        return np.array(data, dtype=_PLAIN_TYPES[ggml_type]).reshape(shape)
    return gguf_dequantize(np.asarray(data), tensor.tensor_type).reshape(shape)  # BF16 and blocks -> fp32


def load_gguf_weights(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                      keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Every weight of a llama/qwen2 GGUF by its Hugging Face name (lm_head.weight only when not tied)."""
    meta = GGUFMetadata(path)
    check_tensors(meta)
    num_heads = int(meta.require("attention.head_count"))
    num_kv_heads = int(meta.arch("attention.head_count_kv", num_heads))
    # Only llama.cpp's "llama" converter permutes (qwen2 uses NeoX-style rotary, stored as in HF)
    heads_to_unpermute = {"attn_q": num_heads, "attn_k": num_kv_heads} if meta.architecture == "llama" else {}

    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    types: Counter[str] = Counter()
    kept = 0
    total = sum(int(t.n_bytes) for t in meta.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading GGUF weights",
              disable=total < 256 << 20) as bar:
        for name, t in meta.tensors.items():
            bar.update(int(t.n_bytes))
            if name in NON_WEIGHT_TENSORS:
                continue
            ggml_type = t.tensor_type.name
            types[ggml_type] += 1
            shape = meta.tensor_shape(name)
            n_head = heads_to_unpermute.get(name.split(".")[2]) if name.startswith("blk.") else None
            if keep_quantized and ggml_type in KEEPABLE_TYPES and len(shape) == 2:
                raw = np.array(t.data, dtype=np.uint8)  # [rows, bytes_per_row]
                if n_head is not None:
                    raw = np.ascontiguousarray(unpermute_rows(raw, n_head))
                weights[hf_tensor_name(name)] = QuantizedTensor(ggml_type, torch.from_numpy(raw).to(device),
                                                                (shape[0], shape[1]))
                kept += 1
                continue
            values = _values(t, ggml_type, shape)
            if n_head is not None:
                values = unpermute_rows(values, n_head)
            weights[hf_tensor_name(name)] = torch.from_numpy(np.ascontiguousarray(values)).to(
                device=device, dtype=dtype)
    log.info("gguf weights loaded", path=str(meta.path), arch=meta.architecture, tensors=len(weights),
             types=dict(sorted(types.items())), kept_quantized=kept, dtype=str(dtype))
    return weights
