"""Tiny random-weight Hugging Face checkpoints, written by transformers itself (safetensors).

`make_model(tmp_path, kind="llama", dtype="float32", **overrides) -> Path` builds one
folder with config.json, generation_config.json, model.safetensors (or shards),
tokenizer.json and tokenizer_config.json. Identical requests in one test session
return the folder already built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# one architecture quirk per kind; every kind stays tiny (CPU tests must be fast)
BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    initializer_range=0.1,  # wider than HF's 0.02 so greedy argmax is not decided by near-ties
)
KINDS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama_gqa_llama3": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_linear_head_dim": ("llama", dict(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mqa": ("llama", dict(num_key_value_heads=1)),
    "sharded": ("llama", {}),
}
ALL_KINDS = tuple(KINDS)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello world! Paged attention keeps the KV cache in fixed-size blocks. ",
    "Once upon a time there was a small language model that ran on a CPU. ",
    "0123456789 + - * / = ( ) [ ] { } <assistant> <user> <system>",
]

_built: dict[tuple, Path] = {}


def _config(kind: str, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    family, quirks = KINDS[kind]
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    return cls(**{**BASE, **quirks, **overrides})


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a few sentences, padded out to the model's vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TRAIN_TEXT, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


def make_model(tmp_path: str | Path, kind: str = "llama", dtype: str = "float32", **overrides) -> Path:
    """Build (or reuse) a tiny checkpoint of `kind` in `dtype` ("float32" or "bfloat16")."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    key = (kind, dtype, json.dumps(overrides, sort_keys=True))
    if key in _built and (_built[key] / "config.json").is_file():
        return _built[key]
    name = f"{kind}-{dtype}-{len(_built)}"
    path = Path(tmp_path) / name
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(kind, overrides)
    torch.manual_seed(sum(map(ord, kind)))  # a fixed model per kind
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    shard = "40KB" if kind == "sharded" else "5GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
    # a list of eos ids, as Llama 3 checkpoints have (config.eos_token_id stays an int)
    GenerationConfig(bos_token_id=0, eos_token_id=[1, 2]).save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)
    _built[key] = path
    return path
