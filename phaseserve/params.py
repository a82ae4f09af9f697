"""Sampling parameters and the stop rule, shared by gateway, scheduler and worker.

One definition so that the gateway's validation, the scheduler's accounting and
the worker's sampler can never disagree about what a request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample as greedy (vLLM's bound): dividing logits by a tinier one overflows to inf,
# and the softmax of that is NaN.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for a logit_bias value: -100 bans a token, +100 forces it.
LOGIT_BIAS_LIMIT = 100.0


class InvalidParams(ValueError):
    """A sampling value out of range; the message names the field (-> HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: chosen token only; N: plus top-N
    min_tokens: int = 0
    # token id -> added to its logit before sampling. Left off the wire while empty (wire.sent_if_set's
    # metadata: wire imports this module), so requests without it keep their bytes.
    logit_bias: dict[int, float] = field(default_factory=dict, metadata={"sent_if_set": True})

    def validate(self) -> "SamplingParams":
        def bad(name: str, msg: str) -> InvalidParams:
            return InvalidParams(f"'{name}' {msg}", name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be between 0 and 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be between 0 and 20")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be between 0 and max_tokens")
        if any(not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for b in self.logit_bias.values()):
            raise bad("logit_bias", f"values must be between {-LOGIT_BIAS_LIMIT:g} and {LOGIT_BIAS_LIMIT:g}")
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise bad("logit_bias", "keys must be token ids (integers >= 0)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def finish_reason(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    total_len: int,
    eos_token_ids: frozenset[int] | set[int],
    max_model_len: int,
) -> str | None:
    """Why a sequence stops after emitting `token_id` (its `num_output_tokens`-th output).

    Returns "stop", "length" or None. Stop *strings* are the gateway's business
    (they need detokenized text); this rule covers what the worker can see.
    """
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
    if num_output_tokens >= params.max_tokens or total_len >= max_model_len:
        return "length"
    return None
