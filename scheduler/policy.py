"""One worker's scheduling policy: decode-first steps with chunked prefill over paged KV blocks. No I/O.

The scheduler service keeps one `WorkerPolicy` per live worker; `schedule()` states what every plan keeps.
Its step budget is scheduler/budget.py, a phase worker's handoffs scheduler/handoffs.py, and the reasoning
behind both docs/architecture.md, "The step budget".
"""

from __future__ import annotations

import bisect
import itertools
import math
import secrets

import structlog

from phaseserve.kv_admission import KVCapacity, promised_len
from phaseserve.wire import KVSend, ScheduledChunk, StepPlan, SubmitRequest
from scheduler.block_manager import BlockManager
from scheduler.budget import StepBudget, StepDraft, chunk_cost
from scheduler.config import AdmissionError, SchedulerConfig, out_of_vocab
from scheduler.fair_share import TenantShares, fair_order, most_over_share, weighted_split
from scheduler.handoffs import HandoffBookkeeping
from scheduler.prefix_caching import PrefixCacheBookkeeping
from scheduler.sequence import Sequence, SequenceStatus, by_rank
from scheduler.speculation import SpeculationStats, VerifyCost
from scheduler.speculative_steps import SpeculativeSteps
from scheduler.step_cost import StepCosts
from scheduler.step_results import StepResults

log = structlog.get_logger("scheduler.policy")

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING


class WorkerPolicy(StepResults, HandoffBookkeeping, PrefixCacheBookkeeping, SpeculativeSteps):
    """One worker's scheduling policy: its sequences, its KV block accounting, and the plans of its steps.
    It applies step results as scheduler/step_results.py says, and phase workers hand sequences over
    (scheduler/handoffs.py) while `kv_transport` is set. Sequences share cached prefixes as
    scheduler/prefix_caching.py says; decodes speculate as scheduler/speculative_steps.py says when the
    worker offers it."""

    def __init__(self, config: SchedulerConfig, worker_id: str = "local", first_step_id: int = 0,
                 transfer_prefix: str = "t"):
        self.config = config
        self.worker_id = worker_id
        self.kv_transport: str | None = None  # set by the service: stream prefills out for decode workers
        # unguessable: a shared-memory transfer's file is named by its id (workers/kv_transfer/shm_transport.py)
        self._transfer_ids = (f"{transfer_prefix}-{secrets.token_hex(12)}" for _ in itertools.count())
        self._ready_handoffs: list[Sequence] = []  # first token confirmed, waiting for the service
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.watermark,
                                          enable_prefix_caching=config.enable_prefix_caching)
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
        self._num_fair_share_preemptions = 0  # of those, made for a tenant under its share (docs/tenants.md)
        self.shares = TenantShares()  # tenants' virtual times and weights (scheduler/fair_share.py)
        self._num_resyncs = 0
        self._num_sat_out = 0  # steps a sequence sat out, its preparation on the worker not ready
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
        self.last_split = (0, 0, 0)  # the last plan's (decode tokens with drafts, prefill tokens, prefill chunks)
        self._num_steps_held_by_itl_target = 0
        self._num_steps_past_itl_patience = 0
        self._clock_s = 0.0  # the planned steps' predicted time, summed: what the ITL target's patience counts
        self._num_prefix_queries = 0  # prefill tokens of sequence (re)starts, and those found cached
        self._num_prefix_hits = 0
        self.spec_stats = SpeculationStats()
        self.verify_cost = VerifyCost()

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
        self.shares.join(seq.tenant, req.tenant_weight)
        bisect.insort(self._waiting, seq, key=by_rank)

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
        seqs = sorted(self._seqs.values(), key=by_rank)
        for seq in seqs:
            self._retire(seq)
        self._inflight.clear()
        return [(s.request, list(s.output_ids)) for s in seqs]

    def running_ids(self) -> set[str]:
        """The sequences holding blocks on the worker (prefilling or decoding): those in its steps."""
        return {s.seq_id for s in self._running}

    def quiet_progress(self) -> list[SubmitRequest]:
        """The sequences moving on without a token to show for it since the last call: waiting (queued, or
        preempted), prefilling with more positions computed than then (a long prompt's chunks; a chunk
        is planned only once the results of the plans before it came back, so a stuck worker stops this),
        and those the worker is still preparing (they sit out steps; its budget bounds that)."""
        marks, self._prefill_marks = self._prefill_marks, {}
        moving = [s.request for s in self._waiting]
        for seq in self._running:
            if seq.sat_out:
                moving.append(seq.request)
            elif seq.is_prefilling:
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
        """The next step's plan, or None when there is nothing to send.

        Every plan keeps these (docs/architecture.md, "The step budget", says why and how they are met):
        - Decodes first: every running sequence past its prefill gets one token, in (priority, arrival)
          order, and is never dropped for prefill; a decode short of a block preempts (by recompute) the
          lowest-ranked running sequence. Prefill takes what is left of the budget, partial prefills'
          chunks (short prompts first) before new sequences, admitted FCFS.
        - The head of the waiting queue starts on the next plan when a slot and its blocks are free, and a
          long prompt (or a step that would be empty) moves at least one token.
        - A sequence is admitted only with blocks for its whole prefill above the watermark and the blocks
          promised to partial prefills, never in a step that preempted, and never restarted while a sample
          of it is in flight (its SeqStart carries every token the worker published).
        - Speculation last (a worker that offers it): drafts for decodes in what prefill left of the budget,
          never a promised block, chosen as scheduler/speculation.py says (docs/speculative.md).
        - Tenants (only while more than one has work here; otherwise nothing above changes): the waiting queue
          is admitted, and prefill chunks get the budget, in weighted fair order on tokens, each tenant's own
          sequences in (priority, arrival) order; a preemption takes from the tenant furthest over its share
          of the KV blocks and slots, and a head of the queue whose tenant is under its share preempts one
          that is over it before decodes are planned (scheduler/fair_share.py, docs/tenants.md).
        """
        step = StepDraft()
        budget = StepBudget.for_step(self.config, self.step_costs)
        if self.shares.is_shared:
            self._make_room_for_fair_head(step)
        self._schedule_decodes(step, budget)
        self._reserve_head_of_queue(step, budget)
        self._schedule_prefill_chunks(step, budget)
        self._admit_waiting(step, budget)
        self._plan_drafts(step, budget)
        self._note_itl_target(budget)
        self._num_steps_past_itl_patience += step.past_itl_patience
        if not step.is_empty:  # a plan that runs: its predicted time passes for the prompts it holds back
            self._clock_s += budget.predicted_s
        return self._seal(step)

    def _note_itl_target(self, budget: StepBudget) -> None:
        """Count the steps whose prefill the ITL target held back while prompts waited for it."""
        self.last_budget = budget
        if budget.held_by_target and (self._waiting or any(s.is_prefilling for s in self._running)):
            self._num_steps_held_by_itl_target += 1

    def _schedule_decodes(self, step: StepDraft, budget: StepBudget) -> None:
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
            self.shares.charge(seq.tenant, 1)
            step.decodes.append(ScheduledChunk(seq.seq_id, pos, 1, list(seq.block_table)))
            seq.num_computed_tokens = pos + 1
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            step.scheduled.add(seq)
            budget.charge_decode(pos)

    def _preempt_for(self, seq: Sequence, num_tokens: int, step: StepDraft) -> bool:
        """Preempt the lowest-priority, latest-arrived running sequences (of the tenant furthest over its
        share, when tenants share the worker) until `seq`'s table can hold `num_tokens` positions. False if
        `seq` itself had to go."""
        bm = self.block_manager
        while bm.num_new_blocks(seq.block_table, num_tokens) > bm.num_free_blocks:
            # never one already planned: those rank above `seq` (with tenants: they are left out)
            victim = self._fair_victim(step) if self.shares.is_shared else self._running[-1]
            self._preempt(victim)
            step.preempted = True
            if victim is seq:
                return False
        return True

    def _reserve_head_of_queue(self, step: StepDraft, budget: StepBudget) -> None:
        """The starvation rule: if the head of the waiting queue can be admitted now, reserve it
        min(its prefill's cost, max(half of what decodes left, one token's cost))."""
        step.head = next((s for s in self._admission_order(step) if self._startable(s)), None)
        if self.shares.is_shared:
            self._split_prefill_budget(step, budget)
        head = step.head
        step.head_admitted = self.config.enable_chunked_prefill and head is not None and self._can_admit(head, step)
        if step.head_admitted:
            horizon = budget.horizon
            whole = chunk_cost(0, head.num_prompt_tokens + len(head.output_ids), horizon)
            budget.head_reserve = min(whole, max(math.ceil(budget.left / 2), chunk_cost(0, 1, horizon)))

    def _schedule_prefill_chunks(self, step: StepDraft, budget: StepBudget) -> None:
        """Step 2a: the next chunks of partially-prefilled sequences, short prompts before long ones (each
        in rank order), in what is left of the budget after the head's reserve (none exist with chunking
        off)."""
        bm = self.block_manager
        allow = budget.left - budget.head_reserve
        # short first: under a tight ITL target a long prompt would otherwise take a short one's room
        prefilling = [s for s in self._running if s.is_prefilling and s not in step.scheduled]
        for seq in sorted(prefilling, key=lambda s: budget.is_long(s.num_prefill_computed)):
            start = seq.num_computed_tokens
            room = (len(seq.block_table) + bm.num_free_blocks) * self.config.block_size - start
            overdue = self._overdue(seq)
            mine = min(allow, self._tenant_allow(step, seq, budget))  # `allow` with one tenant
            n = min(seq.num_prefill_remaining, room,
                    budget.chunk_tokens(seq.num_prefill_computed, start, mine, overdue))
            if n <= 0 and step.is_empty and not step.head_admitted and room > 0:
                n = 1  # the step would be empty: progress even if one token costs more than the budget
            if n <= 0:
                continue  # no budget left, or decodes took its promised blocks (they will finish or preempt)
            self._plan_prefill(step, seq, n)
            cost = budget.charge_prefill(seq.num_prefill_computed, start, n)
            allow -= cost
            step.spend_tenant(seq, cost)
            step.past_itl_patience |= overdue and budget.targets(seq.num_prefill_computed)

    def _admit_waiting(self, step: StepDraft, budget: StepBudget) -> None:
        """Step 2b: start waiting sequences FCFS by rank; the first that does not fit stops admission."""
        chunking = self.config.enable_chunked_prefill
        for seq in self._admission_order(step):
            if not self._startable(seq):
                continue
            need = seq.num_prompt_tokens + len(seq.output_ids)
            if not self._can_admit(seq, step):
                break
            cached = 0 if seq.on_worker else len(self.cached_prefix(seq)) * self.config.block_size
            if chunking:
                n = min(need - cached, budget.chunk_tokens(need - cached, cached,
                                                           min(budget.left, step.tenant_left(seq))))
                if n <= 0:
                    if step.tenant_left(seq) <= 0:
                        continue  # its tenant used its part of this step; another tenant's may still start
                    if seq is not step.head or not step.head_admitted:
                        break
                    n = 1  # the head starts on this plan even when decodes used up the budget
            else:
                if chunk_cost(cached, need - cached, budget.horizon) > budget.left and step.prefills:
                    break  # whole prompts only; the first prefill of a step may exceed the budget
                n = need - cached
            self._waiting.remove(seq)
            seq.status = RUNNING
            seq.prefill_len = need
            seq.num_computed_tokens = 0
            seq.prefill_started_s = self._clock_s
            bisect.insort(self._running, seq, key=by_rank)
            if not seq.on_worker:
                if self.kv_transport is not None:  # a new transfer for each (re)start: ids are single-use
                    seq.kv_send = KVSend(next(self._transfer_ids), self.kv_transport)
                seq.num_computed_tokens = seq.num_cached_tokens = self._start_on_cached_prefix(seq)
                step.starts.append(seq.seq_start(seq.num_computed_tokens, seq.num_cached_tokens))
                seq.on_worker = True
            self._plan_prefill(step, seq, n)
            step.spend_tenant(seq, budget.charge_prefill(need - cached, cached, n))

    def _can_admit(self, seq: Sequence, step: StepDraft) -> bool:
        """A free max_num_seqs slot, no preemption in this step, and blocks for the whole prefill (+ the
        first decode) above the watermark and the blocks promised to partially-prefilled sequences."""
        bm = self.block_manager
        need = bm.blocks_for(self._promised_len(seq, seq.num_prompt_tokens + len(seq.output_ids)))
        return (not step.preempted and len(self._running) < self.config.max_num_seqs
                and bm.can_allocate(self._blocks_to_admit(seq, need), reserved=self._promised_blocks()))

    def _plan_prefill(self, step: StepDraft, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.block_manager.append(seq.block_table, start, n)
        self.shares.charge(seq.tenant, n)
        step.prefills.append(ScheduledChunk(seq.seq_id, start, n, list(seq.block_table)))
        seq.num_computed_tokens = start + n
        if seq.num_computed_tokens == seq.prefill_len:  # the worker samples at the end of its known tokens
            seq.num_inflight_samples += 1
            step.sampled.append(seq)
            seq.awaiting_handoff = seq.kv_send is not None
        step.scheduled.add(seq)

    def _seal(self, step: StepDraft) -> StepPlan | None:
        """The plan of a drafted step, with the pending releases; None when there is nothing to send."""
        if step.is_empty and not self._releases:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._inflight[step_id] = step.sampled  # every plan gets a result, even one with nothing to sample
        releases, self._releases = self._releases, []
        self._num_decode_tokens += len(step.decodes)
        prefill_tokens = sum(c.num_tokens for c in step.prefills)
        self._num_prefill_tokens += prefill_tokens
        self.last_split = (sum(c.num_tokens for c in step.decodes), prefill_tokens, len(step.prefills))
        return StepPlan(step_id, self.worker_id, step.starts, step.decodes + step.prefills, releases,
                        receives=step.receives)

    # ------------------------------------------------------------------ state changes

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.prefill_len = 0
        seq.num_named_blocks = 0
        seq.kv_send, seq.kv_receive, seq.awaiting_handoff = None, None, False  # a recompute starts afresh
        if seq.on_worker:
            self._releases.append(seq.seq_id)
            seq.on_worker = False
        bisect.insort(self._waiting, seq, key=by_rank)
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
            self.shares.leave(seq.tenant)

    # ------------------------------------------------------------------ tenants (scheduler/fair_share.py)

    def _admission_order(self, step: StepDraft) -> list[Sequence]:
        """The waiting queue in the order admission tries it: (priority, arrival) with one tenant; with
        several, weighted fair order on prefill tokens (each tenant's own in (priority, arrival) order),
        without the sequences a fair-share preemption sent back in this step."""
        if not self.shares.is_shared:
            return list(self._waiting)
        waiting = [s for s in self._waiting if s not in step.held_back]
        return fair_order(waiting, _tenant_of, self.shares.vtime, self.shares.weight, _prefill_tokens,
                          self._tenant_usage())

    def _tenant_allow(self, step: StepDraft, seq: Sequence, budget: StepBudget) -> float:
        """What a partial prefill of `seq`'s tenant may take: its tenant's room, less the head's reserve when
        the head of the queue is the same tenant's (the head's start is kept within its tenant's part)."""
        left = step.tenant_left(seq)
        if step.head is not None and step.head_admitted and step.head.tenant == seq.tenant:
            left -= budget.head_reserve
        return left

    def _split_prefill_budget(self, step: StepDraft, budget: StepBudget) -> None:
        """What each tenant's prefill chunks may take of what decodes left this step: max-min fair shares by
        weight of the cost of what each has to prefill (its partial prefills' rest, its startable waiting
        prompts'), so a tenant with little to do gets all of it and the rest is split by weight."""
        horizon = budget.horizon
        demand: dict[str, float] = {}
        for s in self._running:
            if s.is_prefilling and s not in step.scheduled:
                demand[s.tenant] = demand.get(s.tenant, 0.0) + chunk_cost(s.num_computed_tokens,
                                                                          s.num_prefill_remaining, horizon)
        for s in self._waiting:
            if s not in step.held_back and self._startable(s):
                demand[s.tenant] = demand.get(s.tenant, 0.0) + chunk_cost(0, _prefill_tokens(s), horizon)
        if len(demand) > 1:
            step.tenant_room = weighted_split(max(budget.left, 0.0), demand, self.shares.weight)

    def _tenant_usage(self, extra: Sequence | None = None, extra_blocks: int = 0) -> dict[str, float]:
        """Each busy tenant's holding over its weighted share: the larger of its KV blocks' and its
        sequence slots' (with `extra` counted as admitted with `extra_blocks` more)."""
        blocks: dict[str, float] = {}
        slots: dict[str, float] = {}
        for s in self._running:
            blocks[s.tenant] = blocks.get(s.tenant, 0) + len(s.block_table)
            slots[s.tenant] = slots.get(s.tenant, 0) + 1
        if extra is not None:
            blocks[extra.tenant] = blocks.get(extra.tenant, 0) + extra_blocks
            slots[extra.tenant] = slots.get(extra.tenant, 0) + 1
        by_blocks = self.shares.usage(blocks, self.block_manager.num_blocks)
        by_slots = self.shares.usage(slots, self.config.max_num_seqs)
        return {t: max(by_blocks[t], by_slots[t]) for t in by_blocks}

    def _fair_victim(self, step: StepDraft) -> Sequence:
        """The lowest-ranked running sequence, not planned in this step, of the tenant furthest over its share."""
        candidates = [s for s in self._running if s not in step.scheduled]
        tenant = most_over_share(self._tenant_usage(), (s.tenant for s in candidates))
        return next(s for s in reversed(candidates) if s.tenant == tenant)

    def _make_room_for_fair_head(self, step: StepDraft) -> None:
        """Step 0 (tenants): when the first startable sequence in fair order cannot be admitted for want of a
        slot or blocks, and its tenant would stay within its share with it, preempt the lowest-ranked
        sequences of the tenants over their share, furthest first, until it can. They wait behind it, and
        not for this step (`held_back`): a burst of one tenant cannot hold another's requests back."""
        head = next((s for s in self._admission_order(step) if self._startable(s)), None)
        if head is None or self._can_admit(head, step):
            return
        bm = self.block_manager
        need = bm.blocks_for(self._promised_len(head, head.num_prompt_tokens + len(head.output_ids)))
        if self._tenant_usage(head, need).get(head.tenant, 0.0) > 1.0:
            return  # its own tenant is at its share: it waits for its own sequences, not for another's
        while not self._can_admit(head, step):
            usage = self._tenant_usage()
            over = {s.tenant for s in self._running if s.tenant != head.tenant and usage.get(s.tenant, 0.0) > 1.0}
            tenant = most_over_share(usage, over)
            if tenant is None:
                return
            victim = next(s for s in reversed(self._running) if s.tenant == tenant)
            self._preempt(victim)
            step.held_back.add(victim)
            self._num_fair_share_preemptions += 1

    # ------------------------------------------------------------------ helpers

    def _startable(self, seq: Sequence) -> bool:
        # an in-flight sample would be missing from the SeqStart; a pending release would
        # reach the worker in the same plan as the start; one whose next block another sequence is
        # computing now starts on it once it is confirmed (scheduler/prefix_caching.py)
        return (seq.num_inflight_samples == 0 and seq.seq_id not in self._releases
                and not self._waits_for_prefix(seq))

    def _overdue(self, seq: Sequence) -> bool:
        """The ITL target protects streams, it must not starve a prompt: beside few decodes its room is a few
        tokens a step, and long prompts prefilling one after another would wait past the gateway's progress
        timeout. One that has prefilled for `itl_patience_s` of predicted step time is no longer held by it."""
        return self._clock_s - seq.prefill_started_s >= self.config.itl_patience_s

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
    def num_sat_out(self) -> int:
        return self._num_sat_out

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_fair_share_preemptions(self) -> int:
        return self._num_fair_share_preemptions

    @property
    def num_steps_held_by_itl_target(self) -> int:
        return self._num_steps_held_by_itl_target

    @property
    def num_steps_past_itl_patience(self) -> int:
        return self._num_steps_past_itl_patience

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_handoffs_in_flight(self) -> int:
        """Sequences whose KV is moving: prefilled here for a decode worker, or handed in and not yet applied."""
        return sum(1 for s in self._running if s.awaiting_handoff or s.kv_receive is not None)

    def running_sequences(self) -> list[Sequence]:
        return list(self._running)

    def unprefilled(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, tokens to prefill, of them computed or planned) of the waiting sequences and those part
        way through their prefill, in rank order of each."""
        return ([(s, s.num_prompt_tokens + len(s.output_ids), 0) for s in self._waiting]
                + [(s, s.prefill_len, s.num_computed_tokens) for s in self._running if s.is_prefilling])

    def stats(self) -> dict:
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "num_preemptions": self._num_preemptions,
            "num_fair_share_preemptions": self._num_fair_share_preemptions,
            "num_resyncs": self._num_resyncs,
            "num_sat_out": self._num_sat_out,
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
            "num_steps_past_itl_patience": self._num_steps_past_itl_patience,
            "prefix_cache_queries": self._num_prefix_queries,
            "prefix_cache_hits": self._num_prefix_hits,
            "prefix_cache_evictions": self.block_manager.num_evictions,
            "num_cached_blocks": self.block_manager.num_cached_blocks,
            **self.spec_stats.as_stats(),
        }


def _tenant_of(seq: Sequence) -> str:
    return seq.tenant


def _prefill_tokens(seq: Sequence) -> int:
    return seq.num_prompt_tokens + len(seq.output_ids)
