"""The requests a benchmark sends: random token-id prompts, shared-prefix prompts, and chat streams.

Every workload is built up front from a seeded RNG, so two servers get byte-identical requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# words for the short chat prompts of the interference workload (any tokenizer handles them)
_WORDS = ("the model reads a short question about paged attention and answers it with a few plain "
          "sentences on blocks caches tokens queues servers schedules latency throughput prompts "
          "streams workers gateways requests decode prefill batches kernels memory time").split()


@dataclass
class RequestSpec:
    """One request: `api` is "completions" (prompt: token ids or text) or "chat" (prompt: messages)."""

    api: str
    prompt: list[int] | str | list[dict]
    prompt_len: int  # tokens as built (0 when unknown: a chat prompt; the server's usage fills it in)
    output_len: int
    group: str = "main"


class Vocab:
    """Which token ids a random prompt may use: the tokenizer's ids below the model's vocab, no specials."""

    def __init__(self, size: int, special_ids: set[int] | None = None, tokenizer=None):
        if size < 2:
            raise ValueError(f"vocab size must be >= 2, got {size}")
        self.size = size
        self.tokenizer = tokenizer  # tokenizers.Tokenizer or None
        special = {i for i in (special_ids or set()) if 0 <= i < size}
        self.allowed = np.array([i for i in range(size) if i not in special], dtype=np.int64)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Vocab":
        """Read tokenizer.json (and config.json's vocab_size, when present) of a HF folder."""
        from tokenizers import Tokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json; pass --tokenizer DIR or --vocab-size N")
        tok = Tokenizer.from_file(str(tok_file))
        size = tok.get_vocab_size(with_added_tokens=True)
        cfg = path / "config.json"
        if cfg.is_file():
            model_vocab = json.loads(cfg.read_text()).get("vocab_size")
            if model_vocab:
                size = min(size, int(model_vocab))  # ids past the model's embedding would be rejected
        specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        return cls(size, specials, tok)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this server takes no token-id prompts, and text prompts need a tokenizer: "
                         "pass --tokenizer DIR")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def random_workload(vocab: Vocab, num_prompts: int, input_len: int, output_len: int,
                    seed: int) -> list[RequestSpec]:
    """`num_prompts` prompts of `input_len` random token ids, each asking for `output_len` tokens."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    return [RequestSpec("completions", vocab.sample(rng, input_len), input_len, output_len)
            for _ in range(num_prompts)]


def shared_prefix_workload(vocab: Vocab, num_prompts: int, prefix_len: int, input_len: int,
                           output_len: int, seed: int) -> list[RequestSpec]:
    """Prompts = one common prefix of `prefix_len` ids + a unique suffix of `input_len` ids."""
    _check_positive(num_prompts=num_prompts, prefix_len=prefix_len, input_len=input_len,
                    output_len=output_len)
    rng = np.random.default_rng(seed)
    prefix = vocab.sample(rng, prefix_len)
    return [RequestSpec("completions", prefix + vocab.sample(rng, input_len), prefix_len + input_len,
                        output_len) for _ in range(num_prompts)]


def chat_workload(num_prompts: int, words: int, output_len: int, seed: int,
                  group: str = "short") -> list[RequestSpec]:
    """Short chat conversations of `words` random words each (prompt length comes from usage)."""
    _check_positive(num_prompts=num_prompts, words=words, output_len=output_len)
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(num_prompts):
        text = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=words))
        specs.append(RequestSpec("chat", [{"role": "user", "content": text}], 0, output_len, group))
    return specs


def stdlib_sources() -> list[Path]:
    """Python's own standard library modules: real source text any machine running this has."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)


def copy_workload(vocab: Vocab, num_prompts: int, input_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    """Prompts that ask to rewrite a piece of a standard-library module with comments and start the copy:
    the answer mostly repeats the prompt (what prompt-lookup speculation is for). Each is `input_len` tokens:
    the instruction, a window of the module's lines, and the window's first line again."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if vocab.tokenizer is None:
        raise ValueError("the copy workload tokenizes source text: pass --tokenizer DIR (or a local --model)")
    rng = np.random.default_rng(seed)
    files = stdlib_sources()
    tok = vocab.tokenizer
    head = tok.encode("# Rewrite the following Python code exactly, with a short comment above each "
                      "function.\n\n").ids
    specs = []
    for _ in range(num_prompts):
        lines = files[int(rng.integers(0, len(files)))].read_text(errors="replace").splitlines(keepends=True)
        start = int(rng.integers(0, max(1, len(lines) - 40)))
        window = "".join(lines[start:start + 400])
        body = tok.encode(window).ids
        first = tok.encode("\n# Rewritten:\n" + lines[start] if start < len(lines) else "\n").ids
        keep = max(1, input_len - len(head) - len(first))
        ids = [t for t in head + body[:keep] + first if t < vocab.size][:input_len]
        specs.append(RequestSpec("completions", ids, len(ids), output_len))
    return specs


def long_prompt(vocab: Vocab, input_len: int, output_len: int, seed: int) -> RequestSpec:
    """The long prompt the interference workload injects every K seconds."""
    _check_positive(input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    return RequestSpec("completions", vocab.sample(rng, input_len), input_len, output_len, "long")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
