"""The shape of a model step as the scheduler's step-cost model reads it (scheduler/step_cost.py): the
tokens it runs, the keys their queries attend to, and its prefill chunks. Pure.

One rule for both sides: the scheduler computes it from the chunks it planned, and a speculating worker
from the chunks it ran (StepResult.ran), since verification changes a decode's size after planning.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


def chunk_keys(start: int, n: int) -> int:
    """Keys attended by the n tokens at positions start..start+n-1 (the one at p attends to p + 1)."""
    return n * start + n * (n + 1) // 2


def step_shape(chunks: Iterable, verifications: Collection[str] = ()) -> tuple[int, int, int]:
    """(tokens, keys, prefill chunks) of a step's chunks (anything with seq_id, start_pos and num_tokens),
    in one pass. A chunk of more than one token is a prefill chunk, except a verification (its seq_id in
    `verifications`): the scheduler learns what one costs beyond its tokens on its own
    (scheduler/draft_planner.py), so the prefill chunks' cost stays that of prefills."""
    tokens = keys = prefills = 0
    for c in chunks:
        n = c.num_tokens
        tokens += n
        keys += chunk_keys(c.start_pos, n)
        prefills += n > 1 and c.seq_id not in verifications
    return tokens, keys, prefills
