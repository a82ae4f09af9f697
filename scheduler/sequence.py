"""The scheduler's view of one sequence: what is known, what is planned, which blocks it holds.

Token ids belong to the worker; the scheduler keeps only the outputs that step
results have confirmed (enough to recompute a sequence elsewhere) and counts
positions. `num_computed_tokens` advances when a chunk is *planned*, so the
next plan can be built before the previous step's result arrives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from phaseserve.kv_admission import KVCapacity, promised_len
from phaseserve.wire import KVReceive, KVSend, SeqStart, SubmitRequest
from phaseserve.scheduler.prefix_index import request_seed
from phaseserve.scheduler.draft_rule import Acceptance


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no blocks; (re)starts with a prefill over prompt + outputs
    RUNNING = "running"  # holds blocks: prefilling in chunks, or decoding
    FINISHED = "finished"


@dataclass(eq=False)  # identity matters: a re-added request id is a different sequence
class Sequence:
    request: SubmitRequest
    arrival: int  # admission order in this scheduler; breaks ties after priority and arrival_time
    output_ids: list[int] = field(default_factory=list)  # confirmed by step results
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # positions whose KV is in the cache or planned
    block_table: list[int] = field(default_factory=list)
    prefill_len: int = 0  # positions the current incarnation prefills: prompt + outputs at (re)start
    num_inflight_samples: int = 0  # planned chunks that sample a token, whose step result has not arrived
    on_worker: bool = False  # the worker was sent a SeqStart and no release since
    num_preemptions: int = 0
    # the policy's clock (predicted step seconds) when its current prefill started: the ITL target may hold
    # a long prompt back for `SchedulerConfig.itl_patience_s` from then (docs/architecture.md, "The step budget")
    prefill_started_s: float = 0.0
    # phase workers. On a prefill worker: the transfer its prefill streams its KV into, and
    # whether that prefill is complete, so it waits to be handed to a decode worker instead of decoding.
    # On a decode worker: the transfer to take into its blocks with its first plan (then None).
    kv_send: KVSend | None = None
    awaiting_handoff: bool = False
    kv_receive: KVReceive | None = None
    # prefix caching (scheduler/kv_cache_manager.py): the names of the full blocks of its known tokens, how many
    # blocks of its table are named in the cache, and the positions its current start found cached
    block_hashes: list[bytes] = field(default_factory=list)
    num_named_blocks: int = 0
    num_cached_tokens: int = 0
    # speculative decoding (scheduler/draft_planner.py): drafts allowed by the steps in flight, in
    # total and per step id, and the measured acceptance the next steps' drafts are chosen by
    num_inflight_drafts: int = 0
    drafts_in_step: dict[int, int] = field(default_factory=dict)
    acceptance: Acceptance = field(default_factory=Acceptance)
    # a step sat it out (its grammar matcher not ready on the worker; scheduler/policy.py, `update`): the plans up
    # to this step id were made before that was known, and run nothing of it. sat_out: since its last token
    void_until: int = -1
    sat_out: bool = False

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def cache_seed(self) -> bytes:
        """What the name of its first block is chained to: its cache scope, salt and LoRA adapter (none: b"")."""
        return request_seed(self.request)

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def sort_key(self) -> tuple:
        """Lower is served first: priority, then arrival (gateway clock, then ours)."""
        return (self.request.priority, self.request.arrival_time, self.arrival)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its prompt and confirmed outputs: what a (re)start of it prefills."""
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_planned_outputs(self) -> int:
        """Outputs there will be once every planned step has reported (at most: drafts may be rejected)."""
        return len(self.output_ids) + self.num_inflight_samples + self.num_inflight_drafts

    @property
    def is_prefilling(self) -> bool:
        return self.status is SequenceStatus.RUNNING and self.num_computed_tokens < self.prefill_len

    @property
    def num_prefill_remaining(self) -> int:
        return self.prefill_len - self.num_computed_tokens

    @property
    def num_prefill_computed(self) -> int:
        """The positions its prefill computes: its cached prefix is read, not computed."""
        return self.prefill_len - self.num_cached_tokens

    def promised_len(self, capacity: KVCapacity, prefill_len: int) -> int:
        """Positions a prefill of `prefill_len` positions is promised blocks for: itself plus the first decode
        (if there is one)."""
        return promised_len(prefill_len, capacity.final_len(self.num_prompt_tokens, self.request.params.max_tokens))

    def reaches_limit(self, max_model_len: int) -> bool:
        """True once the planned outputs already include the last token the worker will sample
        (max_tokens or max_model_len, the same rule as phaseserve.params.finish_reason)."""
        n = self.num_planned_outputs
        return n >= self.request.params.max_tokens or self.num_prompt_tokens + n >= max_model_len

    def seq_start(self, num_cached: int = 0, cached_tokens: int = 0) -> SeqStart:
        r = self.request
        return SeqStart(r.request_id, r.gateway_id, list(r.prompt_ids), r.params, list(self.output_ids),
                        num_cached, self.kv_send, cached_tokens, r.grammar, r.lora)


def by_rank(seq: Sequence) -> tuple:
    """The key the policy's queues are kept sorted by (`Sequence.sort_key`)."""
    return seq.sort_key
