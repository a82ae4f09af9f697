"""tokenizer.json and tokenizer_config.json rebuilt from a GGUF's `tokenizer.ggml.*` metadata, the way
llama.cpp tokenizes: byte-level BPE ("gpt2") with the pre-tokenizer regexes llama.cpp picks for
`tokenizer.ggml.pre`, or SentencePiece-style BPE with byte fallback ("llama"). No torch here.
"""

from __future__ import annotations

from typing import Any

from phaseserve.models.gguf_metadata import GGUFError, GGUFMetadata
from phaseserve.models.tokenizer import gpt2_bytes_to_unicode

TOKENIZER_MODELS = ("gpt2", "llama")

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
