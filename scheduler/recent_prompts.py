"""The last few prompts a scheduler admitted, to say in its log why a prompt much like one of them found little
of it cached (scheduler/cluster.py logs it; the cache itself is scheduler/prefix_index.py). Pure; no I/O."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from phaseserve.scheduler.prefix_index import BlockHash


class RecentPrompts:
    """The last few prompts admitted, to say why a prompt much like one of them found little of it cached.
    The commonest cause is a chat template (or a system prompt) that changes an early token, a date say:
    the two prompts then agree on most positions but part early, and the cache, which matches only up to
    the first difference, finds little. "Much like" is the positions the two agree on, the common prefix
    plus the rest compared at a small shift (a changed token may change the length a little)."""

    MAX_SHIFT = 2

    def __init__(self, size: int = 16):
        self.size = size
        self._prompts: OrderedDict[str, tuple[BlockHash, np.ndarray]] = OrderedDict()

    def most_similar(self, prompt: list[int], seed: BlockHash = b"") -> tuple[str | None, int, int]:
        """(request id, first difference, positions in agreement) of the recent prompt in the same cache scope
        (`seed`) that agrees with `prompt` on the most positions; (None, 0, 0) when there is none. Another
        scope's prompt could never have been a hit."""
        a = np.asarray(prompt, dtype=np.int64)
        best: tuple[str | None, int, int] = (None, 0, 0)
        for rid, (other_seed, b) in self._prompts.items():
            if other_seed != seed:
                continue
            n = min(len(a), len(b))
            diff = np.flatnonzero(a[:n] != b[:n])
            first = int(diff[0]) if len(diff) else n
            rest = 0
            if first < n:
                for shift in range(-self.MAX_SHIFT, self.MAX_SHIFT + 1):
                    x, y = a[first + 1 + max(shift, 0):], b[first + 1 + max(-shift, 0):]
                    m = min(len(x), len(y))
                    rest = max(rest, int(np.count_nonzero(x[:m] == y[:m])))
            if first + rest > best[2]:
                best = (rid, first, first + rest)
        return best

    def add(self, request_id: str, prompt: list[int], seed: BlockHash = b"") -> None:
        self._prompts[request_id] = (seed, np.asarray(prompt, dtype=np.int64))
        while len(self._prompts) > self.size:
            self._prompts.popitem(last=False)
