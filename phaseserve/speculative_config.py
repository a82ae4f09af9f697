"""The speculative decoding setting (`--speculative-config`, vLLM's JSON form): its value type and parser,
shared by the settings table, the worker (which proposes and verifies) and the scheduler (which learns a
worker's k from its heartbeat). No I/O.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}`, or
`{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3, "quantization": "auto"}`;
`"adaptive": false` makes the scheduler always allow the full k (for measuring; the default lets the
scheduler choose k per sequence per step, docs/speculative.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    # draft_model: a model with the target's tokenizer (a folder or .gguf), its quantization (as --quantization)
    model: str | None = None
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with "
                             f"1 <= min <= max, got {lo!r} and {hi!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('method "draft_model" needs "model": the draft model\'s folder or .gguf file')

    def __str__(self) -> str:  # the flag's value, as a parent hands it to a child process
        return json.dumps({f: getattr(self, f) for f in _FIELDS}, separators=(",", ":"))


_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive", "model",
           "quantization")


def parse_speculative_config(text: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """'' / 'off' / None: no speculation; a JSON object (or dict) of SpeculativeConfig's fields otherwise.
    Raises ValueError saying what is wrong."""
    if text is None or isinstance(text, SpeculativeConfig):
        return text
    if isinstance(text, str):
        if text.strip().lower() in ("", "off", "none", "null"):
            return None
        try:
            text = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not JSON: {e}") from None
        if text is None:
            return None
    if not isinstance(text, dict):
        raise ValueError("speculative config must be a JSON object such as "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    unknown = sorted(set(text) - set(_FIELDS))
    if unknown:
        raise ValueError(f"speculative config has unknown keys: {', '.join(unknown)} (known: {', '.join(_FIELDS)})")
    return SpeculativeConfig(**text)
