"""The scheduler's sampled picture of the stack, for people: what the gateway's live view shows (docs/ui.md).

The scheduler writes one `StackView` to `Keys.stack_view()` at most every STACK_VIEW_INTERVAL_S (less
often while it holds no sequence), with a TTL, from state it keeps anyway: nothing here is computed per
token, and no process waits on it. A message of the wire's codec (phaseserve/wire/codec.py), versioned like every
other; it is no part of the request path, so its bytes are not pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from phaseserve.wire import Message, Record, Row

STACK_VIEW_INTERVAL_S = 0.4  # while the scheduler holds sequences
STACK_VIEW_IDLE_INTERVAL_S = 2.0  # while it holds none: the key stays fresh (its TTL) at little cost
STACK_VIEW_TTL_S = 5.0  # a scheduler gone: its view goes with it
STEPS_SHOWN = 24  # the last steps of each worker the view carries
WAITING_SHOWN = 32  # the longest-waiting sequences the view lists (it counts them all)


@dataclass
class StepSample(Row):
    """One step a worker ran: what its plan held, and how long it took against the ITL target."""

    decode_tokens: int  # decodes (with their speculative drafts)
    prefill_tokens: int  # prompt chunks
    prefill_chunks: int
    step_s: float  # measured by the worker
    predicted_s: float = 0.0  # the scheduler's learned cost model (0: none learned yet)
    target_s: float = 0.0  # the ITL target's bound on this step's predicted time (0: off, or no cost model)


@dataclass
class WorkerView(Record):
    worker_id: str
    role: str
    host: str = ""
    threads: int = 0
    draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # holding a cached prefix, in use or not
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    handoffs_in_flight: int = 0  # leaving this prefill worker, or arriving on this decode worker
    prefix_cache_queries: int = 0  # tokens looked up at sequence starts, since the scheduler took the lease
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0  # verified drafts, and of them kept
    spec_accepted_tokens: int = 0
    steps: list[StepSample] = field(default_factory=list)  # oldest first
    last_step_age_s: float = 0.0  # since the newest of `steps` answered


@dataclass
class WaitingSequence(Row):
    """A sequence waiting for its prompt to be computed, or part way through it (chunked prefill)."""

    request_id: str
    worker_id: str  # "" while parked: no live worker to run it
    arrival_time: float  # unix time the gateway received it: its waiting time is now - this
    prompt_tokens: int  # to prefill (prompt + outputs of a recompute)
    prefilled_tokens: int = 0  # computed or planned so far
    tenant: str = ""


@dataclass
class TenantShare(Row):
    """A tenant's sequences now (SubmitRequest.tenant; "" is the operator's keys) and its weight."""

    tenant: str
    weight: float = 1.0
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class StackView(Message):
    KIND: ClassVar[str] = "stack-view"
    taken_at: float  # unix time
    itl_target: str = "off"  # as set (`--itl-target`): "1.3x", "80ms" or "off"
    max_num_batched_tokens: int = 0
    workers: list[WorkerView] = field(default_factory=list)
    num_waiting: int = 0  # every waiting or prefilling sequence; `waiting` lists the first WAITING_SHOWN
    waiting: list[WaitingSequence] = field(default_factory=list)
    tenants: list[TenantShare] = field(default_factory=list)  # empty when no request names a tenant
