"""scheduler -> worker, on the stream `steps:<worker>`: the plan of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from phaseserve.params import SamplingParams
from phaseserve.wire.codec import Message, Record, Row, sent_if_set
from phaseserve.wire.to_scheduler import GrammarSpec, LoraRef


@dataclass
class SeqStart(Record):
    """Tells a worker about a sequence it has not seen (new, preempted or migrated).

    `output_ids` is non-empty when the sequence is recomputed: the worker feeds
    prompt + output through prefill and continues sampling at offset len(output_ids).
    `num_cached` positions already have their KV in the sequence's blocks (moved there by a KV transfer,
    workers/kv_transfer): its first chunk starts there instead of at 0.
    `send_kv` (a prefill worker's sequence): stream the prefill's KV out as its chunks fill blocks,
    as transfer `send_kv.transfer_id`, for the decode worker the scheduler hands the sequence to.
    `cached_tokens`: how many of `num_cached` the scheduler's prefix cache found on this worker (a handoff's
    are not counted); the worker reports it with the sequence's first token, for the response's usage.
    """

    seq_id: str
    gateway_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = sent_if_set(0)
    send_kv: KVSend | None = sent_if_set(None)
    cached_tokens: int = sent_if_set(0)
    # the request's grammar: the worker builds the matcher and advances it over output_ids (a recompute or a
    # handed-over sequence continues valid)
    grammar: GrammarSpec | None = sent_if_set(None)
    lora: LoraRef | None = sent_if_set(None)  # its LoRA adapter: the worker loads it on demand (workers/lora.py)

    @property
    def num_tokens(self) -> int:
        """Positions the worker knows at start: prompt + outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

# KV transports (workers/kv_transfer): "shm" between workers on one host, "redis" between any two
KV_TRANSPORTS = ("shm", "redis")


@dataclass
class KVSend(Row):
    """Where a prefill worker ships one sequence's KV: a single-use transfer id over a transport."""

    transfer_id: str
    transport: str  # one of KV_TRANSPORTS


@dataclass
class KVReceive(Row):
    """A decode worker takes transfer `transfer_id` into `block_ids` before this step's chunks run: the KV of
    positions [0, num_tokens) of a sequence started in the same plan with `SeqStart.num_cached = num_tokens`.
    If it fails, the worker forgets that sequence (its chunks are skipped, no token is sampled) and the
    scheduler recomputes it; it never decodes over blocks whose transfer did not arrive whole."""

    seq_id: str
    transfer_id: str
    transport: str
    block_ids: list[int]
    num_tokens: int
    timeout_s: float = 2.0


@dataclass
class ScheduledChunk(Row):
    """Run tokens [start_pos, start_pos + num_tokens) of a sequence this step.

    The tokens themselves are the worker's (prompt + outputs it sampled), so a
    decode chunk needs no token id from the scheduler. `block_table` lists the
    KV block ids covering positions [0, start_pos + num_tokens); the scheduler
    owns allocation, the worker only writes where it is told. The worker samples
    a token when the chunk reaches the end of the sequence's known tokens.

    A speculative decode (`num_draft` > 0) lets the worker verify up to `num_draft` tokens it proposes
    after the sequence's last one, in this pass. Its position is the worker's: earlier steps in flight may
    have accepted fewer than they were allowed, so `start_pos` is the highest it can be and `slack` how far
    below that it may be; the block table covers start_pos + 1 + num_draft positions (docs/speculative.md).
    """

    seq_id: str
    start_pos: int
    num_tokens: int
    block_table: list[int]
    num_draft: int = sent_if_set(0)
    slack: int = sent_if_set(0)


@dataclass
class StepPlan(Message):
    """Everything a worker needs for one forward pass. Decodes come first."""

    KIND: ClassVar[str] = "plan"
    step_id: int
    worker_id: str
    starts: list[SeqStart] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # seq ids the worker may forget
    # reliability fields (defaults: what older schedulers mean). `epoch`: the sending scheduler's lease
    # epoch; a worker drops plans of an epoch older than one it has seen. `reset`: the first plan of an
    # adoption; the worker forgets every sequence it holds (they belong to a scheduler or adoption gone).
    epoch: int = 0
    reset: bool = False
    # seconds this step may take from when it is due (0: the worker's --step-timeout); the scheduler
    # scales it up for a step larger than its budget (a whole long prompt with chunked prefill off)
    timeout_s: float = 0.0
    receives: list[KVReceive] = sent_if_set(default_factory=list)  # KV handed in from a prefill worker
    # the answer to a draining worker (WorkerInfo.draining): the scheduler holds no sequence on it any
    # more and sends it nothing after this plan, so once the plans before it are run the worker may exit
    drained: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
