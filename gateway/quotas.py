"""Each tenant's and key's limits on one gateway: requests in flight, prompt tokens waiting for their first
token, tokens per minute (prompt tokens when a request is let in, completion tokens as it ends). A request
over one gets 429 with `Retry-After` and a message naming the limit; docs/tenants.md.

The counts are this gateway's (with several gateways behind a balancer, each enforces the limits on what it
serves). Tokens per minute is a sliding-window counter from the `limits` package.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from phaseserve.gateway.tenants import ApiKey, Limits


@dataclass(frozen=True)
class Refusal:
    """Why a request is not let in now, and when to retry (seconds)."""

    message: str
    retry_after: int
    limit: str  # concurrency | tokens_per_minute | queued_prompt_tokens


def _holders(key: ApiKey) -> list[tuple[str, Limits]]:
    """Whose limits a request of `key` counts against: its tenant's and its own."""
    return [(f"tenant {key.tenant.name}", key.tenant.limits), (f"key {key.name}", key.limits)]


class Quotas:
    def __init__(self, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        self.in_flight: Counter[str] = Counter()
        self.queued: Counter[str] = Counter()
        self._window = SlidingWindowCounterRateLimiter(MemoryStorage())

    def refusal(self, key: ApiKey, prompt_tokens: int) -> Refusal | None:
        """The first limit a new request of `key` with `prompt_tokens` would pass, or None."""
        for who, lim in _holders(key):
            if lim.max_concurrent_requests is not None and self.in_flight[who] >= lim.max_concurrent_requests:
                return Refusal(f"Rate limit reached for {who} on concurrent requests: limit "
                               f"{lim.max_concurrent_requests}, in flight {self.in_flight[who]}",
                               self.retry_after_s, "concurrency")
            if (lim.max_queued_prompt_tokens is not None and self.queued[who]
                    and self.queued[who] + prompt_tokens > lim.max_queued_prompt_tokens):
                return Refusal(f"Rate limit reached for {who} on queued prompt tokens: limit "
                               f"{lim.max_queued_prompt_tokens}, queued {self.queued[who]}, requested {prompt_tokens}",
                               self.retry_after_s, "queued_prompt_tokens")
            if lim.tokens_per_minute is not None:
                item = RateLimitItemPerMinute(lim.tokens_per_minute)
                if not self._window.test(item, who, cost=min(prompt_tokens, lim.tokens_per_minute) or 1):
                    stats = self._window.get_window_stats(item, who)
                    used = lim.tokens_per_minute - stats.remaining
                    wait = max(1, math.ceil(stats.reset_time - time.time()))
                    return Refusal(f"Rate limit reached for {who} on tokens per minute: limit "
                                   f"{lim.tokens_per_minute}, used {used}, requested {prompt_tokens}",
                                   wait, "tokens_per_minute")
        return None

    def acquire(self, key: ApiKey, prompt_tokens: int) -> None:
        for who, lim in _holders(key):
            self.in_flight[who] += 1
            self.queued[who] += prompt_tokens
            self.spend(who, lim, prompt_tokens)

    def dequeue(self, key: ApiKey, prompt_tokens: int) -> None:
        """A sequence's prompt no longer waits (its first token came, or it ended)."""
        for who, _ in _holders(key):
            self.queued[who] -= prompt_tokens

    def release(self, key: ApiKey, completion_tokens: int) -> None:
        for who, lim in _holders(key):
            self.in_flight[who] -= 1
            self.spend(who, lim, completion_tokens)
            if not self.in_flight[who]:
                del self.in_flight[who]
                self.queued.pop(who, None)

    def spend(self, who: str, lim: Limits, tokens: int) -> None:
        if lim.tokens_per_minute is not None and tokens > 0:
            # the window refuses a hit past its limit (and counts none of it): what fits is counted, so a
            # request's completion that goes past the limit fills the minute
            item = RateLimitItemPerMinute(lim.tokens_per_minute)
            cost = min(tokens, self._window.get_window_stats(item, who).remaining)
            if cost > 0:
                self._window.hit(item, who, cost=cost)

    def current(self, key: ApiKey) -> dict:
        """What `key` and its tenant hold on this gateway now (for /v1/usage)."""
        out = {}
        for who, lim in _holders(key):
            tpm = None
            if lim.tokens_per_minute is not None:
                stats = self._window.get_window_stats(RateLimitItemPerMinute(lim.tokens_per_minute), who)
                tpm = lim.tokens_per_minute - stats.remaining
            out[who.split(" ", 1)[0]] = {"in_flight": self.in_flight[who], "queued_prompt_tokens": self.queued[who],
                                         "tokens_last_minute": tpm, "limits": lim.as_dict()}
        return out
