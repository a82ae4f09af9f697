"""A GGUF file (llama.cpp's format) as a Hugging Face model folder, weights left in the GGUF.

`write_model_folder(gguf_path, folder)` reads the GGUF's metadata once and writes
config.json, tokenizer.json, tokenizer_config.json and generation_config.json,
plus a `weights.gguf` symlink to the GGUF itself, so that the gateway's
`Tokenizer` and the worker's loader read the folder like any other checkpoint
(the worker loads the tensors through workers/gguf_weights.py).

The tokenizer is rebuilt from `tokenizer.ggml.*` the way llama.cpp tokenizes:
byte-level BPE ("gpt2") with the pre-tokenizer regexes llama.cpp picks for
`tokenizer.ggml.pre`, or SentencePiece-style BPE with byte fallback ("llama").
No torch here: the gateway imports this module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from phaseserve.models.tokenizer import gpt2_bytes_to_unicode

log = structlog.get_logger(__name__)

# GGUF `general.architecture` -> transformers architecture the worker runs
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# ggml types the worker can turn into weights (gguf.quants dequantizes the block types)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TOKENIZER_MODELS = ("gpt2", "llama")
WEIGHTS_LINK = "weights.gguf"
WEIGHTS_POINTER = "gguf.json"  # {"path": ...}, written where a symlink cannot be
SOURCE_FILE = "gguf_source.json"  # which GGUF (path, size, mtime) the folder was made from
_FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", SOURCE_FILE)

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, as llama.cpp's llama-vocab.cpp applies them for each `tokenizer.ggml.pre`:
# each regex splits the pieces the previous one left ("isolated"), then the bytes are mapped to
# GPT-2's alphabet. `None` stands for GPT-2's own regex (tokenizers' ByteLevel(use_regex=True)).
_GPT2 = None
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, tuple[str | None, ...]] = {
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: what a file without `tokenizer.ggml.pre` gets
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **{name: (_GPT2,) for name in ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de",
                                   "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de", "roberta-bpe")},
    **{name: (r"\p{N}", _GPT2) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                            "exaone", "minerva-7b")},
    **{name: (_LLAMA3,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2,) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan")},
}
# llama.cpp matches whole words against the vocabulary before merging for these (BPE ignore_merges)
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}


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


# ----------------------------------------------------------------------------- config.json


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                              original_len: int) -> dict | None:
    """llama.cpp stores Llama 3 rope scaling as a per-frequency divisor tensor (rope_freqs), not as
    parameters. Recover transformers' llama3 parameters from it: the divisors are 1 for short
    wavelengths, `factor` for long ones, and 1/((1-s)/factor + s) between, with s linear in
    1/wavelength; only that line matters, so original_len is free and the rest is fitted."""
    factors = np.asarray(factors, dtype=np.float64)
    if np.allclose(factors, 1.0):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(factors) != len(inv_freq):
        raise GGUFError(f"rope_freqs has {len(factors)} entries; expected head_dim/2 = {len(inv_freq)}")
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    tol = 1e-4 * factor
    medium = (factors > 1 + tol) & (factors < factor - tol)
    if medium.sum() >= 2:
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[medium], s, 1)  # s = a / wavelen + b
        low = -b * original_len / a
        high = low + original_len / a
    else:  # no ramp in between: put its ends just outside the two plateaus
        high_wavelen = wavelen[factors <= 1 + tol].max() * 1.0001
        low_wavelen = wavelen[factors >= factor - tol].min() * 0.9999
        low, high = original_len / low_wavelen, original_len / high_wavelen
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
              "high_freq_factor": float(high), "original_max_position_embeddings": original_len}
    # the fitted parameters must give back the file's divisors (as workers/model.py computes them)
    low_wl, high_wl = original_len / low, original_len / high
    smooth = (original_len / wavelen - low) / (high - low)
    divisor = np.where(wavelen < high_wl, 1.0,
                       np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(divisor, factors, rtol=1e-3):
        raise GGUFError("rope_freqs does not follow Llama 3 rope scaling (the only per-frequency scaling supported)")
    return params


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def build_config(meta: GGUFMetadata, name: str) -> dict:
    arch = meta.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{meta.path}: architecture {arch!r} is not supported; supported GGUF architectures: "
                        f"{', '.join(ARCHITECTURES)}")
    if "token_embd.weight" not in meta.tensors:
        raise GGUFError(f"{meta.path} has no token_embd.weight tensor")
    vocab_size, hidden = meta.tensor_shape("token_embd.weight")
    num_heads = int(meta.require("attention.head_count"))
    num_kv_heads = meta.arch("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts (hybrid models)
        if len(set(num_kv_heads)) != 1:
            raise GGUFError(f"{meta.path}: per-layer KV head counts {sorted(set(num_kv_heads))} are not supported")
        num_kv_heads = num_kv_heads[0]
    rope_dim = meta.arch("rope.dimension_count")
    head_dim = int(meta.arch("attention.key_length") or rope_dim or hidden // num_heads)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise GGUFError(f"{meta.path}: rotary dimension {rope_dim} != head dim {head_dim} "
                        "(partial rotary embeddings are not supported)")
    theta = _f32(meta.arch("rope.freq_base", 10000.0))
    context = int(meta.arch("context_length", 2048))

    rope_scaling = None
    scaling_type = meta.arch("rope.scaling.type")
    factor = meta.arch("rope.scaling.factor") or meta.arch("rope.scale_linear")
    if scaling_type in (None, "linear") and factor and float(factor) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": _f32(factor)}
    elif scaling_type not in (None, "none", "linear"):
        raise GGUFError(f"{meta.path}: rope scaling {scaling_type!r} is not supported (supported: linear, "
                        "and Llama 3 scaling given as a rope_freqs tensor)")
    if "rope_freqs.weight" in meta.tensors:
        if rope_scaling is not None:
            raise GGUFError(f"{meta.path} has both rope_freqs and {rope_scaling['rope_type']} rope scaling")
        original = int(meta.arch("rope.scaling.original_context_length") or 8192)
        factors = np.asarray(meta.tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        rope_scaling = llama3_rope_from_factors(factors, theta, head_dim, original)

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "_name_or_path": name,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden),
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in meta.tensors,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


# ----------------------------------------------------------------------------- tokenizer.json


def _added_token(content: str, token_id: int, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
                    add_bos: bool, add_eos: bool) -> dict | None:
    """BOS/EOS added by `tokenizers` itself (so a plain Tokenizer.encode matches llama.cpp's add_special)."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return None
    pre = [{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []
    post = [{"SpecialToken": {"id": eos, "type_id": 0}}] if add_eos else []

    def seq(type_id):
        return {"Sequence": {"id": "A" if type_id == 0 else "B", "type_id": type_id}}

    special = {}
    if add_bos:
        special[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
    if add_eos:
        special[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    return {"type": "TemplateProcessing", "single": pre + [seq(0)] + post,
            "pair": pre + [seq(0)] + post + pre + [seq(1)] + post, "special_tokens": special}


def _byte_level_tokenizer(tokens: list[str], types: list[int], merges: list[str], pre: str) -> dict:
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; supported: "
                        f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    spelling = gpt2_bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    added = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (_CONTROL, _USER_DEFINED):
            # matched whole in the text, as llama.cpp does with parse_special; stored as plain text
            added.append(_added_token(tok, i, special=kind == _CONTROL))
        elif not set(tok) <= alphabet:  # a normal token stored as text: spell it in the byte alphabet
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[tok] = i  # a duplicated spelling keeps the last id, as llama.cpp's token_to_id does
    splits = []
    for regex in _PRE_TOKENIZERS[pre]:
        if regex is _GPT2:
            splits.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})
        else:
            splits.append({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False})
    if all(s["type"] != "ByteLevel" for s in splits):
        splits.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
    return {
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": splits[0] if len(splits) == 1 else {"type": "Sequence", "pretokenizers": splits},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre in _IGNORE_MERGES, "vocab": vocab,
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def _sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[list[str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging: every split of a token into two
    vocabulary pieces, best-scoring merged token first (transformers' generate_merges)."""
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _sentencepiece_tokenizer(tokens: list[str], types: list[int], scores: list[float] | None,
                             add_space_prefix: bool, unk: str | None) -> dict:
    if scores is None:
        raise GGUFError("a SentencePiece (tokenizer.ggml.model='llama') vocabulary needs tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    score_of = {tok: float(s) for tok, s in zip(tokens, scores)}
    added = [_added_token(tok, i, special=kind == _CONTROL)
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (_CONTROL, _USER_DEFINED)]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first" if add_space_prefix else "never", "split": False},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": _sentencepiece_merges(vocab, score_of)},
    }


def _token(tokens: list[str], token_id: Any) -> str | None:
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def build_tokenizer_files(meta: GGUFMetadata) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents."""
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"{meta.path}: tokenizer model tokenizer.ggml.model={model!r} is not supported; "
                        f"supported: {', '.join(TOKENIZER_MODELS)} (byte-level BPE, SentencePiece)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{meta.path} has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre") or "default"
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    text = {name: _token(tokens, i) for name, i in ids.items()}
    if model == "gpt2":
        tok = _byte_level_tokenizer(tokens, types, meta.get("tokenizer.ggml.merges") or [], pre)
        # llama.cpp's default when the file does not say: BOS for the Llama 3 family only
        default_add_bos = pre in _IGNORE_MERGES
    else:
        tok = _sentencepiece_tokenizer(tokens, types, meta.get("tokenizer.ggml.scores"),
                                       bool(meta.get("tokenizer.ggml.add_space_prefix", True)), text["unk"])
        default_add_bos = True
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer_json = {"version": "1.0", "truncation": None, "padding": None, **tok,
                      "post_processor": _post_processor(text["bos"], ids["bos"], text["eos"], ids["eos"],
                                                        add_bos, add_eos)}
    # the post-processor after the model keys reads like transformers' files; order does not matter
    tokenizer_config: dict[str, Any] = {f"{name}_token": text[name] for name in ("bos", "eos", "unk", "pad")
                                        if text[name] is not None}
    tokenizer_config.update(add_bos_token=add_bos, add_eos_token=add_eos, tokenizer_class="PreTrainedTokenizerFast",
                            model_max_length=int(meta.arch("context_length", 2048)))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tokenizer_config["chat_template"] = template
    return tokenizer_json, tokenizer_config


# tokens llama.cpp ends generation on wherever a vocabulary has them (llama-vocab.cpp's EOG list)
_END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                      "<EOT>", "<|end_of_text|>")


def stop_token_ids(meta: GGUFMetadata) -> list[int]:
    """EOS, end-of-turn and end-of-message ids, and the end-of-generation tokens llama.cpp stops on."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    index = {tok: i for i, tok in enumerate(tokens) if tok in _END_OF_GENERATION}
    ids += sorted(i for i in index.values() if i not in ids)
    return ids


# ----------------------------------------------------------------------------- the folder


def source_stamp(gguf_path: Path) -> dict:
    """What identifies a GGUF's version: path, size and mtime in whole seconds. Not nanoseconds: a file
    copied into an image layer (a tar entry, whole seconds) comes out with its fraction gone, and the folder
    made from it at build time would never be recognised in a container."""
    st = gguf_path.stat()
    return {"path": str(gguf_path), "size": st.st_size, "mtime_s": int(st.st_mtime)}


def gguf_weights_path(folder: str | Path) -> Path | None:
    """The GGUF holding a folder's weights (its weights.gguf link or gguf.json pointer), or None."""
    folder = Path(folder)
    link = folder / WEIGHTS_LINK
    if link.is_symlink() or link.is_file():  # a dangling link is reported by the reader, naming the file
        return link.resolve()
    pointer = folder / WEIGHTS_POINTER
    if pointer.is_file():
        try:
            return Path(json.loads(pointer.read_text())["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise GGUFError(f"{pointer} should be {{\"path\": <GGUF file>}}: {e!r}") from e
    return None


def _is_complete(folder: Path, stamp: dict) -> bool:
    if not all((folder / f).is_file() for f in _FOLDER_FILES) or gguf_weights_path(folder) is None:
        return False
    try:
        return json.loads((folder / SOURCE_FILE).read_text()) == stamp
    except (ValueError, OSError):
        return False


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_folder(gguf_path: str | Path, folder: str | Path, name: str | None = None) -> Path:
    """Turn a GGUF into a model folder (config, tokenizer, generation config, link to the weights).

    Built in a temporary folder beside `folder` and renamed into place, so a reader never sees
    half a folder. A complete folder already made from this same file (path, size, mtime) is
    returned as it is; one made from an older version of the file is replaced.
    """
    gguf_path = Path(gguf_path).resolve()
    folder = Path(folder).absolute()
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {gguf_path} does not exist")
    stamp = source_stamp(gguf_path)
    if _is_complete(folder, stamp):
        return folder
    if folder.exists() and not (folder / SOURCE_FILE).is_file():
        raise GGUFError(f"{folder} exists and is not a model folder made from a GGUF; choose another folder")

    meta = GGUFMetadata(gguf_path)
    name = name or gguf_path.stem
    config = build_config(meta, name)
    check_tensors(meta)
    tokenizer_json, tokenizer_config = build_tokenizer_files(meta)
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": stop_token_ids(meta)}

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary one
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer.json", tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "generation_config.json", generation_config)
        try:
            os.symlink(gguf_path, tmp / WEIGHTS_LINK)
        except OSError:  # no symlinks on this filesystem
            _write_json(tmp / WEIGHTS_POINTER, {"path": str(gguf_path)})
        _write_json(tmp / SOURCE_FILE, stamp)  # last: its presence marks the folder complete
        if _is_complete(folder, stamp):  # another process finished the same folder meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        if folder.exists():  # made from an older version of the file: move it aside, then drop it
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=folder.parent))
            os.replace(folder, stale / folder.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if _is_complete(folder, stamp):  # another process finished the same folder first
                shutil.rmtree(tmp, ignore_errors=True)
                return folder
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("gguf model folder written", gguf=str(gguf_path), folder=str(folder), arch=meta.architecture,
             tokenizer=meta.get("tokenizer.ggml.model"), pre=meta.get("tokenizer.ggml.pre"),
             vocab=len(tokenizer_json["model"]["vocab"]))
    return folder
