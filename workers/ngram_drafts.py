"""Drafts by prompt lookup on the worker (speculative method "ngram"): the continuation of an earlier
occurrence of the sequence's last tokens. Pure: no model, no tensors (docs/speculative.md). Each draft is a
deterministic function of the sequence's tokens, which keeps verification exact (workers/token_acceptance.py).
"""

from __future__ import annotations


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last n tokens in
    prompt + output, trying n from prompt_lookup_max down to prompt_lookup_min. One per sequence: it indexes
    each n-gram once, as tokens arrive, so a proposal costs O(max - min) dictionary lookups, not a scan."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._ends: list[dict[tuple, int]] = [{} for _ in range(lookup_max - lookup_min + 1)]
        self._indexed = 0  # tokens[:_indexed] have every n-gram ending before them indexed

    def _index(self, tokens: list[int]) -> None:
        # an n-gram ending at e (exclusive) is indexed once tokens[e] exists: it has a continuation
        for e in range(max(self._indexed, 1), len(tokens)):
            for i, ends in enumerate(self._ends):
                n = self.lookup_min + i
                if e >= n:
                    ends[tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens` (which only ever grows between calls), or []."""
        if k <= 0:
            return []
        self._index(tokens)
        n_tokens = len(tokens)
        for i in range(len(self._ends) - 1, -1, -1):
            n = self.lookup_min + i
            if n_tokens <= n:
                continue
            end = self._ends[i].get(tuple(tokens[n_tokens - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramDrafts:
    """The runner's proposer for method "ngram": one NgramProposer per sequence."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._by_seq: dict[str, NgramProposer] = {}

    def propose(self, wants: dict[str, tuple[list[int], int, list[int]]]) -> dict[str, list[int]]:
        """seq id -> (its tokens, the most drafts it may have, its block table): seq id -> drafts."""
        out = {}
        for seq_id, (tokens, room, _) in wants.items():
            p = self._by_seq.get(seq_id)
            if p is None:
                p = self._by_seq[seq_id] = NgramProposer(self.lookup_min, self.lookup_max)
            d = p.propose(tokens, room)
            if d:
                out[seq_id] = d
        return out

    def kept(self, seq_id: str, num_before: int, accepted: int) -> None:
        """A verification of `seq_id`'s drafts kept `accepted` after its num_before tokens."""

    def forget(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)

    def warm_up(self) -> None:
        """Nothing to load or compile."""

    def reset(self) -> None:
        self._by_seq.clear()
