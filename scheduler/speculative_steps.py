"""The part of `WorkerPolicy` that lets a step's decodes speculate, and settles what the worker kept. No I/O.

A plan is built before the results of the plans in flight are known, and with speculation those results
move each sequence by a number of positions the scheduler cannot know: so it tracks the highest position a
sequence can have reached (`num_computed_tokens`), allocates blocks and charges the budget for that, and
sends with each speculative decode how far below it the sequence may really be (`ScheduledChunk.slack`, the
drafts still in flight). The worker, which owns the tokens, runs the decode where the sequence is. When a
result says how many drafts were kept, the bound comes down by those rejected; the blocks they were given
stay in the table for the positions that follow (docs/speculative.md, "Plans in flight").
"""

from __future__ import annotations

from phaseserve.wire import ScheduledChunk, TokenEvent
from scheduler.budget import StepBudget, StepDraft, chunk_cost
from scheduler.sequence import Sequence, SequenceStatus
from phaseserve.wire import StepResult
from scheduler.speculation import DraftCandidate, SpeculationStats, VerifyCost, choose_drafts, fixed_drafts
from scheduler.step_cost import DEFAULT_PRIOR


class SpeculativeSteps:
    """Mixed into `WorkerPolicy`: drafts for a step's decodes (`_plan_drafts`, after prefill has taken its
    share of the step), and their outcome (`_settle_drafts`)."""

    spec_stats: SpeculationStats
    verify_cost: VerifyCost

    def _plan_drafts(self, step: StepDraft, budget: StepBudget) -> None:
        k_max = self.config.speculative_tokens
        if not k_max or not step.decodes:
            return
        bm = self.block_manager
        bs = self.config.block_size
        # drafts take no block promised to a prefill nor any below the watermark: they must never preempt
        spare = bm.num_free_blocks - bm.watermark_blocks - self._promised_blocks()
        candidates = []
        for i, c in enumerate(step.decodes):
            seq = self._seqs.get(c.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            pos = c.start_pos
            limit = min(k_max, seq.request.params.max_tokens - seq.num_planned_outputs,
                        self.config.max_model_len - pos - 1,
                        (len(seq.block_table) + max(spare, 0)) * bs - pos - 1)
            acc = seq.acceptance
            candidates.append(DraftCandidate(i, pos, max(limit, 0), acc.rate, acc.fill))
        if self.config.speculative_adaptive:
            costs = self.step_costs if self.step_costs is not None and self.step_costs.is_plausible else None
            overhead = (costs or DEFAULT_PRIOR).overhead_units
            chosen = choose_drafts(candidates, step_units=overhead + budget.decode_units,
                                   step_tokens=len(step.decodes), chunk_units=self.verify_cost.units,
                                   horizon=budget.horizon, budget_units=max(budget.cap_left, 0.0))
        else:
            chosen = fixed_drafts(candidates)
        for cand in candidates:
            c = step.decodes[cand.key]
            seq = self._seqs[c.seq_id]
            k = chosen.get(cand.key, 0)
            if k:
                spare -= bm.num_new_blocks(seq.block_table, c.start_pos + 1 + k)
                if spare < 0:  # candidates were offered the same spare blocks: the later ones get fewer
                    k = max(0, len(seq.block_table) * bs - c.start_pos - 1)
                    spare = 0
            if not k:
                seq.acceptance.rest()
                if seq.num_inflight_drafts:  # its start is the highest it can be: say how far below it may be
                    step.decodes[cand.key] = ScheduledChunk(c.seq_id, c.start_pos, 1, c.block_table,
                                                            slack=seq.num_inflight_drafts)
                continue
            bm.append(seq.block_table, c.start_pos + 1, k)
            step.decodes[cand.key] = ScheduledChunk(c.seq_id, c.start_pos, 1, list(seq.block_table), num_draft=k,
                                                    slack=seq.num_inflight_drafts)
            seq.num_computed_tokens += k
            seq.num_inflight_drafts += k
            seq.drafts_in_step[self._next_step_id] = k
            self.spec_stats.num_draft_slots += k
            cost = chunk_cost(c.start_pos + 1, k, budget.horizon) + self.verify_cost.units
            budget.cap_left -= cost
            budget.decode_units += cost

    def _learn_verify_cost(self, result: StepResult) -> None:
        """What a step's verifications cost beyond their tokens: its measured time against the learned costs'
        prediction for what it ran."""
        costs = self.step_costs
        if costs is None or not costs.is_plausible or len(result.ran) != 3 or result.step_time_s <= 0:
            return
        tokens, keys, prefills = result.ran
        predicted = costs.predict(tokens, keys, prefills)
        verifications = sum(1 for n in result.drafted.values() if n)
        self.verify_cost.observe(result.step_time_s - predicted, verifications, costs.token_s)

    def _settle_drafts(self, seq: Sequence, step_id: int, ev: TokenEvent | None, drafted: int = 0) -> None:
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
            self.spec_stats.observe(drafted, kept)
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= k - kept
