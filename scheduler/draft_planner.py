"""Speculative decoding in a worker's plans: which decodes of a step get drafts, and settling what the worker
kept. No I/O; the rule itself is scheduler/draft_rule.py.

A plan is built before the results of the plans in flight are known, and with speculation those results
move each sequence by a number of positions the scheduler cannot know: so it tracks the highest position a
sequence can have reached (`num_computed_tokens`), allocates blocks and charges the budget for that, and
sends with each speculative decode how far below it the sequence may really be (`ScheduledChunk.slack`, the
drafts still in flight). The worker, which owns the tokens, runs the decode where the sequence is. When a
result says how many drafts were kept, the bound comes down by those rejected; the blocks they were given
stay in the table for the positions that follow (docs/speculative.md, "Plans in flight").
"""

from __future__ import annotations

from collections.abc import Mapping

from phaseserve.scheduler_stats import SpecDecodingStats
from phaseserve.wire import ScheduledChunk, StepResult, TokenEvent
from phaseserve.scheduler.budget import StepBudget, StepDraft, chunk_cost
from phaseserve.scheduler.config import SchedulerConfig
from phaseserve.scheduler.draft_rule import DraftCandidate, VerifyCost, choose_drafts, fixed_drafts
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.sequence import Sequence, SequenceStatus
from phaseserve.scheduler.step_cost import DEFAULT_PRIOR, StepCosts


class DraftPlanner:
    """Drafts for a step's decodes (`plan`, after prefill has taken its share of the step), their outcome
    (`settle`), the learned extra cost of a verification, and the counters of it all."""

    def __init__(self, config: SchedulerConfig):
        self.max_drafts = config.speculative_tokens
        self.adaptive = config.speculative_adaptive
        self.max_model_len = config.max_model_len
        self.stats = SpecDecodingStats()
        self.verify_cost = VerifyCost()

    def plan(self, step: StepDraft, budget: StepBudget, kv: KVCacheManager, spare: int,
             seqs: Mapping[str, Sequence], step_id: int, step_costs: StepCosts | None) -> None:
        """Give the step's decodes drafts within `spare` blocks (free, less the watermark and the blocks
        promised to prefills: drafts must never preempt) and what is left of `budget`."""
        if not self.max_drafts or not step.decodes:
            return
        bs = kv.block_size
        candidates = []
        for i, c in enumerate(step.decodes):
            seq = seqs.get(c.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            pos = c.start_pos
            limit = min(self.max_drafts, seq.request.params.max_tokens - seq.num_planned_outputs,
                        self.max_model_len - pos - 1, (len(seq.block_table) + max(spare, 0)) * bs - pos - 1)
            acc = seq.acceptance
            candidates.append(DraftCandidate(i, pos, max(limit, 0), acc.rate, acc.fill))
        if self.adaptive:
            costs = step_costs if step_costs is not None and step_costs.is_plausible else None
            overhead = (costs or DEFAULT_PRIOR).overhead_units
            chosen = choose_drafts(candidates, step_units=overhead + budget.decode_units,
                                   step_tokens=len(step.decodes), chunk_units=self.verify_cost.units,
                                   horizon=budget.horizon, budget_units=max(budget.cap_left, 0.0))
        else:
            chosen = fixed_drafts(candidates)
        for cand in candidates:
            c = step.decodes[cand.key]
            seq = seqs[c.seq_id]
            k = chosen.get(cand.key, 0)
            if k:
                spare -= kv.num_new_blocks(seq.block_table, c.start_pos + 1 + k)
                if spare < 0:  # candidates were offered the same spare blocks: the later ones get fewer
                    k = max(0, len(seq.block_table) * bs - c.start_pos - 1)
                    spare = 0
            if not k:
                seq.acceptance.rest()
                if seq.num_inflight_drafts:  # its start is the highest it can be: say how far below it may be
                    step.decodes[cand.key] = ScheduledChunk(c.seq_id, c.start_pos, 1, c.block_table,
                                                            slack=seq.num_inflight_drafts)
                continue
            kv.allocate_slots(seq.block_table, c.start_pos + 1, k)
            step.decodes[cand.key] = ScheduledChunk(c.seq_id, c.start_pos, 1, list(seq.block_table), num_draft=k,
                                                    slack=seq.num_inflight_drafts)
            seq.num_computed_tokens += k
            seq.num_inflight_drafts += k
            seq.drafts_in_step[step_id] = k
            self.stats.num_draft_slots += k
            cost = chunk_cost(c.start_pos + 1, k, budget.horizon) + self.verify_cost.units
            budget.cap_left -= cost
            budget.decode_units += cost

    def learn_verify_cost(self, result: StepResult, step_costs: StepCosts | None) -> None:
        """What a step's verifications cost beyond their tokens: its measured time against the learned costs'
        prediction for what it ran."""
        if step_costs is None or not step_costs.is_plausible or len(result.ran) != 3 or result.step_time_s <= 0:
            return
        tokens, keys, prefills = result.ran
        predicted = step_costs.predict(tokens, keys, prefills)
        verifications = sum(1 for n in result.drafted.values() if n)
        self.verify_cost.observe(result.step_time_s - predicted, verifications, step_costs.token_s)

    def settle(self, seq: Sequence, step_id: int, ev: TokenEvent | None, drafted: int = 0) -> None:
        """A step planned to speculate for `seq` reported `ev` after verifying `drafted` drafts (None: no event,
        or the step was lost)."""
        k = seq.drafts_in_step.pop(step_id, 0)
        if not k:
            return
        seq.num_inflight_drafts -= k
        if ev is None or ev.error:
            return  # recomputed or gone: its position starts afresh
        kept = max(len(ev.token_ids) - 1, 0)  # drafts kept (a finish inside the run counts those before it)
        seq.acceptance.observe(drafted, kept)
        if drafted:
            self.stats.observe(drafted, kept)
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= k - kept
