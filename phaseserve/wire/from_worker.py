"""worker -> gateway and scheduler: a step's tokens (channel `gw:<gateway>`, one TokenBatch per gateway), its
StepResult (stream `results`), and the scheduler's SequenceProgress beside the tokens on a gateway's channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phaseserve.wire.codec import Message, Row, WireError, sent_if_set


@dataclass
class KVHandoffResult(Row):
    """How a KVReceive went, in the decode worker's StepResult (for the scheduler's handoff counters)."""

    seq_id: str
    transfer_id: str
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None



# TokenEvent.error_kind of an "error" finish: the scheduler refused to admit the sequence because its
# prompt + max_tokens can never fit a worker (max_model_len or KV cache). The request was bad input, so a
# gateway answers 400 (context_length_exceeded) with `error` as the message. Any other error (error_kind
# None) is a failure while serving: 500.
ERROR_REJECTED = "rejected"
# ... or the sequence's grammar failed at a later token (the engine refused a mask or a token the gateway's
# proof did not reach), or the worker could not prepare it within its --grammar-prepare-timeout: the
# request's grammar was bad input, a 400 naming its field (an error event in a stream), never a 500.
ERROR_GRAMMAR = "grammar"
# The scheduler dead-lettered the sequence: it was running on --quarantine-after workers that failed
# (docs/architecture.md, "Poison requests"). Not retried by clients (422): it may take the next worker down.
ERROR_QUARANTINED = "quarantined"


@dataclass
class TokenEvent(Row):
    """New output tokens of one sequence; `offset` is the index of token_ids[0] in its output.

    `logprobs`, when asked for, has one entry per token: [chosen_logprob, [[id, logprob], ...top-N]].
    `finish_reason` is "stop", "length", "abort" or "error" on the last event of a sequence.
    `error_kind` says what an "error" was (ERROR_REJECTED, ERROR_GRAMMAR, or None: a serving failure).
    `cached_tokens` (on a sequence's first token): prompt positions its prefill found in the prefix cache.
    """

    seq_id: str
    offset: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None
    error: str | None = None
    error_kind: str | None = sent_if_set(None)
    cached_tokens: int = sent_if_set(0)


@dataclass
class TokenBatch(Message):
    """All tokens of one step for one gateway: one pub/sub message per gateway per step."""

    KIND: ClassVar[str] = "tokens"
    step_id: int
    worker_id: str
    events: list[TokenEvent]


@dataclass
class SequenceProgress(Message):
    """Sequences the scheduler vouches for though they show no new token: waiting in its queue, or
    prefilling a long prompt whose chunks keep being computed. A gateway counts this as progress for its
    no-progress deadline (a slow prefill or a queue is not a stall). Sent on the gateway's channel about
    once a scheduler refresh, beside the workers' TokenBatches."""

    KIND: ClassVar[str] = "progress"
    seq_ids: list[str]


def channel_message(data: bytes) -> TokenBatch | SequenceProgress:
    """A message on a gateway's channel: a worker's TokenBatch (nearly all of them, tried first) or the
    scheduler's SequenceProgress. Raises WireError for anything else."""
    try:
        return TokenBatch.from_wire(data)
    except WireError as e:
        try:
            return SequenceProgress.from_wire(data)
        except WireError:
            raise e from None


@dataclass
class StepResult(Message):
    """What a step produced, for the scheduler: sampled tokens and finished sequences."""

    KIND: ClassVar[str] = "result"
    step_id: int
    worker_id: str
    events: list[TokenEvent]
    num_tokens: int = 0
    step_time_s: float = 0.0
    epoch: int = 0  # the plan's epoch, echoed: a scheduler ignores results of another epoch's plans
    handoffs: list[KVHandoffResult] = sent_if_set(default_factory=list)  # how the plan's KVReceives went
    # (tokens, keys, prefill chunks) the step ran, when that differs from its plan (speculative decodes
    # verify as many tokens as the worker proposed): what the scheduler learns its step costs from
    ran: list[int] = sent_if_set(default_factory=list)
    # speculative decodes: seq id -> drafts the worker proposed and verified (its event's token_ids are
    # those it kept, then the token drawn after them)
    drafted: dict[str, int] = sent_if_set(default_factory=dict)
    # token masks the step computed for constrained sequences: counts per bucket of phaseserve.grammar's
    # MASK_BUCKETS_S (the last: slower than all), then the sum of their seconds
    grammar_masks: list[float] = sent_if_set(default_factory=list)
    # sequences whose sampling chunk sat out this step, their preparation (a grammar matcher) not ready:
    # seq id -> the position the worker holds it at (its next chunk must start there). Nothing of theirs
    # ran or was sampled; the scheduler plans them again from there (docs/architecture.md, "Poison requests")
    deferred: dict[str, int] = sent_if_set(default_factory=dict)
