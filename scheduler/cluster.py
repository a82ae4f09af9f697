"""The cluster: every decision the scheduler makes between its workers, pure. No Redis and no asyncio: plain
data in, and out the writes it decided (typed: scheduler/redis_writes.py) in `ops`, which the service sends
with its next turn.

One `WorkerPolicy` per live worker (in its `WorkerSlot`) holds that worker's KV block accounting; the cluster
only chooses between them. It is composed of one part per job, each given the parts it works with:

- `Membership` (membership.py): the live workers, and the policy each gets when it joins;
- `RequestBook` (request_book.py): which worker owns each request, the parked ones, their records' writes;
- `RequestRouter` (routing.py): which worker a request goes to, and cancels to the worker holding one;
- `HandoffRouter` (handoff_routing.py): finished prefills to decode workers, and the KV transports;
- `Drains` (drains.py), `LostWorkers` (lost_workers.py): workers leaving on purpose, and by failing;
- `WorkerSteps` (worker_steps.py), step_deadlines.py: plans out, results in, and steps given up;
- cluster_stats.py and cluster_view.py: the stats key and the live view, read from all of the above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from phaseserve.stack_view import StackView
from phaseserve.wire import Keys, StepPlan, StepResult, SubmitRequest, WorkerInfo
from phaseserve.scheduler.cluster_stats import ClusterCounters, cluster_stats
from phaseserve.scheduler.cluster_view import cluster_view
from phaseserve.scheduler.drains import Drains
from phaseserve.scheduler.handoff_routing import HandoffRouter
from phaseserve.scheduler.lost_workers import LostWorkers
from phaseserve.scheduler.membership import Membership, PolicyLimits
from phaseserve.scheduler.quarantine import Quarantine
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.routing import RequestRouter
from phaseserve.scheduler.step_deadlines import give_up_overdue_steps, void_unsent_plans
from phaseserve.scheduler.worker_slot import WorkerSlot
from phaseserve.scheduler.worker_steps import WorkerSteps


class Cluster:
    """The live workers and the requests they own."""

    def __init__(self, keys: Keys, limits: PolicyLimits, drain_timeout: float = 30.0, quarantine_after: int = 2):
        self.keys = keys
        self.limits = limits
        self.counters = ClusterCounters()
        self.membership = Membership(limits)
        self.book = RequestBook(keys, self.membership, Quarantine(quarantine_after))
        self.router = RequestRouter(self.membership, self.book, self.counters, limits)
        self.handoff_router = HandoffRouter(self.membership, self.book, limits.kv_transport)
        self.drains = Drains(self.membership, self.router, self.book, self.counters, drain_timeout)
        self.lost = LostWorkers(self.membership, self.router, self.book, self.counters)
        self.steps = WorkerSteps(self.membership, self.book, self.handoff_router, self.counters, limits.itl_target)

    # the parts' state, as the service, the takeover's recovery and tests read it
    workers = property(lambda self: self.membership.workers)
    owner = property(lambda self: self.book.owner)
    parked = property(lambda self: self.book.parked)
    ops = property(lambda self: self.book.ops)
    outputs_written = property(lambda self: self.book.outputs_written)
    quarantine = property(lambda self: self.book.quarantine)
    handoffs = property(lambda self: self.handoff_router.counters)
    num_steps_given_up = property(lambda self: self.counters.num_steps_given_up)
    stats_dirty = property(lambda self: self.counters.dirty, lambda self, dirty: setattr(self.counters, "dirty", dirty))
    watched = property(lambda self: self.steps.watched, lambda self, on: setattr(self.steps, "watched", on))

    # ------------------------------------------------------------------ workers

    def add_worker(self, info: WorkerInfo, epoch: int) -> WorkerSlot:
        slot = self.membership.add(info, epoch)
        self.counters.dirty = True
        return slot

    def gone_workers(self, live: dict[str, WorkerInfo], blameless: bool = False) -> None:
        self.lost.gone(live, blameless)

    def retire_worker(self, wid: str, why: str, blameless: bool = False) -> None:
        self.lost.retire(wid, why, blameless)

    def worker_seen(self, info: WorkerInfo, now: float) -> None:
        self.drains.worker_seen(info, now)

    def workers_refreshed(self) -> None:
        """After a refresh: choose KV transports, place what was parked."""
        self.handoff_router.set_kv_transports()
        if self.parked and self.workers:
            self.router.place_parked()

    def advance_drains(self, now: float, epoch: int) -> None:
        self.drains.advance(now, epoch)

    # ------------------------------------------------------------------ requests

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        return self.router.admit(req, output_ids)

    def place_parked(self) -> None:
        self.router.place_parked()

    def cancel(self, rid: str, reason: str | None) -> None:
        self.router.cancel(rid, reason)

    def is_known(self, request_id: str) -> bool:
        return self.book.is_known(request_id)

    def request_of(self, request_id: str) -> SubmitRequest | None:
        return self.book.request_of(request_id)

    def sequence_ids(self) -> list[str]:
        return self.book.sequence_ids()

    def tell_error(self, rid: str, gateway_id: str, message: str, error_kind: str | None = None) -> None:
        self.book.tell_error(rid, gateway_id, message, error_kind)

    def vouch_for_quiet_sequences(self) -> None:
        self.book.vouch_for_quiet(self.membership.slots())

    # ------------------------------------------------------------------ steps

    def plan_steps(self, now: float, epoch: int, plans_in_flight: int, timeout_of: Callable, deadline_margin: float,
                   plan_ahead_s: float = math.inf) -> list[tuple[str, StepPlan]]:
        return self.steps.plan(now, epoch, plans_in_flight, timeout_of, deadline_margin, plan_ahead_s)

    def apply_result(self, result: StepResult, epoch: int, now: float) -> None:
        self.steps.apply_result(result, epoch, now)

    def give_up_overdue_steps(self, now: float) -> float | None:
        return give_up_overdue_steps(self.membership.slots(), self.counters, now)

    def void_unsent_plans(self, planned_before: dict[str, int]) -> None:
        void_unsent_plans(self.workers, planned_before)

    # ------------------------------------------------------------------ what it shows

    def stats(self) -> dict:
        return cluster_stats(self.membership.slots(), self.parked, self.counters, self.handoffs, self.quarantine)

    def view(self, taken_at: float, now: float) -> StackView:
        return cluster_view(self.workers, self.parked, self.limits, taken_at, now)
