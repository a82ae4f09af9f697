"""The named steps of a worker's plan, in the order `WorkerPolicy.schedule()` takes them, and the admission
and preemption rules they share. No I/O; the invariants they keep are stated on `schedule()`
(scheduler/policy.py), the reasoning in docs/architecture.md, "The step budget".
"""

from __future__ import annotations

import math

import structlog

from phaseserve.kv_admission import KVCapacity
from phaseserve.wire import ScheduledChunk
from phaseserve.scheduler.budget import StepBudget, StepDraft, chunk_cost
from phaseserve.scheduler.config import SchedulerConfig
from phaseserve.scheduler.draft_planner import DraftPlanner
from phaseserve.scheduler.fair_share import TenantShares
from phaseserve.scheduler.handoff_book import HandoffBook
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.policy_stats import PolicyCounters
from phaseserve.scheduler.sequence import Sequence, SequenceStatus
from phaseserve.scheduler.sequence_queues import SequenceQueues
from phaseserve.scheduler.step_cost import StepCosts
from phaseserve.scheduler.tenant_planner import TenantPlanner

log = structlog.get_logger("phaseserve.scheduler.policy")

RUNNING = SequenceStatus.RUNNING


class StepPlanner:
    """Drafts one step's plan over a worker's queues and KV cache; the policy's parts, shared with it."""

    def __init__(self, config: SchedulerConfig, capacity: KVCapacity, queues: SequenceQueues, kv: KVCacheManager,
                 shares: TenantShares, tenants: TenantPlanner, drafts: DraftPlanner, handoffs: HandoffBook,
                 counters: PolicyCounters):
        self.config = config
        self.capacity = capacity
        self.queues = queues
        self.kv = kv
        self.shares = shares
        self.tenants = tenants
        self.drafts = drafts
        self.handoffs = handoffs
        self.counters = counters
        self.clock_s = 0.0  # the planned steps' predicted time, summed: what the ITL target's patience counts

    # ------------------------------------------------------------------ the steps, in plan order

    def make_room_for_fair_heads(self, step: StepDraft) -> None:
        """Step 0 (tenants): the startable sequences at the front of the fair order get a slot and blocks for
        this step's admission while their tenants stay within their shares with them: for each that would not
        fit beside those before it, the lowest-ranked sequences of the tenants over their share are preempted,
        furthest first. They wait behind it, and not for this step (`held_back`): a burst of one tenant cannot
        hold another's requests back, and a chat's turn starts together, not one request a step."""
        kv, running = self.kv, self.queues.running
        admitted: list[tuple[Sequence, int]] = []  # (sequence, the blocks it will hold)
        taken = 0  # of the free blocks (a cached prefix nobody holds counts as free until taken)
        promised = self.promised_blocks()  # changes only when a preemption sends a prefill back
        for head in self._admission_order(step):
            if not self.startable(head):
                continue
            need = kv.blocks_for(head.promised_len(self.capacity, head.num_known_tokens))
            admitted.append((head, need))
            taken += kv.blocks_to_admit(head, need)
            if self._room_for(len(admitted), taken, promised):
                continue
            if self.tenants.usage(running, admitted).get(head.tenant, 0.0) > 1.0:
                return  # its tenant would be over its share: it waits for its own sequences, not for another's
            while not self._room_for(len(admitted), taken, promised):
                victim = self.tenants.victim_for(head, running)
                if victim is None:
                    return
                self.preempt(victim)
                step.held_back.add(victim)
                self.counters.num_fair_share_preemptions += 1
                promised = self.promised_blocks()

    def _room_for(self, num_seqs: int, num_blocks: int, promised: int) -> bool:
        """Slots for `num_seqs` more sequences and `num_blocks` free blocks above the watermark and the
        `promised` ones (`promised_blocks`)."""
        return (len(self.queues.running) + num_seqs <= self.config.max_num_seqs
                and self.kv.can_allocate(num_blocks, reserved=promised))

    def schedule_decodes(self, step: StepDraft, budget: StepBudget) -> None:
        """Step 1: one token for every running sequence past its prefill, in rank order, preempting the
        lowest-ranked running sequences when a decode needs a block and none is free."""
        kv = self.kv
        for seq in list(self.queues.running):
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
            kv.allocate_slots(seq.block_table, pos, 1)
            self.shares.charge(seq.tenant, 1)
            step.decodes.append(ScheduledChunk(seq.seq_id, pos, 1, list(seq.block_table)))
            seq.num_computed_tokens = pos + 1
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            step.scheduled.add(seq)
            budget.charge_decode(pos)

    def bound_for_other_tenants(self, step: StepDraft, budget: StepBudget, behind_plans: bool) -> None:
        """Step 1b (tenants): once two tenants have had work on this worker, a step with no decode keeps the
        long cap, and its long chunks keep it within `tenant_wait_s` of predicted time, or wait for the next
        plan while one is in flight (`behind_plans`): another tenant's request waits behind at most that, not
        behind steps of the whole budget, two pipelined. While a tenant's streams are paused between turns, a
        step with no decode keeps the ITL target's bound of one stream (`TenantPlanner.stream_paused`). One
        tenant alone: nothing changes."""
        if len(self.shares.weight) < 2:
            return
        budget.hold_long_cap(self.config.tenant_wait_s or math.inf, behind_plans)
        window = self.config.paused_stream_s
        q = self.queues
        if window and self.tenants.stream_paused(step, budget, q.running, q.waiting, self.clock_s, window):
            budget.hold_for_paused_stream()

    def _preempt_for(self, seq: Sequence, num_tokens: int, step: StepDraft) -> bool:
        """Preempt the lowest-priority, latest-arrived running sequences (of the tenant furthest over its
        share, when tenants share the worker) until `seq`'s table can hold `num_tokens` positions. False if
        `seq` itself had to go."""
        kv, running = self.kv, self.queues.running
        while kv.num_new_blocks(seq.block_table, num_tokens) > kv.num_free_blocks:
            # never one already planned: those rank above `seq` (with tenants: they are left out)
            victim = self.tenants.victim(running, step) if self.shares.is_shared else running[-1]
            self.preempt(victim)
            step.preempted = True
            if victim is seq:
                return False
        return True

    def reserve_head_of_queue(self, step: StepDraft, budget: StepBudget) -> None:
        """The starvation rule: if the head of the waiting queue can be admitted now, reserve it
        min(its prefill's cost, max(half of what decodes left, one token's cost)). With tenants, a short prompt
        heading the queue beside another tenant's long prompts keeps the ITL target's bound of one stream on
        the step it starts in (`TenantPlanner.starts_beside_long_prompts`), and the prefill budget is split."""
        step.head = head = next((s for s in self._admission_order(step) if self.startable(s)), None)
        step.head_admitted = self.config.enable_chunked_prefill and head is not None and self._can_admit(head, step)
        if self.shares.is_shared:
            q = self.queues
            if step.head_admitted and self.tenants.starts_beside_long_prompts(head, budget, q.running):
                budget.hold_for_paused_stream()
            self.tenants.split_prefill_budget(step, budget, q.waiting, q.running, self.startable, self._overdue)
        if step.head_admitted:
            horizon = budget.horizon
            whole = chunk_cost(0, head.num_known_tokens, horizon)
            budget.head_reserve = min(whole, max(math.ceil(budget.left / 2), chunk_cost(0, 1, horizon)))

    def schedule_prefill_chunks(self, step: StepDraft, budget: StepBudget) -> None:
        """Step 2a: the next chunks of partially-prefilled sequences, short prompts before long ones (each
        in rank order), in what is left of the budget after the head's reserve (none exist with chunking
        off)."""
        allow = budget.left - budget.head_reserve
        streaming = self._streaming(step)
        # short first: under a tight ITL target a long prompt would otherwise take a short one's room
        prefilling = [s for s in self.queues.running if s.is_prefilling and s not in step.scheduled]
        for seq in sorted(prefilling, key=lambda s: budget.is_long(s.num_prefill_computed)):
            start = seq.num_computed_tokens
            room = (len(seq.block_table) + self.kv.num_free_blocks) * self.config.block_size - start
            overdue = self._overdue(seq)
            mine = min(allow, self.tenants.allow(step, seq, budget))  # `allow` with one tenant
            n = min(seq.num_prefill_remaining, room,
                    budget.chunk_tokens(seq.num_prefill_computed, start, mine, overdue,
                                        self._floor_for(seq, streaming)))
            if (n <= 0 and step.is_empty and not step.head_admitted and room > 0
                    and not budget.waits_for_plans(seq.num_prefill_computed)):
                n = 1  # the step would be empty: progress even if one token costs more than the budget
            if n <= 0:
                continue  # no budget left, or decodes took its promised blocks (they will finish or preempt)
            self._plan_prefill(step, seq, n)
            cost = budget.charge_prefill(seq.num_prefill_computed, start, n)
            allow -= cost
            step.spend_tenant(seq, cost)
            step.past_itl_patience |= overdue and budget.targets(seq.num_prefill_computed)

    def admit_waiting(self, step: StepDraft, budget: StepBudget) -> None:
        """Step 2b: start waiting sequences FCFS by rank; the first that does not fit stops admission."""
        chunking = self.config.enable_chunked_prefill
        streaming = self._streaming(step)
        for seq in self._admission_order(step):
            if not self.startable(seq):
                continue
            need = seq.num_known_tokens
            if not self._can_admit(seq, step):
                break
            cached = 0 if seq.on_worker else len(self.kv.computed_blocks(seq)) * self.config.block_size
            if chunking:
                n = min(need - cached, budget.chunk_tokens(need - cached, cached,
                                                           min(budget.left, step.tenant_left(seq)),
                                                           floor=self._floor_for(seq, streaming)))
                if n <= 0:
                    if step.tenant_left(seq) <= 0:
                        continue  # its tenant used its part of this step; another tenant's may still start
                    if seq is not step.head or not step.head_admitted or budget.waits_for_plans(need - cached):
                        break
                    n = 1  # the head starts on this plan even when decodes used up the budget
            else:
                if chunk_cost(cached, need - cached, budget.horizon) > budget.left and step.prefills:
                    break  # whole prompts only; the first prefill of a step may exceed the budget
                n = need - cached
            self.queues.start(seq)
            seq.prefill_len = need
            seq.num_computed_tokens = 0
            seq.prefill_started_s = self.clock_s
            if not seq.on_worker:
                seq.kv_send = self.handoffs.new_send()
                seq.num_computed_tokens = seq.num_cached_tokens = self.kv.start_on_cached_prefix(seq)
                step.starts.append(seq.seq_start(seq.num_computed_tokens, seq.num_cached_tokens))
                seq.on_worker = True
            self._plan_prefill(step, seq, n)
            step.spend_tenant(seq, budget.charge_prefill(need - cached, cached, n))

    def plan_drafts(self, step: StepDraft, budget: StepBudget, step_id: int, step_costs: StepCosts | None) -> None:
        """Step 3: drafts for the decodes in what prefill left of the budget, in blocks nobody was promised
        (scheduler/draft_planner.py)."""
        if not self.drafts.max_drafts or not step.decodes:
            return
        kv = self.kv
        spare = kv.num_free_blocks - kv.watermark_blocks - self.promised_blocks()
        self.drafts.plan(step, budget, kv, spare, self.queues.seqs, step_id, step_costs)

    def note_itl_target(self, budget: StepBudget) -> None:
        """Count the steps whose prefill the ITL target held back while prompts waited for it."""
        q = self.queues
        if budget.held_by_target and (q.waiting or any(s.is_prefilling for s in q.running)):
            self.counters.num_steps_held_by_itl_target += 1

    # ------------------------------------------------------------------ what the steps share

    def _can_admit(self, seq: Sequence, step: StepDraft) -> bool:
        """A free max_num_seqs slot, no preemption in this step, and blocks for the whole prefill (+ the
        first decode) above the watermark and the blocks promised to partially-prefilled sequences."""
        need = self.kv.blocks_for(seq.promised_len(self.capacity, seq.num_known_tokens))
        return not step.preempted and self._room_for(1, self.kv.blocks_to_admit(seq, need), self.promised_blocks())

    def _plan_prefill(self, step: StepDraft, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.kv.allocate_slots(seq.block_table, start, n)
        self.shares.charge(seq.tenant, n)
        step.prefills.append(ScheduledChunk(seq.seq_id, start, n, list(seq.block_table)))
        seq.num_computed_tokens = start + n
        if seq.num_computed_tokens == seq.prefill_len:  # the worker samples at the end of its known tokens
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            seq.awaiting_handoff = seq.kv_send is not None
        step.scheduled.add(seq)

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Send a running sequence back to wait, to be recomputed (`count`: a preemption, not a resync)."""
        self.queues.send_back(seq)
        if count:
            seq.num_preemptions += 1
            self.counters.num_preemptions += 1
            log.info("preempted by recompute", seq_id=seq.seq_id, outputs=len(seq.output_ids),
                     free_blocks=self.kv.num_free_blocks)

    def _admission_order(self, step: StepDraft) -> list[Sequence]:
        """The waiting queue in the order admission tries it: (priority, arrival) with one tenant; with
        several, weighted fair order (scheduler/tenant_planner.py)."""
        q = self.queues
        return self.tenants.admission_order(q.waiting, q.running, step) if self.shares.is_shared else list(q.waiting)

    def startable(self, seq: Sequence) -> bool:
        # an in-flight sample would be missing from the SeqStart; a pending release would reach the worker in
        # the same plan as the start; one whose next block another sequence is computing now starts on it
        # once it is confirmed (scheduler/kv_cache_manager.py)
        return (seq.num_inflight_samples == 0 and seq.seq_id not in self.queues.releases
                and not self.kv.waits_for_prefix(seq, self.queues.running))

    def _streaming(self, step: StepDraft) -> set[str]:
        """The tenants whose streams decode in this step (with one tenant, `_floor_for` does not ask)."""
        if not self.shares.is_shared:
            return set()
        seqs = self.queues.seqs
        return {seqs[c.seq_id].tenant for c in step.decodes}

    def _floor_for(self, seq: Sequence, streaming: set[str]) -> bool:
        """Whether `seq`'s long prompt moves at least a token beside the step's streams whatever the ITL target
        (`StepBudget.target_room`): always with one tenant, so its streams cannot starve its own prompts; with
        several, only beside streams of its own tenant. Beside another's, it gets what the target leaves: its
        tenant's share of the worker comes back when those streams pause, and its patience still runs."""
        return not self.shares.is_shared or seq.tenant in streaming

    def _overdue(self, seq: Sequence) -> bool:
        """The ITL target protects streams, it must not starve a prompt: beside few decodes its room is a few
        tokens a step, and long prompts prefilling one after another would wait past the gateway's progress
        timeout. One that has prefilled for `itl_patience_s` of predicted step time is no longer held by it."""
        return self.clock_s - seq.prefill_started_s >= self.config.itl_patience_s

    def promised_blocks(self) -> int:
        """Blocks partially-prefilled sequences will still take to finish their prefill."""
        return sum(self.kv.num_promised_blocks(s, self.capacity) for s in self.queues.running)
