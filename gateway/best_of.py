"""`best_of`: when a request may have it, and which of each prompt's candidates the client gets back
(policy only, no I/O)."""

from __future__ import annotations

from phaseserve.gateway.output import SequenceOutput


def check_request(n: int, best_of: int | None, stream: bool) -> None:
    """ValueError naming `best_of` (the schema's validator turns it into a 400) for a form not served."""
    if best_of is not None and best_of < n:
        raise ValueError(f"'best_of' must be at least 'n' ({n}); got {best_of}")
    if stream and best_of is not None and best_of > n:
        raise ValueError("'best_of' greater than 'n' cannot be streamed (the best are known at the end)")


def cumulative_logprob(out: SequenceOutput) -> float:
    """The sum of the chosen tokens' logprobs up to where the choice ended (a stop string included)."""
    return sum(e.logprob for e in out.logprobs)


def best_of(outputs: list[SequenceOutput], per_prompt: int, n: int) -> list[SequenceOutput]:
    """`outputs` holds each prompt's `per_prompt` candidates one after the other; returns each prompt's n with
    the highest cumulative logprob (vLLM's rule; ties keep the earlier), re-indexed as choice prompt * n + rank."""
    chosen = []
    for first in range(0, len(outputs), per_prompt):
        ranked = sorted(outputs[first:first + per_prompt], key=cumulative_logprob, reverse=True)
        for rank, out in enumerate(ranked[:n]):
            out.index = first // per_prompt * n + rank
            chosen.append(out)
    return chosen
