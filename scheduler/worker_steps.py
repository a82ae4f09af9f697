"""Steps between the scheduler and its workers, pure: the next plans that fill each worker's pipeline, and a
step's result applied (its step closed, its policy fed, its finished prefills handed off, its confirmed
outputs recorded). Each worker's step time is learned from its results here, and sampled for the live view
while someone watches."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from phaseserve.stack_view import StepSample
from phaseserve.step_shape import step_shape
from phaseserve.wire import StepPlan, StepResult
from phaseserve.scheduler.cluster_stats import ClusterCounters
from phaseserve.scheduler.handoff_routing import HandoffRouter
from phaseserve.scheduler.membership import Membership
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.step_cost import ItlTarget
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")

STEP_COST_LOG_EVERY = 512  # steps between log lines of a worker's learned step costs


@dataclass
class WorkerSteps:
    membership: Membership
    book: RequestBook
    handoffs: HandoffRouter
    counters: ClusterCounters
    itl_target: ItlTarget  # for the step-cost log line
    watched: bool = False  # a live view is open (the service says): steps are sampled for it

    def plan(self, now: float, epoch: int, plans_in_flight: int, timeout_of: Callable, deadline_margin: float,
             plan_ahead_s: float = math.inf) -> list[tuple[str, StepPlan]]:
        """The next plans, filling every worker's pipeline to `plans_in_flight`, as (worker id, plan) for the
        caller to send; each is in flight from now. `timeout_of(plan, expected_s)` is a plan's deadline.
        A worker whose plans in flight are predicted to keep it busy for `plan_ahead_s` gets no more: the next
        is planned when a result comes, with the requests that arrived meanwhile. The pipeline hides the
        round trip between a result and the next plan, a small part of so long a step, while every plan
        queued behind it is one more step a new request waits for."""
        plans = []
        for wid, slot in self.membership.workers.items():
            if not slot.takes_plans:  # a draining worker past its deadline, or told to go
                continue
            while (len(slot.in_flight) < plans_in_flight and slot.predicted_ahead_s() < plan_ahead_s
                   and (slot.policy.has_unfinished() or slot.needs_plan)):
                plan = slot.policy.schedule()
                slot.needs_plan = False
                if plan is None or not (plan.chunks or plan.starts or plan.releases):
                    break
                plan.epoch = epoch
                features = step_shape(plan.chunks)
                plan.timeout_s = timeout_of(plan, slot.step_costs.expected_bound(*features))
                slot.in_flight.append((plan.step_id, now, plan.timeout_s + deadline_margin))
                slot.plan_features[plan.step_id] = features
                if self.watched:
                    budget = slot.policy.last_budget
                    slot.plan_samples[plan.step_id] = StepSample(*slot.policy.last_split, 0.0, budget.predicted_s,
                                                                 budget.target_s)
                plans.append((wid, plan))
        if plans:
            self.counters.dirty = True
        return plans

    def apply_result(self, result: StepResult, epoch: int, now: float) -> None:
        """A worker's step result: close its step (and any older one it overtook), feed the policy, hand off
        finished prefills, and record confirmed outputs and finished requests."""
        slot = self.membership.workers.get(result.worker_id)
        open_ids = [entry[0] for entry in slot.in_flight] if slot is not None else []
        if result.epoch not in (0, epoch) or result.step_id not in open_ids:
            # an earlier scheduler's plan, a worker we gave up on, a step given up, or a duplicate
            log.debug("ignoring stale step result", worker_id=result.worker_id, step_id=result.step_id,
                      epoch=result.epoch)
            self.counters.num_stale_results += 1
            self.counters.dirty = True
            return
        # the worker runs plans in order: the open steps before this one lost their plan or result (the
        # policy recomputes what they sampled when it applies this result)
        while slot.in_flight[0][0] != result.step_id:
            lost = slot.in_flight.popleft()[0]
            self.counters.num_steps_given_up += 1
            log.warning("step result missing (a later one came first)", worker_id=result.worker_id, step_id=lost)
        slot.in_flight.popleft()
        slot.head_since = now
        self.learn_step_cost(slot, result)
        sample_step(slot, result, now)
        policy = slot.policy
        before = dict.fromkeys(ev.seq_id for ev in result.events if policy.outputs_of(ev.seq_id) is not None)
        finished = set(policy.update(result))
        if result.handoffs:
            self.handoffs.count_results(result)
        if result.grammar_masks:
            self.counters.add_grammar_masks(result.grammar_masks)
        self.handoffs.hand_off_ready(slot)
        for rid in before:
            if rid in finished:
                continue
            outputs = policy.outputs_of(rid)
            if outputs is not None:  # a takeover resumes here
                self.book.confirmed(rid, outputs)
        for rid in finished:
            self.book.finished(rid)
            reason = next((e.finish_reason for e in result.events if e.seq_id == rid and e.finish_reason), None)
            log.info("request finished", request_id=rid, finish_reason=reason, worker_id=result.worker_id)
        self.counters.dirty = True

    def learn_step_cost(self, slot: WorkerSlot, result: StepResult) -> None:
        """Feed the worker's measured step time, with what its plan held, to its cost model; the policy
        plans with the refitted costs from its next plan on."""
        features = slot.plan_features
        for step_id in [k for k in features if k < result.step_id]:  # given up or lost: no time to learn
            del features[step_id]
        planned = features.pop(result.step_id, None)
        if planned is None or any(e.error for e in result.events):
            return
        tokens, keys, prefill_chunks = result.ran if len(result.ran) == 3 else planned  # speculation: as run
        model = slot.step_costs
        model.observe(tokens, keys, result.step_time_s, prefill_chunks)
        slot.policy.step_costs = costs = model.costs
        if not prefill_chunks:
            slot.decode_step_costs.observe(tokens, keys, result.step_time_s)
            slot.policy.decode_step_costs = slot.decode_step_costs.costs
        if costs is not None and model.num_samples % STEP_COST_LOG_EVERY == model.min_samples % STEP_COST_LOG_EVERY:
            decode_only = slot.decode_step_costs.costs
            log.info("step costs learned", worker_id=slot.info.worker_id, steps=model.num_samples,
                     overhead_ms=round(costs.overhead_s * 1e3, 3), token_ms=round(costs.token_s * 1e3, 4),
                     key_us=round(costs.key_s * 1e6, 5), prefill_chunk_ms=round(costs.prefill_chunk_s * 1e3, 3),
                     horizon=round(costs.horizon),
                     measured_over_predicted_prefill=round(model.prefill_ratio, 3),
                     measured_over_predicted_decode=round(model.decode_ratio, 3),
                     decode_only_overhead_ms=decode_only and round(decode_only.overhead_s * 1e3, 3),
                     decode_only_token_ms=decode_only and round(decode_only.token_s * 1e3, 4),
                     itl_target=str(self.itl_target),
                     verify_units=(round(slot.policy.drafts.verify_cost.units, 2) if slot.info.speculative_tokens
                                   else None))


def sample_step(slot: WorkerSlot, result: StepResult, now: float) -> None:
    """The step's plan and measured time, for the live view (a speculative step as it ran)."""
    samples = slot.plan_samples
    if not samples:  # nobody watches
        return
    for step_id in [k for k in samples if k < result.step_id]:  # given up or lost
        del samples[step_id]
    sample = samples.pop(result.step_id, None)
    if sample is None:
        return
    sample.step_s = result.step_time_s
    if len(result.ran) == 3:  # speculation verified what the worker proposed, not what was allowed
        sample.decode_tokens = result.ran[0] - sample.prefill_tokens
    slot.recent_steps.append(sample)
    slot.last_step_at = now
