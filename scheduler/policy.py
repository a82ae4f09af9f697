"""One worker's scheduling policy: decode-first steps with chunked prefill over paged KV blocks. No I/O.

The scheduler service keeps one `WorkerPolicy` per live worker. Each
`schedule()` builds one `StepPlan` for that worker in named steps
(`_schedule_decodes`, `_reserve_head_of_queue`, `_schedule_prefill_chunks`,
`_admit_waiting`), spending one `StepBudget`:

1. Decodes. Every running sequence whose prefill is planned in full and whose
   last token is not yet planned gets one token, in (priority, arrival) order.
   If its next position needs a block and none is free, the lowest-priority,
   latest-arrived running sequence is preempted by recompute (blocks freed,
   back to waiting with its outputs kept; a later SeqStart re-prefills
   prompt + outputs). Decodes never make way for prefill.
2. Prefill, in what is left of `max_num_batched_tokens`: first the chunks of
   partially-prefilled sequences, then new (or preempted) sequences from the
   waiting queue in (priority, arrival) order, FCFS (the first one that does
   not fit stops admission, so a large prompt is not overtaken forever).

Budget units. `max_num_batched_tokens` is a budget of cost units. With
`attention_horizon` K = 0 a token costs 1 (the budget counts tokens). With
K > 0 a token whose query attends to c keys (itself and every earlier
position) costs 1 + c / K: the linear layers' work plus attention's, which
grows with the context and equals the linears' at a context of K tokens. So a
chunk of n tokens at positions p..p+n-1 costs n + n * (p + (n + 1) / 2) / K
(`chunk_cost`) and a decode at position p costs 1 + (p + 1) / K. A prefill
chunk gets the largest n whose cost fits in what is left
(`max_chunk_tokens`), so chunks shrink as a long prompt's prefix grows and
every step costs about the same time. Decodes are charged too but never
dropped. Two exceptions let a step exceed the budget by one token: the head
of the queue (below) and a step that would otherwise be empty always get at
least one token.

ITL target. Once the service has learned the worker's step costs from measured
steps (scheduler/step_cost.py: t = overhead + per token + per attended key;
`step_costs`), the budget is also bounded by the operator's ITL target
(`SchedulerConfig.itl_target`, `--itl-target`) and counted in the learned
units: a unit is one token's time, K is the learned ratio of a token's cost to
a key's, and the step's fixed cost is O units. With decodes costing D units, a
ratio target r lets prefill take (r - 1)(O + D) units -- the step's predicted
time stays within r times the predicted pure-decode step at that batch -- and
a target of M ms lets it take M / unit - O - D. Decodes always run; the chunks
of long prompts (see "Long prompts"; every prompt's when T = 0) get only what
the prediction leaves (and never more than the long cap or
`max_num_batched_tokens`): short prompts are not held, so a burst of chat
prompts is prefilled as without a target. Long prompts that need more wait, so their TTFT grows
instead of the streams' ITL (`num_steps_held_by_itl_target` counts such steps).
Whatever the target, prefill may take at least the cost of one token at the
deepest position a step, so a prefill at the front of the queue progresses
at least a token a step. A step
with no decode has no stream to protect: only `max_num_batched_tokens` binds.
Before the costs are learned (and with chunking off) the target is not applied.

Long prompts. A sequence whose prefill is longer than `long_prefill_threshold`
T tokens is long: all long prefill chunks of a step together cost at most T
units (vLLM's `long_prefill_token_threshold`). A long prompt's chunks then
stay small while streams decode beside it, and shorter prompts can still fill
the rest of the budget, so a burst of short prompts is prefilled as fast as
before. Partially-prefilled short prompts get their chunks before long ones (so
under a tight ITL target a chat prompt is not stuck behind long prompts). The
first long chunk of a step gets at least one token when the budget allows it,
so a long prompt always progresses; the head of the queue keeps its rule below.
T = 0 turns the cap off.

Starvation rule (a short prompt behind a long one): when the head of the
waiting queue could be admitted this step, it is reserved
min(its prefill's cost, max(ceil(P / 2), one token's cost)) of the P units
left after decodes; partially-prefilled sequences share the rest, and the head
gets at least one token even if decodes (or the long-prompt cap) left less
than that. So the head of the queue starts on the very next plan, and a
sequence with k startable sequences ahead of it starts within k + 1 plans --
as long as a max_num_seqs slot and KV blocks (above the watermark) are free
and no preemption happened in that step. A prompt of at most T tokens costing
up to ceil(P / 2) units at the head is prefilled in that one step.

Blocks. Admitting a sequence requires blocks for its whole prefill (+ the
first decode slot) on top of the watermark and of the blocks promised to
partially-prefilled sequences; a chunk allocates only what it covers. So
prefills never deadlock each other on blocks; only decodes, which can always
preempt, may eat into those promises. No admission happens in a step that
preempted (the victim would come straight back). Whether a sequence can ever be
admitted (`add_request`) is phaseserve/kv_admission.py's rule, which the
gateway applies too, so what it lets through is what the policy accepts.

Chunked prefill off (the "stall" baseline): a prompt is scheduled whole, and
only when its cost fits in the budget left -- except the first prefill of a step,
which runs whole even if that makes the step exceed the budget (with the
step's decodes, which are never dropped); otherwise a prompt larger than what
decodes leave would never run.

Pipelining. `schedule()` may run one (or more) plans ahead of `update()`:
positions and expected samples advance at plan time; a sequence whose prefill
completes in step N decodes in N + 1 (the worker holds the sampled token);
a sequence is never planned past max_tokens / max_model_len, but a stop-token
finish is learned a step late, so it may get one extra decode that the worker
skips. `update()` accepts an event only for a sequence planned to sample in
that step (same Sequence object: a cancelled and re-added id is a new one)
and only at offset == len(output_ids). A preempted sequence is not restarted
while one of its samples is still in flight, so the SeqStart of a recompute
carries every token the worker has published for it.
"""

from __future__ import annotations

import bisect
import itertools
import math
import secrets
from dataclasses import dataclass, field

import structlog

from phaseserve.kv_admission import DEFAULT_WATERMARK, KVCapacity, promised_len
from phaseserve.wire import KVReceive, KVSend, ScheduledChunk, SeqStart, StepPlan, StepResult, SubmitRequest
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.step_cost import ItlTarget, StepCosts

log = structlog.get_logger("scheduler.policy")

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING


class AdmissionError(ValueError):
    """A request that can never be admitted as given: its prompt + max_tokens does not fit the worker's
    max_model_len or KV cache, or its prompt holds a token id outside the model's vocabulary. Bad input,
    not a scheduler fault (the service tells the gateway so)."""


def out_of_vocab(token_ids: list[int], vocab_size: int) -> str | None:
    """Why `token_ids` cannot be fed to a model of `vocab_size` tokens, or None (vocab_size 0: unknown)."""
    if vocab_size <= 0:
        return None
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if not bad:
        return None
    return f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"


def _by_rank(seq: Sequence) -> tuple:
    return seq.sort_key


def chunk_cost(start: int, n: int, horizon: int) -> float:
    """Budget units of n tokens at positions start..start+n-1: sum over j=1..n of 1 + (start + j) / horizon
    (the token at position start + j - 1 attends to start + j keys); horizon 0 = 1 unit a token."""
    if horizon <= 0:
        return n
    return n + n * (start + (n + 1) / 2) / horizon


def max_chunk_tokens(start: int, budget: float, horizon: int) -> int:
    """The largest n >= 0 with chunk_cost(start, n, horizon) <= budget."""
    if budget <= 0:
        return 0
    if horizon <= 0:
        return math.floor(budget)
    # chunk_cost <= budget  <=>  n^2 + 2*b*n - 2*budget*K <= 0 with b = K + start + 1/2; the positive root,
    # written as c / (b + sqrt(b^2 + c)) so a large b loses no precision to cancellation
    b = horizon + start + 0.5
    c = 2.0 * budget * horizon
    n = math.floor(c / (b + math.sqrt(b * b + c)))
    while chunk_cost(start, n + 1, horizon) <= budget:  # float rounding: at most a step either way
        n += 1
    while n > 0 and chunk_cost(start, n, horizon) > budget:
        n -= 1
    return n


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048  # must equal the worker's: the scheduler plans no decode past it
    enable_chunked_prefill: bool = True
    watermark: float = DEFAULT_WATERMARK  # fraction of blocks kept free when admitting
    # K: a token attending to c keys costs 1 + c / K budget units (0 = off: 1 unit a token); the worker
    # estimates K from its model's shape (WorkerInfo.attention_horizon)
    attention_horizon: int = 0
    # T: the prefill chunks of prompts longer than T tokens take at most T budget units of a step
    # together (0 = no cap); see "Long prompts" in the module docstring
    long_prefill_threshold: int = 256
    # the bound on a step's predicted time while streams decode (see "ITL target" in the module
    # docstring); it applies once the service has learned the worker's step costs (WorkerPolicy.step_costs)
    itl_target: ItlTarget = field(default_factory=ItlTarget)
    # token ids a prompt may hold: [0, vocab_size) (WorkerInfo.vocab_size); 0 = unknown, not checked
    vocab_size: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence's decode must fit in one step, or decode-first cannot hold
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if not isinstance(self.attention_horizon, int) or self.attention_horizon < 0:
            raise ValueError(f"SchedulerConfig.attention_horizon must be an integer >= 0, got "
                             f"{self.attention_horizon!r}")
        if not isinstance(self.long_prefill_threshold, int) or self.long_prefill_threshold < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_threshold!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"SchedulerConfig.watermark must be in [0, 1), got {self.watermark!r}")


@dataclass
class StepBudget:
    """What is left of one step's budget, in cost units (module docstring: "Budget units", "ITL target",
    "Long prompts", "Starvation rule"): the least of `max_num_batched_tokens` and the ITL target's room."""

    cap_left: float  # of max_num_batched_tokens; may go below 0: decodes are charged but never dropped
    horizon: float  # K; 0: a token costs 1
    long_threshold: int  # T; 0: no cap on long prefills
    long_left: float  # what the chunks of long prefills may still take; inf with no cap
    head_reserve: float = 0  # kept for the head of the waiting queue while partial prefills take theirs
    # the ITL target, in units: prefill may take max(base + slope * decode units - what its chunks add
    # beyond their tokens (counting the next one), floor) - prefill units (inf without a target or a
    # learned cost model, or in a step with no decode: no stream to stall)
    target_base: float = math.inf
    target_slope: float = 0.0
    target_floor: float = 0.0
    overhead_units: float = 0.0  # the step's fixed cost, for `predicted_s`
    prefill_chunk_units: float = 0.0  # what a prefill chunk costs beyond its tokens
    unit_s: float = 0.0  # seconds a unit (0: no cost model)
    decode_units: float = 0.0
    prefill_units: float = 0.0
    prefill_chunks: int = 0

    @classmethod
    def for_step(cls, cfg: SchedulerConfig, costs: StepCosts | None = None) -> StepBudget:
        threshold = cfg.long_prefill_threshold if cfg.enable_chunked_prefill else 0
        budget = cls(cfg.max_num_batched_tokens, cfg.attention_horizon, threshold,
                     float(threshold) if threshold else math.inf)
        target = cfg.itl_target
        if costs is None or target.is_off or not cfg.enable_chunked_prefill or not costs.is_plausible:
            return budget
        # the learned model in the policy's units: a unit is token_s seconds, K = token_s / key_s
        budget.horizon, budget.unit_s, budget.overhead_units = costs.horizon, costs.token_s, costs.overhead_units
        budget.prefill_chunk_units = costs.prefill_chunk_units
        if target.ratio is not None:  # r * (fixed + decodes) - (fixed + decodes)
            budget.target_base = (target.ratio - 1.0) * budget.overhead_units
            budget.target_slope = target.ratio - 1.0
        else:  # ms / unit - (fixed + decodes)
            budget.target_base = target.ms / 1e3 / costs.token_s - budget.overhead_units
            budget.target_slope = -1.0
        # the deepest token's cost: whatever the target, every step may prefill at least one token
        budget.target_floor = chunk_cost(cfg.max_model_len - 1, 1, budget.horizon)
        return budget

    @property
    def target_left(self) -> float:
        if not self.decode_units or math.isinf(self.target_base):
            return math.inf
        room = (self.target_base + self.target_slope * self.decode_units
                - self.prefill_chunk_units * (self.prefill_chunks + 1))
        return max(room, self.target_floor) - self.prefill_units

    @property
    def left(self) -> float:
        return self.cap_left

    @property
    def held_by_target(self) -> bool:
        """The ITL target, not max_num_batched_tokens or the long cap, is what limits long prefills now."""
        return self.target_left < min(self.cap_left, self.long_left)

    @property
    def predicted_s(self) -> float:
        """The step's predicted time as planned so far (0 without a cost model)."""
        return (self.overhead_units + self.decode_units + self.prefill_units
                + self.prefill_chunk_units * self.prefill_chunks) * self.unit_s

    def is_long(self, prefill_len: int) -> bool:
        return bool(self.long_threshold) and prefill_len > self.long_threshold

    def chunk_tokens(self, prefill_len: int, start: int, budget: float) -> int:
        """The most tokens of a prefill of `prefill_len` from `start` that fit `budget`, and for a long prompt
        the long cap and the ITL target's room (with no long cap, T = 0, the target bounds every prefill)."""
        if not self.long_threshold:
            return max_chunk_tokens(start, min(budget, self.target_left), self.horizon)
        if not self.is_long(prefill_len):
            return max_chunk_tokens(start, budget, self.horizon)
        n = max_chunk_tokens(start, min(budget, self.long_left, self.target_left), self.horizon)
        if n == 0 and self.long_left == self.long_threshold:  # the step's first long chunk: it always moves
            n = min(1, max_chunk_tokens(start, budget, self.horizon))
        return n

    def charge_decode(self, pos: int) -> None:
        cost = chunk_cost(pos, 1, self.horizon)
        self.cap_left -= cost
        self.decode_units += cost

    def charge_prefill(self, prefill_len: int, start: int, n: int) -> float:
        """Spend a prefill chunk's cost (from the long cap too if it is long); returns the cost."""
        cost = chunk_cost(start, n, self.horizon)
        if self.is_long(prefill_len):
            self.long_left -= cost
        self.cap_left -= cost
        self.prefill_units += cost
        self.prefill_chunks += 1
        return cost


@dataclass(eq=False)
class _StepDraft:
    """One plan as `schedule()` builds it."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    starts: list[SeqStart] = field(default_factory=list)
    receives: list[KVReceive] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)  # planned to sample a token in this step
    scheduled: set[Sequence] = field(default_factory=set)
    preempted: bool = False  # no admission in a step that preempted (the victim would come straight back)
    head: Sequence | None = None  # the first startable waiting sequence
    head_admitted: bool = False  # it can be admitted this step (chunking on): reserved a share of the budget

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)


@dataclass
class Handoff:
    """A sequence leaving a prefill worker for a decode worker: its KV (positions [0, num_cached)) is in
    transfer `kv_send`; the decode worker continues at output offset len(output_ids)."""

    request: SubmitRequest
    output_ids: list[int]
    num_cached: int
    kv_send: KVSend


class WorkerPolicy:
    """One worker's scheduling policy: its sequences, its KV block accounting, and the plans of its steps.

    Phase workers: while `kv_transport` is set (the service sets it on a prefill worker when a
    decode worker exists), every sequence started here streams its prefill's KV into a transfer, and once
    its prefill is planned whole it is not decoded here: after its first token is confirmed it is
    `ready_handoffs`, and the service moves it (`hand_off` here, `accept_handoff` on the decode worker's
    policy) or keeps it (`keep`). A decode worker's handed-in sequence is started with its KVReceive in
    its first plan, beside its first decode.
    """

    def __init__(self, config: SchedulerConfig, worker_id: str = "local", first_step_id: int = 0,
                 transfer_prefix: str = "t"):
        self.config = config
        self.worker_id = worker_id
        self.kv_transport: str | None = None  # set by the service: stream prefills out for decode workers
        # unguessable: a shared-memory transfer's file is named by its id (workers/kv_transfer/shm_transport.py)
        self._transfer_ids = (f"{transfer_prefix}-{secrets.token_hex(12)}" for _ in itertools.count())
        self._ready_handoffs: list[Sequence] = []  # first token confirmed, waiting for the service
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.watermark)
        # the admission rule, shared with the gateway's up-front check (phaseserve/kv_admission.py)
        self.capacity = KVCapacity(config.num_blocks, config.block_size, config.max_model_len, config.watermark)
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._waiting: list[Sequence] = []  # sorted by rank; no blocks
        self._running: list[Sequence] = []  # sorted by rank; hold blocks
        self._releases: list[str] = []  # for the next plan
        self._inflight: dict[int, list[Sequence]] = {}  # step id -> sequences planned to sample in it
        self._arrivals = itertools.count()
        self._next_step_id = first_step_id  # unique per adoption: a late result of an earlier one matches nothing
        self._num_preemptions = 0
        self._num_resyncs = 0
        self._prefill_marks: dict[str, int] = {}  # seq id -> positions computed at the last quiet_progress
        self._num_finished = 0
        self._num_cancelled = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._num_ignored_results = 0  # results of unknown or already applied steps
        self._num_ignored_events = 0  # token events at an unexpected offset
        self._num_handed_off = 0  # sequences moved to a decode worker
        self._num_handed_in = 0  # sequences taken from a prefill worker
        # the worker's learned step costs (the service sets them from measured steps; None: not yet)
        self.step_costs: StepCosts | None = None
        self.last_budget: StepBudget | None = None  # the last plan's budget (its predicted time)
        self._num_steps_held_by_itl_target = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: SubmitRequest, output_ids: list[int] | None = None) -> None:
        """Queue a sequence. Non-empty `output_ids`: a recomputed/migrated one, prefilled over prompt + outputs.
        Raises AdmissionError if this worker can never hold it, ValueError for a malformed request."""
        rid = req.request_id
        if rid in self._seqs:
            raise ValueError(f"request {rid!r} is already scheduled")
        outputs = list(output_ids or ())
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if len(outputs) >= req.params.max_tokens:
            raise ValueError(f"request {rid!r} already has {len(outputs)} outputs, max_tokens is "
                             f"{req.params.max_tokens}")
        reason = (out_of_vocab(req.prompt_ids, self.config.vocab_size)
                  or self.capacity.rejection(prompt_len, req.params.max_tokens, len(outputs)))
        if reason is not None:
            raise AdmissionError(f"request {rid!r}: {reason}")
        seq = Sequence(req, next(self._arrivals), outputs)
        self._seqs[rid] = seq
        bisect.insort(self._waiting, seq, key=_by_rank)

    def cancel(self, request_id: str) -> bool:
        """Drop a sequence now (blocks freed at once; the worker hears it in the next plan's releases)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._retire(seq)
        self._num_cancelled += 1
        return True

    def take_all(self) -> list[tuple[SubmitRequest, list[int]]]:
        """Remove every unfinished sequence, returning it with its confirmed outputs (for another worker)."""
        seqs = sorted(self._seqs.values(), key=_by_rank)
        for seq in seqs:
            self._retire(seq)
        self._inflight.clear()
        return [(s.request, list(s.output_ids)) for s in seqs]

    def quiet_progress(self) -> list[SubmitRequest]:
        """The sequences moving on without a token to show for it since the last call: waiting (queued, or
        preempted) and prefilling with more positions computed than then (a long prompt's chunks; a chunk
        is planned only once the results of the plans before it came back, so a stuck worker stops this)."""
        marks, self._prefill_marks = self._prefill_marks, {}
        moving = [s.request for s in self._waiting]
        for seq in self._running:
            if seq.is_prefilling:
                self._prefill_marks[seq.seq_id] = seq.num_computed_tokens
                if seq.num_computed_tokens > marks.get(seq.seq_id, -1):
                    moving.append(seq.request)
        return moving

    def take_waiting(self) -> list[tuple[SubmitRequest, list[int]]]:
        """Remove the waiting sequences (no blocks held) that may start elsewhere now, returning each with its
        confirmed outputs (a draining worker's, for other workers). One with a sample still in flight stays
        until that result is in: its recompute must carry every token the worker published for it."""
        seqs = [s for s in self._waiting if s.num_inflight_samples == 0]
        for seq in seqs:
            self._retire(seq)
        return [(s.request, list(s.output_ids)) for s in seqs]

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to send."""
        step = _StepDraft()
        budget = StepBudget.for_step(self.config, self.step_costs)
        self._schedule_decodes(step, budget)
        self._reserve_head_of_queue(step, budget)
        self._schedule_prefill_chunks(step, budget)
        self._admit_waiting(step, budget)
        self._note_itl_target(budget)
        return self._seal(step)

    def _note_itl_target(self, budget: StepBudget) -> None:
        """Count the steps whose prefill the ITL target held back while prompts waited for it."""
        self.last_budget = budget
        if budget.held_by_target and (self._waiting or any(s.is_prefilling for s in self._running)):
            self._num_steps_held_by_itl_target += 1

    def _schedule_decodes(self, step: _StepDraft, budget: StepBudget) -> None:
        """Step 1: one token for every running sequence past its prefill, in rank order, preempting the
        lowest-ranked running sequences when a decode needs a block and none is free."""
        bm = self.block_manager
        for seq in list(self._running):
            if (seq.status is not RUNNING or seq.is_prefilling or seq.awaiting_handoff
                    or seq.reaches_limit(self.config.max_model_len)):
                continue  # preempted earlier in this loop, prefilling, leaving for a decode worker, or done
            pos = seq.num_computed_tokens
            if not self._preempt_for(seq, pos + 1, step):
                continue  # it was the lowest-ranked itself
            if seq.kv_receive is not None:  # handed in: the worker takes its KV, then decodes it, in this plan
                step.starts.append(seq.seq_start(num_cached=pos))
                step.receives.append(seq.kv_receive)
                seq.kv_receive = None
                seq.on_worker = True
            bm.append(seq.block_table, pos, 1)
            step.decodes.append(ScheduledChunk(seq.seq_id, pos, 1, list(seq.block_table)))
            seq.num_computed_tokens = pos + 1
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            step.scheduled.add(seq)
            budget.charge_decode(pos)

    def _preempt_for(self, seq: Sequence, num_tokens: int, step: _StepDraft) -> bool:
        """Preempt the lowest-priority, latest-arrived running sequences until `seq`'s table can hold
        `num_tokens` positions. False if `seq` itself had to go."""
        bm = self.block_manager
        while bm.num_new_blocks(seq.block_table, num_tokens) > bm.num_free_blocks:
            victim = self._running[-1]  # never one already planned: those rank above `seq`
            self._preempt(victim)
            step.preempted = True
            if victim is seq:
                return False
        return True

    def _reserve_head_of_queue(self, step: _StepDraft, budget: StepBudget) -> None:
        """The starvation rule: if the head of the waiting queue can be admitted now, reserve it
        min(its prefill's cost, max(half of what decodes left, one token's cost))."""
        step.head = next((s for s in self._waiting if self._startable(s)), None)
        head = step.head
        step.head_admitted = self.config.enable_chunked_prefill and head is not None and self._can_admit(head, step)
        if step.head_admitted:
            horizon = budget.horizon
            whole = chunk_cost(0, head.num_prompt_tokens + len(head.output_ids), horizon)
            budget.head_reserve = min(whole, max(math.ceil(budget.left / 2), chunk_cost(0, 1, horizon)))

    def _schedule_prefill_chunks(self, step: _StepDraft, budget: StepBudget) -> None:
        """Step 2a: the next chunks of partially-prefilled sequences, short prompts before long ones (each
        in rank order), in what is left of the budget after the head's reserve (none exist with chunking
        off)."""
        bm = self.block_manager
        allow = budget.left - budget.head_reserve
        # short first: under a tight ITL target a long prompt would otherwise take a short one's room
        prefilling = [s for s in self._running if s.is_prefilling and s not in step.scheduled]
        for seq in sorted(prefilling, key=lambda s: budget.is_long(s.prefill_len)):
            start = seq.num_computed_tokens
            room = (len(seq.block_table) + bm.num_free_blocks) * self.config.block_size - start
            n = min(seq.num_prefill_remaining, room, budget.chunk_tokens(seq.prefill_len, start, allow))
            if n <= 0 and step.is_empty and not step.head_admitted and room > 0:
                n = 1  # the step would be empty: progress even if one token costs more than the budget
            if n <= 0:
                continue  # no budget left, or decodes took its promised blocks (they will finish or preempt)
            self._plan_prefill(step, seq, n)
            allow -= budget.charge_prefill(seq.prefill_len, start, n)

    def _admit_waiting(self, step: _StepDraft, budget: StepBudget) -> None:
        """Step 2b: start waiting sequences FCFS by rank; the first that does not fit stops admission."""
        chunking = self.config.enable_chunked_prefill
        for seq in list(self._waiting):
            if not self._startable(seq):
                continue
            need = seq.num_prompt_tokens + len(seq.output_ids)
            if chunking:
                n = min(need, budget.chunk_tokens(need, 0, budget.left))
                if n <= 0:
                    if seq is not step.head or not step.head_admitted:
                        break
                    n = 1  # the head starts on this plan even when decodes used up the budget
            else:
                if chunk_cost(0, need, budget.horizon) > budget.left and step.prefills:
                    break  # whole prompts only; the first prefill of a step may exceed the budget
                n = need
            if not self._can_admit(seq, step):
                break
            self._waiting.remove(seq)
            seq.status = RUNNING
            seq.prefill_len = need
            seq.num_computed_tokens = 0
            bisect.insort(self._running, seq, key=_by_rank)
            if not seq.on_worker:
                if self.kv_transport is not None:  # a new transfer for each (re)start: ids are single-use
                    seq.kv_send = KVSend(next(self._transfer_ids), self.kv_transport)
                step.starts.append(seq.seq_start())
                seq.on_worker = True
            self._plan_prefill(step, seq, n)
            budget.charge_prefill(need, 0, n)

    def _can_admit(self, seq: Sequence, step: _StepDraft) -> bool:
        """A free max_num_seqs slot, no preemption in this step, and blocks for the whole prefill (+ the
        first decode) above the watermark and the blocks promised to partially-prefilled sequences."""
        bm = self.block_manager
        need = bm.blocks_for(self._promised_len(seq, seq.num_prompt_tokens + len(seq.output_ids)))
        return (not step.preempted and len(self._running) < self.config.max_num_seqs
                and bm.can_allocate(need, reserved=self._promised_blocks()))

    def _plan_prefill(self, step: _StepDraft, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.block_manager.append(seq.block_table, start, n)
        step.prefills.append(ScheduledChunk(seq.seq_id, start, n, list(seq.block_table)))
        seq.num_computed_tokens = start + n
        if seq.num_computed_tokens == seq.prefill_len:  # the worker samples at the end of its known tokens
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            seq.awaiting_handoff = seq.kv_send is not None
        step.scheduled.add(seq)

    def _seal(self, step: _StepDraft) -> StepPlan | None:
        """The plan of a drafted step, with the pending releases; None when there is nothing to send."""
        if step.is_empty and not self._releases:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._inflight[step_id] = step.sampled  # every plan gets a result, even one with nothing to sample
        releases, self._releases = self._releases, []
        self._num_decode_tokens += len(step.decodes)
        self._num_prefill_tokens += sum(c.num_tokens for c in step.prefills)
        return StepPlan(step_id, self.worker_id, step.starts, step.decodes + step.prefills, releases,
                        receives=step.receives)

    # ------------------------------------------------------------------ results

    def update(self, result: StepResult) -> list[str]:
        """Apply a step's sampled tokens; returns the ids of sequences that finished."""
        sampled = self._inflight.pop(result.step_id, None)
        if sampled is None:
            self._num_ignored_results += 1
            log.warning("ignoring result of an unknown or already applied step", step_id=result.step_id,
                        worker_id=result.worker_id)
            return []
        for old in sorted(k for k in self._inflight if k < result.step_id):
            # results come in step order, so an older open step's result was lost (harmless if it sampled nothing)
            lost = self._inflight.pop(old)
            if lost:
                log.warning("step result missing; recomputing its sequences", step_id=old, num_seqs=len(lost))
                self._settle(lost, set())
        planned = set(sampled)
        accepted: set[Sequence] = set()
        finished: list[str] = []
        for ev in result.events:
            seq = self._seqs.get(ev.seq_id)
            if seq is None or seq not in planned:
                continue  # cancelled, finished, or an earlier incarnation of this id
            if ev.offset != len(seq.output_ids):
                self._num_ignored_events += 1
                log.warning("ignoring token event at an unexpected offset", seq_id=ev.seq_id, offset=ev.offset,
                            expected=len(seq.output_ids), step_id=result.step_id)
                continue
            seq.output_ids.extend(ev.token_ids)
            accepted.add(seq)
            if ev.finish_reason is None and self._at_limit(seq):
                log.error("worker did not finish a sequence at its length limit; finishing it",
                          seq_id=seq.seq_id, outputs=len(seq.output_ids))
                ev_reason = "length"
            else:
                ev_reason = ev.finish_reason
            if ev_reason is not None:
                self._retire(seq)
                self._num_finished += 1
                finished.append(seq.seq_id)
            elif seq.awaiting_handoff:
                self._ready_handoffs.append(seq)
        self._settle(sampled, accepted)
        return finished

    def drop_step(self, step_id: int) -> bool:
        """A step whose result will never come (its plan or result was lost, or it overran the deadline):
        its sequences are recomputed from their confirmed outputs. False if the step was not open."""
        lost = self._inflight.pop(step_id, None)
        if lost is None:
            return False
        log.warning("step given up; recomputing its sequences", step_id=step_id, num_seqs=len(lost))
        self._settle(lost, set())
        return True

    def outputs_of(self, seq_id: str) -> list[int] | None:
        """A live sequence's confirmed outputs (the list itself: read, do not change), or None."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.output_ids

    # ------------------------------------------------------------------ handoffs (phase workers)

    def ready_handoffs(self) -> list[str]:
        """Sequences whose prefill is done and first token confirmed, waiting to be handed to a decode
        worker (`hand_off`) or kept here (`keep`); each is reported once."""
        ready, self._ready_handoffs = self._ready_handoffs, []
        return [s.seq_id for s in ready if self._seqs.get(s.seq_id) is s and s.awaiting_handoff]

    def handoff_of(self, seq_id: str) -> Handoff:
        """What a sequence waiting for its handoff would take to a decode worker."""
        seq = self._seqs[seq_id]
        assert seq.awaiting_handoff and seq.kv_send is not None, seq_id
        return Handoff(seq.request, list(seq.output_ids), seq.prefill_len, seq.kv_send)

    def hand_off(self, seq_id: str) -> Handoff:
        """Let a sequence go to a decode worker: its blocks are freed and the worker told to forget it (its
        KV is already whole in the transfer: the worker finishes the transfer when the prefill ends, before
        it reports the first token)."""
        handoff = self.handoff_of(seq_id)
        self._retire(self._seqs[seq_id])
        self._num_handed_off += 1
        return handoff

    def keep(self, seq_id: str) -> None:
        """No decode worker can take it: it decodes here (the worker drops its transfer at the first decode)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.awaiting_handoff = False
            seq.kv_send = None

    def can_accept_handoff(self, handoff: Handoff) -> bool:
        """Room for a handed-in sequence now: a max_num_seqs slot, blocks for its cached positions and its
        first decode above the watermark and the blocks promised to prefills."""
        bm, req = self.block_manager, handoff.request
        return (self.capacity.rejection(len(req.prompt_ids), req.params.max_tokens, len(handoff.output_ids)) is None
                and len(self._running) < self.config.max_num_seqs
                and bm.can_allocate(bm.blocks_for(handoff.num_cached + 1), reserved=self._promised_blocks()))

    def accept_handoff(self, handoff: Handoff, timeout_s: float = 2.0) -> None:
        """Take a sequence from a prefill worker: blocks for its cached positions now, its KV received into
        them with its first decode (`_schedule_decodes`). If the receive fails the worker reports no token
        and the sequence is recomputed here (`_settle`), never decoded over a half-received cache."""
        req = handoff.request
        if req.request_id in self._seqs:
            raise ValueError(f"request {req.request_id!r} is already scheduled")
        seq = Sequence(req, next(self._arrivals), list(handoff.output_ids), status=RUNNING)
        seq.prefill_len = seq.num_computed_tokens = handoff.num_cached
        self.block_manager.append(seq.block_table, 0, handoff.num_cached)
        seq.kv_receive = KVReceive(req.request_id, handoff.kv_send.transfer_id, handoff.kv_send.transport,
                                   list(seq.block_table), handoff.num_cached, timeout_s)
        self._seqs[req.request_id] = seq
        bisect.insort(self._running, seq, key=_by_rank)
        self._num_handed_in += 1

    def _settle(self, sampled: list[Sequence], accepted: set[Sequence]) -> None:
        """Close a step's expected samples; a live sequence whose sample never came is recomputed."""
        for seq in sampled:
            seq.num_inflight_samples -= 1
            if seq in accepted or self._seqs.get(seq.seq_id) is not seq:
                continue
            log.warning("planned token never reported; recomputing the sequence", seq_id=seq.seq_id)
            self._num_resyncs += 1
            if seq.status is RUNNING:
                self._preempt(seq, count=False)

    # ------------------------------------------------------------------ state changes

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.prefill_len = 0
        seq.kv_send, seq.kv_receive, seq.awaiting_handoff = None, None, False  # a recompute starts afresh
        if seq.on_worker:
            self._releases.append(seq.seq_id)
            seq.on_worker = False
        bisect.insort(self._waiting, seq, key=_by_rank)
        if count:
            seq.num_preemptions += 1
            self._num_preemptions += 1
            log.info("preempted by recompute", seq_id=seq.seq_id, outputs=len(seq.output_ids),
                     free_blocks=self.block_manager.num_free_blocks)

    def _retire(self, seq: Sequence) -> None:
        """Finished or cancelled: out of every queue, blocks freed, worker told."""
        if seq.status is RUNNING:
            self._running.remove(seq)
            self.block_manager.free(seq.block_table)
        elif seq.status is WAITING:
            self._waiting.remove(seq)
        if seq.on_worker:
            self._releases.append(seq.seq_id)
            seq.on_worker = False
        seq.status = SequenceStatus.FINISHED
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]

    # ------------------------------------------------------------------ helpers

    def _startable(self, seq: Sequence) -> bool:
        # an in-flight sample would be missing from the SeqStart; a pending release would
        # reach the worker in the same plan as the start
        return seq.num_inflight_samples == 0 and seq.seq_id not in self._releases

    def _final_len(self, seq: Sequence) -> int:
        return self.capacity.final_len(seq.num_prompt_tokens, seq.request.params.max_tokens)

    def _promised_len(self, seq: Sequence, prefill_len: int) -> int:
        """Positions a prefill is promised blocks for: itself plus the first decode (if there is one)."""
        return promised_len(prefill_len, self._final_len(seq))

    def _promised_blocks(self) -> int:
        """Blocks partially-prefilled sequences will still take to finish their prefill."""
        bm = self.block_manager
        return sum(bm.num_new_blocks(s.block_table, self._promised_len(s, s.prefill_len))
                   for s in self._running if s.is_prefilling)

    def _at_limit(self, seq: Sequence) -> bool:
        n = len(seq.output_ids)
        return n >= seq.request.params.max_tokens or seq.num_prompt_tokens + n >= self.config.max_model_len

    # ------------------------------------------------------------------ introspection

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens not yet planned: the waiting sequences' whole prefills, the rest of partial ones."""
        return (sum(s.num_prompt_tokens + len(s.output_ids) for s in self._waiting)
                + sum(s.num_prefill_remaining for s in self._running if s.is_prefilling))

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_steps_held_by_itl_target(self) -> int:
        return self._num_steps_held_by_itl_target

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> dict:
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "num_preemptions": self._num_preemptions,
            "num_resyncs": self._num_resyncs,
            "num_finished": self._num_finished,
            "num_cancelled": self._num_cancelled,
            "num_steps": self._next_step_id,
            "num_steps_in_flight": len(self._inflight),
            "num_ignored_results": self._num_ignored_results,
            "num_ignored_events": self._num_ignored_events,
            "num_prefill_tokens": self._num_prefill_tokens,
            "num_decode_tokens": self._num_decode_tokens,
            "num_handed_off": self._num_handed_off,
            "num_handed_in": self._num_handed_in,
            "num_steps_held_by_itl_target": self._num_steps_held_by_itl_target,
        }
