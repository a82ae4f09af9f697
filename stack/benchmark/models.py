"""Benchmark models by name: `bundled` (the model phaseserve ships) and `small-200m` (built once, cached).

small-200m is a Llama of the shape the benchmark issue names (16 layers, hidden 1024, intermediate
2816, 16 heads, 8 KV heads, bf16, random weights). It reuses the bundled model's tokenizer so that
every server tokenizes alike; its vocab_size is that tokenizer's size (not 32000) so that every id the
tokenizer can produce has an embedding row. Without a bundled model it falls back to a byte-level BPE.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import structlog

from phaseserve.models import model_source
from phaseserve.models.model_source import bundled_model_path

log = structlog.get_logger("phaseserve.stack.benchmark.models")

SMALL_200M = dict(num_hidden_layers=16, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
NAMES = ("bundled", "small-200m", "smollm2")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "phaseserve" / "bench"


def resolve_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """A model name -> a folder with config.json: small-200m (built on first use) or anything the
    servers' --model takes (bundled, the default SmolLM2, a folder, a GGUF, a hub id)."""
    if name == "small-200m":
        return build_small_200m(Path(cache_dir) if cache_dir else default_cache_dir())
    try:
        return Path(model_source.resolve_model(name).path)
    except model_source.ModelNotFound as e:
        raise FileNotFoundError(f"model {name!r}: {e} (bench also knows: {', '.join(NAMES)})") from None


def build_small_200m(cache_dir: Path) -> Path:
    path = cache_dir / "small-200m"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    tmp = cache_dir / "small-200m.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab_size, bos, eos = _write_tokenizer(tmp)
    cfg = LlamaConfig(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, **SMALL_200M)
    torch.manual_seed(200)
    log.info("building small-200m (random weights)", path=str(path), vocab_size=vocab_size)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # only a complete folder ever carries the final name
    return path


def _write_tokenizer(dst: Path) -> tuple[int, int | None, int | None]:
    """Copy the bundled tokenizer (or make a byte-level one); return (vocab size, bos id, eos id)."""
    from tokenizers import Tokenizer

    src = Path(bundled_model_path())
    if (src / "tokenizer.json").is_file():
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copy(src / f, dst / f)
    else:
        log.warning("no bundled tokenizer; training a byte-level BPE for small-200m")
        _train_byte_level(dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tcfg = json.loads((dst / "tokenizer_config.json").read_text()) if (dst / "tokenizer_config.json").is_file() else {}

    def tid(key):
        t = tcfg.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        return tok.token_to_id(t) if t else None

    return tok.get_vocab_size(with_added_tokens=True), tid("bos_token"), tid("eos_token")


def _train_byte_level(dst: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = open(__file__, encoding="utf-8").read().splitlines()  # any offline text will do
    tok.train_from_iterator(text, trainer)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }))
