"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf(path, model_dir, types=...)` converts a tests/model_factory.py checkpoint:
llama.cpp's tensor names, Q/K rows permuted into llama.cpp's rotary layout, each
2-D weight stored as the ggml type `types` gives it (quantized with
gguf.quants.quantize), the hyperparameters and the tokenizer as GGUF metadata.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.torch import load_file

# HF name piece -> llama.cpp's
_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *leaf, suffix = hf_name.split(".")
    return f"blk.{layer}.{_LEAVES['.'.join(leaf)]}.{suffix}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half rows -> llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(tokenizer_json: dict) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a tokenizers byte-level BPE file, as llama.cpp stores them."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    special = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    user_defined = {t["content"] for t in tokenizer_json["added_tokens"] if not t["special"]}
    for t in tokenizer_json["added_tokens"]:
        vocab[t["content"]] = t["id"]
    by_id = {i: tok for tok, i in vocab.items()}
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        tok = by_id.get(i, f"[PAD{i}]")
        tokens.append(tok)
        types.append(TokenType.CONTROL if tok in special else TokenType.USER_DEFINED if tok in user_defined
                     else TokenType.UNUSED if i not in by_id else TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return tokens, [int(t) for t in types], merges


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3 scaling as rope_freqs.weight."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# where the fp16 scales sit in a block (gguf-py cannot quantize k-quants; random blocks need sane scales)
_K_QUANT_SCALES = {"Q4_K": ((0, 0.01), (2, 0.002)), "Q6_K": ((208, 0.001),)}


def random_k_quant_blocks(shape: tuple[int, int], ggml_type: str, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q6_K blocks for a [rows, cols] weight: uint8 [rows, bytes_per_row]."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = np.random.default_rng(seed).integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    for offset, scale in _K_QUANT_SCALES[ggml_type]:
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(shape[0], shape[1] // block * size)


def write_gguf(path: Path, model_dir: Path, types: str | Callable[[str], str] = "F32", arch: str = "llama",
               tokenizer_json: dict | None = None, pre: str = "gpt2", metadata: dict | None = None,
               chat_template: str | None = None, add_bos: bool | None = False, tokenizer_model: str = "gpt2",
               sentencepiece: tuple[list[str], list[int], list[float]] | None = None) -> Path:
    """`types`: one ggml type name for every 2-D weight, or a function of the GGUF tensor name.
    `sentencepiece`: (tokens, token types, scores) of a "llama" vocabulary, instead of the byte-level one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    tok = tokenizer_json or json.loads((model_dir / "tokenizer.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    w = GGUFWriter(str(path), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(0)

    if sentencepiece is not None:
        tokens, token_types, scores = sentencepiece
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_scores(scores)
    else:
        tokens, token_types, merges = byte_level_vocab(tok)
        w.add_tokenizer_model(tokenizer_model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
    for key, value in (("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>")):
        if value in tokens:
            getattr(w, f"add_{key}_token_id")(tokens.index(value))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)

    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":  # llama.cpp writes it as a tensor, not as metadata
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling["rope_theta"], head_dim, scaling))

    for hf, value in weights.items():
        name = gguf_name(hf)
        value = value.astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            value = permute(value, n_head, n_head)
        elif arch == "llama" and ".attn_k." in name:
            value = permute(value, n_head, n_kv)
        ggml_type = (types(name) if callable(types) else types) if value.ndim == 2 else "F32"
        qtype = GGMLQuantizationType[ggml_type]
        if ggml_type == "F32":
            w.add_tensor(name, value)
        elif ggml_type in ("F16", "F64"):  # F64: a type the loader rejects
            w.add_tensor(name, value.astype(np.float16 if ggml_type == "F16" else np.float64))
        elif ggml_type in _K_QUANT_SCALES:
            w.add_tensor(name, random_k_quant_blocks(value.shape, ggml_type, len(name)), raw_dtype=qtype)
        else:
            w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
