"""What one step may spend, in cost units, and the step as `WorkerPolicy.schedule()` drafts it. No I/O.

A token whose query attends to c keys costs 1 + c / K units (K: the attention horizon; 0: a token costs 1),
so a chunk of n tokens at positions p..p+n-1 costs n + n * (p + (n + 1) / 2) / K. The budget is the least of
`max_num_batched_tokens`, the cap shared by long prompts' chunks and, once the worker's step costs are
learned, the ITL target's room beside the step's decodes (docs/architecture.md, "The step budget").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from phaseserve.wire import KVReceive, ScheduledChunk, SeqStart
from phaseserve.scheduler.config import SchedulerConfig
from phaseserve.scheduler.sequence import Sequence
from phaseserve.scheduler.step_cost import StepCosts


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
class StepBudget:
    """What is left of one step's budget, in cost units (docs/architecture.md, "The step budget"): the least
    of `max_num_batched_tokens`, the long-prompt cap and the ITL target's room."""

    cap_left: float  # of max_num_batched_tokens; may go below 0: decodes are charged but never dropped
    horizon: float  # K; 0: a token costs 1
    long_threshold: int  # T; 0: no cap on long prefills
    long_left: float  # what the chunks of long prefills may still take; inf with no cap
    head_reserve: float = 0  # kept for the head of the waiting queue while partial prefills take theirs
    # the ITL target: the step's predicted time may reach `target_ratio` x the decode-only step at its batch
    # (the lower of the main fit's prediction and `decode_costs`'), or `target_ms_units`; prefill may take what
    # that leaves beside the fixed cost, the decodes and what its chunks add beyond their tokens (counting
    # the next one), at least `target_floor` (inf without a target or a learned cost model, or in a step with
    # no decode: no stream to stall, unless `hold_for_paused_stream`)
    target_ratio: float | None = None
    target_ms_units: float = math.inf
    target_floor: float = 0.0
    decode_costs: StepCosts | None = None  # the fit of the worker's decode-only steps (WorkerSlot.decode_step_costs)
    decode_tokens: int = 0
    decode_keys: int = 0
    overhead_units: float = 0.0  # the step's fixed cost, for `predicted_s`
    prefill_chunk_units: float = 0.0  # what a prefill chunk costs beyond its tokens
    unit_s: float = 0.0  # seconds a unit (0: no cost model)
    decode_units: float = 0.0
    paused_stream: bool = False  # the target counts one stream paused between turns (`hold_for_paused_stream`)
    long_cap_always: bool = False  # the long cap holds in a step with no decode too (`hold_long_cap`)
    # with `hold_long_cap`: the predicted time, in units, long chunks keep a step with no decode within (inf:
    # none), and whether a plan is in flight ahead of this one (then they wait for the next plan)
    wait_units: float = math.inf
    behind_plans: bool = False
    prefill_units: float = 0.0
    prefill_chunks: int = 0

    @classmethod
    def for_step(cls, cfg: SchedulerConfig, costs: StepCosts | None = None,
                 decode_costs: StepCosts | None = None) -> StepBudget:
        """`costs`: the worker's learned step costs; `decode_costs`: those of its decode-only steps, the ratio
        target's baseline (the steps a prefill chunk stretches)."""
        threshold = cfg.long_prefill_threshold if cfg.enable_chunked_prefill else 0
        budget = cls(cfg.max_num_batched_tokens, cfg.attention_horizon, threshold,
                     float(threshold) if threshold else math.inf)
        target = cfg.itl_target
        if costs is None or target.is_off or not cfg.enable_chunked_prefill or not costs.is_plausible:
            return budget
        # the learned model in the policy's units: a unit is token_s seconds, K = token_s / key_s
        budget.horizon, budget.unit_s, budget.overhead_units = costs.horizon, costs.token_s, costs.overhead_units
        budget.prefill_chunk_units = costs.prefill_chunk_units
        if target.ratio is not None:
            budget.target_ratio = target.ratio
            if decode_costs is not None and decode_costs.is_plausible:
                budget.decode_costs = decode_costs
        else:
            budget.target_ms_units = target.ms / 1e3 / costs.token_s
        # the deepest token's cost: whatever the target, every step may prefill at least one token
        budget.target_floor = chunk_cost(cfg.max_model_len - 1, 1, budget.horizon)
        return budget

    def hold_for_paused_stream(self) -> None:
        """Bound this step as if one stream decoded in it: another tenant's streams paused a moment ago, and
        its next turn should not wait behind long prefill steps (scheduler/tenant_planner.py)."""
        self.paused_stream = True

    def hold_long_cap(self, wait_s: float = math.inf, behind_plans: bool = False) -> None:
        """Keep the long cap in this step even with no decode: another tenant's request arriving now waits for
        the steps in flight, and a long prompt's chunks would otherwise make them as long as the budget. With
        learned costs, a step with no decode is also kept within `wait_s` by its long chunks, and those wait
        for the next plan while one is in flight (`behind_plans`): on a CPU a step of the long cap can take
        most of a short request's own first step, and a second one pipelined behind it would double the wait."""
        self.long_cap_always = True
        if self.unit_s and not math.isinf(wait_s):
            self.wait_units = wait_s / self.unit_s
            self.behind_plans = behind_plans

    @property
    def _streaming(self) -> tuple[int, int]:
        """(tokens, keys) of the decodes the ITL target bounds the step by ((0, 0): no stream to protect):
        the step's, or one stream's at its first position while one is paused."""
        if self.decode_tokens:
            return self.decode_tokens, self.decode_keys
        return (1, 1) if self.paused_stream else (0, 0)

    @property
    def _streaming_units(self) -> float:
        """The same decodes in budget units (0: no stream to protect)."""
        if self.decode_tokens:
            return self.decode_units
        return chunk_cost(0, 1, self.horizon) if self.paused_stream else 0.0

    @property
    def _bound_units(self) -> float:
        """The ITL target's bound on the step's predicted time, in units (inf: none): r x the decode-only step
        at this batch, or the milliseconds set. The decode-only step is the lower of the main fit's prediction
        and that of the fit of decode-only steps: the main fit, made of steps that carry prefill while long
        prompts run, overestimates it where a step with any prefill pays a fixed cost a decode-only one does
        not (another path through the model)."""
        tokens, keys = self._streaming
        if not tokens:
            return math.inf
        if self.target_ratio is None:
            return self.target_ms_units
        main_fit = self.overhead_units + self._streaming_units
        if self.decode_costs is None:
            return self.target_ratio * main_fit
        # the tighter of the two: the decode-only fit corrects a main fit that puts the prefill path's fixed
        # cost on every step, but extrapolated to a batch its steps did not have it may also loosen the bound
        return self.target_ratio * min(self.decode_costs.predict(tokens, keys) / self.unit_s, main_fit)

    @property
    def target_left(self) -> float:
        return self.target_room()

    def target_room(self, floor: bool = True) -> float:
        """What the ITL target leaves the step's prefill (inf: no bound). `floor`: at least the deepest token's
        cost, so a long prompt beside streams always moves; without it (beside another tenant's streams only)
        the room may be none: a chunk's own cost would stretch those streams' steps past the target."""
        bound = self._bound_units
        if math.isinf(bound):
            return math.inf
        room = (bound - self.overhead_units - self._streaming_units
                - self.prefill_chunk_units * (self.prefill_chunks + 1))
        return (max(room, self.target_floor) if floor else room) - self.prefill_units

    @property
    def left(self) -> float:
        return self.cap_left

    @property
    def long_cap_left(self) -> float:
        """What long prefills' chunks may still take. The cap keeps a long prompt from stalling the streams
        decoding beside it; in a step with no decode there is none, and it would only cost the prompt's TTFT
        (unless `hold_long_cap`)."""
        if not (self._streaming_units or self.long_cap_always):
            return math.inf
        return min(self.long_left, self._wait_left)

    @property
    def _wait_left(self) -> float:
        """What long chunks may take under `wait_units` (inf: no such bound here), the next chunk's fixed cost
        counted."""
        if math.isinf(self.wait_units) or self.decode_tokens:
            return math.inf
        return 0.0 if self.behind_plans else self.wait_units - self._planned_units - self.prefill_chunk_units

    def waits_for_plans(self, prefill_len: int) -> bool:
        """A long prompt's chunk waits for the next plan, even the token it otherwise always moves: the step
        has no decode and a plan is in flight under tenants' wait (`behind_plans`; the worker is not idle)."""
        return self.behind_plans and not self.decode_tokens and self.is_long(prefill_len)

    @property
    def held_by_target(self) -> bool:
        """The ITL target, not max_num_batched_tokens or the long cap, is what limits long prefills now."""
        return self.target_left < min(self.cap_left, self.long_cap_left)

    @property
    def _planned_units(self) -> float:
        return (self.overhead_units + self.decode_units + self.prefill_units
                + self.prefill_chunk_units * self.prefill_chunks)

    @property
    def predicted_s(self) -> float:
        """The step's predicted time as planned so far (0 without a cost model)."""
        return self._planned_units * self.unit_s

    @property
    def target_s(self) -> float:
        """The ITL target's bound on the step's predicted time (0: no bound: the target is off, no cost model
        is learned, or no stream to protect in the step): r x the pure-decode step's, or the milliseconds set."""
        bound = self._bound_units
        return 0.0 if math.isinf(bound) or not self.unit_s else bound * self.unit_s

    def is_long(self, prefill_len: int) -> bool:
        """`prefill_len`: the positions a prefill computes, its cached prefix excluded (a resent history
        that only adds a question is a short prefill, however long the prompt)."""
        return bool(self.long_threshold) and prefill_len > self.long_threshold

    def targets(self, prefill_len: int) -> bool:
        """The ITL target would bound this prefill's chunks in this step: it is on, there are decodes beside
        it (or a paused stream), and the prefill is long (or every prefill is, with no long cap)."""
        return (not math.isinf(self._bound_units)
                and (not self.long_threshold or self.is_long(prefill_len)))

    def chunk_tokens(self, prefill_len: int, start: int, budget: float, overdue: bool = False,
                     floor: bool = True) -> int:
        """The most tokens of a prefill computing `prefill_len` positions, from `start`, that fit `budget`, and
        for a long prompt the long cap and the ITL target's room (with no long cap, T = 0, the target bounds
        every prefill).
        `overdue`: the target has held this prefill back for its patience; the target no longer bounds it.
        `floor`: a long prompt moves at least a token beside the streams (`target_room`)."""
        target_left = math.inf if overdue else self.target_room(floor)
        if not self.long_threshold:
            return max_chunk_tokens(start, min(budget, target_left), self.horizon)
        if not self.is_long(prefill_len):
            return max_chunk_tokens(start, budget, self.horizon)
        n = max_chunk_tokens(start, min(budget, self.long_cap_left, target_left), self.horizon)
        # the step's first long chunk always moves, and so does an overdue one (behind others overdue too, it
        # shows progress every step while they take the long cap in turn)
        forced = overdue or (floor and self.long_left == self.long_threshold)
        if n == 0 and forced and not self.waits_for_plans(prefill_len):
            n = min(1, max_chunk_tokens(start, budget, self.horizon))
        return n

    def charge_decode(self, pos: int) -> None:
        cost = chunk_cost(pos, 1, self.horizon)
        self.cap_left -= cost
        self.decode_units += cost
        self.decode_tokens += 1
        self.decode_keys += pos + 1

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
class StepDraft:
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
    past_itl_patience: bool = False  # a chunk of a prompt the ITL target held back for its patience, beside decodes
    held_back: set[Sequence] = field(default_factory=set)  # preempted for another tenant's head: not this step
    # tenants: what each one's prefill chunks may still take this step (None: one tenant, no split)
    tenant_room: dict[str, float] | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)

    def tenant_left(self, seq: Sequence) -> float:
        """What `seq`'s tenant's prefill may still take of this step (inf with no split)."""
        return math.inf if self.tenant_room is None else self.tenant_room.get(seq.tenant, 0.0)

    def spend_tenant(self, seq: Sequence, cost: float) -> None:
        if self.tenant_room is not None:
            self.tenant_room[seq.tenant] = self.tenant_room.get(seq.tenant, 0.0) - cost
