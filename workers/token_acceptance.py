"""How a step's draws become a sequence's tokens: the drafts a verification keeps, and the end of a sequence
(a stop token, the length limit, a grammar's complete document or its error). Pure: no model, no tensors.

Every draft is a deterministic function of the sequence's tokens (q is a point mass), so standard
speculative rejection sampling (accept draft x with probability min(1, p(x) / q(x)) = p(x), else draw from
the residual (p - q)+, which is p without x) is exactly: draw each verified position's token as decoding
would (same penalties, same seeded noise at that output offset) and keep the drafts while they equal the
draws. The first draw that differs is the residual draw; after a run of accepted drafts, the next draw is
the bonus token. So the output is the one decoding would give, token for token, for greedy and seeded
requests, and from the same distribution for unseeded ones (docs/speculative.md).
"""

from __future__ import annotations

from phaseserve.params import finish_reason
from phaseserve.wire import ERROR_GRAMMAR, TokenEvent
from phaseserve.workers.sequence_state import SequenceState


def accepted_run(drafts: list[int], draws: list[int]) -> int:
    """How many drafts a verification keeps: the longest prefix of `drafts` equal to the tokens drawn at
    their positions (draws[j] is the token drawn after drafts[:j]; len(draws) == len(drafts) + 1). The
    kept tokens are then draws[:accepted + 1]."""
    a = 0
    while a < len(drafts) and drafts[a] == draws[a]:
        a += 1
    return a


def accept_draws(seq: SequenceState, drafts: list[int], draws: list[int], logprobs: list,
                 eos_token_ids: frozenset[int], max_model_len: int) -> tuple[TokenEvent, int]:
    """Append to `seq` the tokens its draws give (one for a plain sample; for a verification the accepted
    drafts and the draw after them) up to the first that ends it, and return its token event and how many
    tokens were appended. A verified sequence's computed position follows what it kept."""
    offset = seq.num_outputs
    kept = draws[:accepted_run(drafts, draws) + 1]
    matcher = seq.matcher.result() if seq.matcher is not None else None
    reason = None
    n = 0
    for tok in kept:  # a stop token, the length limit or a complete document inside an accepted run ends it
        seq.token_ids.append(tok)
        n += 1
        reason = finish_reason(seq.params, tok, seq.num_outputs, len(seq.token_ids), eos_token_ids, max_model_len)
        if matcher is not None and reason is None:
            if not matcher.advance(tok):
                reason = "error"
            elif matcher.is_stopped:  # the document is complete: nothing but EOS could follow
                reason = "stop"
        if reason is not None:
            seq.finished = True
            break
    if drafts:
        seq.num_computed = len(seq.token_ids) - 1
    if reason == "error":
        return TokenEvent(seq.seq_id, offset, [], "error", None, f"grammar: {matcher.error}", ERROR_GRAMMAR), n
    return TokenEvent(seq.seq_id, offset, kept[:n], reason, logprobs[:n] if logprobs[0] is not None else None,
                      cached_tokens=seq.cached_tokens if offset == 0 else 0), n
