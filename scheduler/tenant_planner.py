"""The tenant rules of a worker's plans: the order the waiting queue is admitted in, each tenant's part of a
step's prefill budget, and whose sequence a preemption takes. No I/O; the shares themselves are
scheduler/fair_share.py, the reasons docs/tenants.md. The policy asks only while `shares.is_shared`.
"""

from __future__ import annotations

from collections.abc import Callable

from phaseserve.kv_admission import KVCapacity
from phaseserve.scheduler.budget import StepBudget, StepDraft, chunk_cost
from phaseserve.scheduler.fair_share import TenantShares, fair_order, most_over_share, weighted_split
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.sequence import Sequence


class TenantPlanner:
    """Fair-share decisions over one worker's queues (passed in: the policy owns them)."""

    def __init__(self, shares: TenantShares, kv: KVCacheManager, capacity: KVCapacity, max_num_seqs: int):
        self.shares = shares
        self.kv = kv
        self.capacity = capacity
        self.max_num_seqs = max_num_seqs
        self.last_stream_s: dict[str, float] = {}  # tenant -> the planner's clock at its last planned decode

    def stream_paused(self, step: StepDraft, budget: StepBudget, running: list[Sequence], waiting: list[Sequence],
                      clock_s: float, window_s: float) -> bool:
        """Whether a step should keep the ITL target's bound of one stream though no decode runs in it: a
        tenant whose streams decoded within `window_s` of the planner's clock has none decoding now and no long
        prompt of its own prefilling (a chat between turns, or its next turn's first step), while another
        tenant has work. Its next turn would otherwise wait behind the other's long prefill steps, planned in
        the pause. Asked after the step's decodes are planned, whether or not tenants share the worker now."""
        decoding = {s.tenant for s in step.scheduled}
        for tenant in decoding:
            self.last_stream_s[tenant] = clock_s
        self.last_stream_s = {t: c for t, c in self.last_stream_s.items() if clock_s - c <= window_s}
        if decoding or not self.last_stream_s:
            return False  # decodes bound the step themselves
        prefilling_long = {s.tenant for s in running if s.is_prefilling and budget.is_long(s.num_prefill_computed)}
        paused = self.last_stream_s.keys() - prefilling_long
        busy = {s.tenant for s in running} | {s.tenant for s in waiting}
        return bool(paused) and bool(busy - paused)

    @staticmethod
    def starts_beside_long_prompts(head: Sequence, budget: StepBudget, running: list[Sequence]) -> bool:
        """Whether the step `head` starts in should keep the ITL target's bound of one stream, as for a stream
        paused between turns: `head` is a short prompt, and another tenant's long prompt is prefilling, whose
        chunks would otherwise stretch the step to the long cap. Its first token is a chat's next one after a
        pause; the long prompts lose one step's chunk, not their share (they take it in the steps after)."""
        return not budget.is_long(head.num_known_tokens) and any(
            s.tenant != head.tenant and s.is_prefilling and budget.is_long(s.num_prefill_computed) for s in running)

    def admission_order(self, waiting: list[Sequence], running: list[Sequence], step: StepDraft) -> list[Sequence]:
        """Weighted fair order on prefill tokens (each tenant's own in (priority, arrival) order), the tenants
        under their share of the worker before those at or over it, without the sequences a fair-share
        preemption sent back in this step. A tenant that holds its share cannot be admitted past it while
        another waits (admission stops at the first that does not fit), so its queue must not stand in
        front of a tenant under its share until their virtual times cross."""
        waiting = [s for s in waiting if s not in step.held_back]
        usage = self.usage(running)
        order = fair_order(waiting, _tenant_of, self.shares.vtime, self.shares.weight, _known_tokens, usage)
        return ([s for s in order if usage.get(s.tenant, 0.0) < 1.0]
                + [s for s in order if usage.get(s.tenant, 0.0) >= 1.0])

    @staticmethod
    def allow(step: StepDraft, seq: Sequence, budget: StepBudget) -> float:
        """What a partial prefill of `seq`'s tenant may take: its tenant's room, less the head's reserve when
        the head of the queue is the same tenant's (the head's start is kept within its tenant's part)."""
        left = step.tenant_left(seq)
        if step.head is not None and step.head_admitted and step.head.tenant == seq.tenant:
            left -= budget.head_reserve
        return left

    def split_prefill_budget(self, step: StepDraft, budget: StepBudget, waiting: list[Sequence],
                             running: list[Sequence], startable: Callable[[Sequence], bool],
                             overdue: Callable[[Sequence], bool]) -> None:
        """What each tenant's prefill chunks may take of what decodes left this step: max-min fair shares by
        weight of what each can spend in it (its partial prefills' rest, its startable waiting prompts'; its
        long prompts' no more than the long cap and the ITL target leave them), so a tenant with little to do
        gets all of it and the rest is split by weight. A part a tenant could not spend would otherwise be
        lost to the step: a chat's prompts beside a flood's held-back chunks would start a step apart."""
        horizon = budget.horizon
        short: dict[str, float] = {}
        long: dict[str, float] = {}
        for s in running:
            if s.is_prefilling and s not in step.scheduled:
                held = budget.is_long(s.num_prefill_computed) and not overdue(s)
                _add(long if held else short, s.tenant, chunk_cost(s.num_computed_tokens, s.num_prefill_remaining,
                                                                  horizon))
        for s in waiting:
            if s not in step.held_back and startable(s):
                _add(long if budget.is_long(s.num_known_tokens) else short, s.tenant,
                     chunk_cost(0, s.num_known_tokens, horizon))
        long_room = max(min(budget.long_cap_left, budget.target_left), 0.0)
        demand = {t: short.get(t, 0.0) + min(long.get(t, 0.0), long_room) for t in short.keys() | long.keys()}
        if len(demand) > 1:
            step.tenant_room = weighted_split(max(budget.left, 0.0), demand, self.shares.weight)

    def usage(self, running: list[Sequence], extra: list[tuple[Sequence, int]] = ()) -> dict[str, float]:
        """Each busy tenant's holding over its weighted share: the larger of its KV blocks' and its
        sequence slots' (with each `extra` sequence counted as admitted with its blocks). A partial prefill's
        blocks are those it holds and those promised to finish it: admission keeps them free for it, so a
        flood of long prompts prefilling a few tokens a step holds the cache before it fills it."""
        blocks: dict[str, float] = {}
        slots: dict[str, float] = {}
        kv, capacity = self.kv, self.capacity
        held = [(s, len(s.block_table) + kv.num_promised_blocks(s, capacity)) for s in running]
        for s, n in held + list(extra):
            blocks[s.tenant] = blocks.get(s.tenant, 0) + n
            slots[s.tenant] = slots.get(s.tenant, 0) + 1
        by_blocks = self.shares.usage(blocks, self.kv.num_blocks)
        by_slots = self.shares.usage(slots, self.max_num_seqs)
        return {t: max(by_blocks[t], by_slots[t]) for t in by_blocks}

    def victim(self, running: list[Sequence], step: StepDraft) -> Sequence:
        """The lowest-ranked running sequence, not planned in this step, of the tenant furthest over its share."""
        candidates = [s for s in running if s not in step.scheduled]
        tenant = most_over_share(self.usage(running), (s.tenant for s in candidates))
        return next(s for s in reversed(candidates) if s.tenant == tenant)

    def victim_for(self, head: Sequence, running: list[Sequence]) -> Sequence | None:
        """The sequence to preempt so `head` may start: the lowest-ranked of another tenant furthest over its
        share, or None when no other tenant is over."""
        usage = self.usage(running)
        over = {s.tenant for s in running if s.tenant != head.tenant and usage.get(s.tenant, 0.0) > 1.0}
        tenant = most_over_share(usage, over)
        return None if tenant is None else next(s for s in reversed(running) if s.tenant == tenant)


def _add(totals: dict[str, float], tenant: str, cost: float) -> None:
    totals[tenant] = totals.get(tenant, 0.0) + cost


def _tenant_of(seq: Sequence) -> str:
    return seq.tenant


def _known_tokens(seq: Sequence) -> int:
    return seq.num_known_tokens
