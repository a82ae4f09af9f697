"""Whether a worker can ever take a sequence: the one admission rule of the scheduler's policy
(scheduler/policy.py), which the gateway also applies to each live worker's heartbeat so that a
request no worker can hold gets a 400 up front instead of failing after it was queued.

A sequence with a prompt of P tokens and max_tokens T ends at most at
final = min(P + T, max_model_len) positions. It is admissible on a worker when

- P plus the outputs it already has leave room to generate within max_model_len;
- every position it may hold KV for fits in the whole cache: final - 1 of them, since the
  last sampled token's KV is never computed;
- its prefill plus the first decode slot (what admission promises it) fits in the blocks
  above the watermark (blocks kept free so running decodes can grow without preempting).

Both bounds grow with P and with T, so the largest admissible prompt (or completion) is found
by bisection over this rule rather than by a second, hand-derived formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# the fraction of blocks admission keeps free; the scheduler service runs every worker's policy with it,
# and the gateway assumes it when it checks a prompt against a heartbeat
DEFAULT_WATERMARK = 0.01


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def watermark_blocks(num_blocks: int, watermark: float) -> int:
    """Blocks admission keeps free on a cache of `num_blocks`."""
    return int(watermark * num_blocks)


def promised_len(prefill_len: int, final_len: int) -> int:
    """Positions a prefill is promised blocks for: itself plus the first decode (if there is one)."""
    return min(prefill_len + 1, final_len - 1)


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with ok(n), for ok true up to some n and false after; lo - 1 if none."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class KVCapacity:
    """What one worker can hold, as the scheduler's admission sees it."""

    num_blocks: int
    block_size: int
    max_model_len: int
    watermark: float = DEFAULT_WATERMARK

    @property
    def watermark_blocks(self) -> int:
        return watermark_blocks(self.num_blocks, self.watermark)

    def final_len(self, prompt_len: int, max_tokens: int) -> int:
        """The most positions a sequence can reach: its output stops at max_tokens or max_model_len."""
        return min(prompt_len + max_tokens, self.max_model_len)

    def rejection(self, prompt_len: int, max_tokens: int, num_outputs: int = 0) -> str | None:
        """Why a sequence can never be admitted here (None: it can, on an idle worker).
        `num_outputs` > 0: a recomputed sequence, prefilled over prompt + outputs."""
        context = prompt_len + num_outputs
        if context >= self.max_model_len:
            return f"{context} tokens leave no room to generate within max_model_len {self.max_model_len}"
        final = self.final_len(prompt_len, max_tokens)
        most = cdiv(final - 1, self.block_size)
        admit = cdiv(promised_len(context, final), self.block_size)
        if most > self.num_blocks or admit > self.num_blocks - self.watermark_blocks:
            return (f"needs up to {most} KV blocks of {self.block_size} tokens; the worker has {self.num_blocks} "
                    f"(watermark {self.watermark_blocks})")
        return None

    def admits(self, prompt_len: int, max_tokens: int) -> bool:
        return prompt_len >= 1 and max_tokens >= 1 and self.rejection(prompt_len, max_tokens) is None

    def max_prompt_len(self, max_tokens: int) -> int:
        """The longest prompt admissible with this max_tokens (0: none)."""
        return _largest(1, self.max_model_len - 1, lambda p: self.admits(p, max_tokens))

    def max_new_tokens(self, prompt_len: int) -> int:
        """The largest max_tokens admissible with this prompt (0: none); more than max_model_len leaves
        room for changes nothing, so the answer is at most max_model_len - prompt_len."""
        return _largest(1, self.max_model_len - prompt_len, lambda t: self.admits(prompt_len, t))
