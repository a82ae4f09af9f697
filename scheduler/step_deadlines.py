"""Step deadlines, pure: how long a step may go without a result, and giving up the steps that overran
theirs (their plan or result was lost; a hung worker is retired by its heartbeat before this)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from phaseserve.wire import StepPlan
from phaseserve.scheduler.cluster_stats import ClusterCounters
from phaseserve.scheduler.step_cost import step_deadline
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")


@dataclass(frozen=True)
class StepTimeouts:
    """A step's deadline (the worker's relay withdraws the heartbeat of a model that overruns it)."""

    base_s: float  # --step-timeout
    # once a worker's step costs are learned, a step's deadline is this factor times its predicted time,
    # never below the floor: a frozen model is found in seconds, not after --step-timeout
    floor_s: float
    factor: float
    max_num_batched_tokens: int
    # the relay gives up on a step after its timeout; the scheduler waits this much longer, so the worker's
    # heartbeat is withdrawn (a hung model: retire) before the step is given up (a lost message)
    margin_s: float

    @property
    def step_timeout(self) -> float:
        """How long a step of at most the budget may go without a result before it is given up."""
        return self.base_s + self.margin_s

    def plan_timeout(self, plan: StepPlan, expected_s: float | None = None) -> float:
        """From what the worker's learned step costs expect of the plan when there are some (step_deadline),
        else --step-timeout, scaled for a step larger than the token budget (chunked prefill off)."""
        fallback = self.base_s * max(1.0, plan.num_tokens / self.max_num_batched_tokens)
        return step_deadline(expected_s, floor_s=self.floor_s, factor=self.factor, fallback_s=fallback)


def give_up_overdue_steps(slots: list[WorkerSlot], counters: ClusterCounters, now: float) -> float | None:
    """Steps whose deadline passed with no result: their plan or result was lost. Returns seconds until the
    next deadline, or None."""
    nearest = None
    for slot in slots:
        while True:
            deadline = slot.head_deadline()
            if deadline is None:
                break
            if deadline > now:
                nearest = deadline - now if nearest is None else min(nearest, deadline - now)
                break
            step_id, _sent, timeout = slot.in_flight.popleft()
            slot.head_since = now
            counters.num_steps_given_up += 1
            log.warning("step overran its deadline; giving it up", worker_id=slot.info.worker_id,
                        step_id=step_id, timeout_s=timeout)
            slot.policy.drop_step(step_id)
            counters.dirty = True
    return nearest


def void_unsent_plans(workers: dict[str, WorkerSlot], planned_before: dict[str, int]) -> None:
    """The plans of a turn whose pipeline failed probably never reached their workers: give each up as
    soon as it is the worker's oldest (its deadline 0) instead of at the step timeout, so an outage
    stalls streams for its own length, not for --step-timeout. A plan that did arrive is harmless: its
    late result is dropped like any given-up step's, its tokens by offset."""
    for wid, n in planned_before.items():
        slot = workers.get(wid)
        if slot is None:
            continue
        for i in range(n, len(slot.in_flight)):
            step_id, sent_at, _timeout = slot.in_flight[i]
            slot.in_flight[i] = (step_id, sent_at, 0.0)
