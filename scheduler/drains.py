"""Draining workers, pure (a worker given SIGTERM announces WorkerInfo.draining; docs/architecture.md,
"Workers joining and leaving"): nothing new is placed on it, its waiting sequences go to other workers at
once (or are parked while no other worker lives), its running ones finish there for up to `drain_timeout`;
then it gets no more plans, and once those in flight have answered the rest is recomputed elsewhere.
Holding nothing, it gets a `drained` plan: it may exit."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from phaseserve.wire import StepPlan, WorkerInfo
from phaseserve.scheduler.cluster_stats import ClusterCounters
from phaseserve.scheduler.membership import Membership
from phaseserve.scheduler.redis_writes import SendPlan
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.routing import RequestRouter
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")


@dataclass
class Drains:
    membership: Membership
    router: RequestRouter
    book: RequestBook
    counters: ClusterCounters
    drain_timeout: float  # how long a draining worker's running sequences may finish there

    def worker_seen(self, info: WorkerInfo, now: float) -> None:
        """A live worker's heartbeat: its drain starts when it announces one (adopted draining, too)."""
        slot = self.membership.workers[info.worker_id]
        if info.draining and slot.drain_deadline is None:
            self.start(slot, info, now)

    def start(self, slot: WorkerSlot, info: WorkerInfo, now: float) -> None:
        """The worker announced it is leaving: from now on nothing new goes to it (pick_worker), and its
        waiting sequences go elsewhere at once."""
        slot.info = info
        slot.drain_deadline = now + self.drain_timeout
        log.info("worker draining", worker_id=info.worker_id, running=slot.policy.num_running,
                 waiting=slot.policy.num_waiting, drain_timeout_s=self.drain_timeout)
        self.move_waiting(slot)
        self.counters.dirty = True

    def move_waiting(self, slot: WorkerSlot) -> None:
        """A draining worker's waiting sequences (no blocks, nothing in flight) go to the other workers, or
        are parked until one joins."""
        self.router.readmit(slot.policy.take_waiting())

    def advance(self, now: float, epoch: int) -> None:
        """Each turn, for every draining worker: move what waits (a preempted sequence), hand back what still
        runs once the drain deadline passed and no plan of it is in flight, and tell a worker that holds
        nothing that it may exit (its `drained` plan goes out with the turn's other writes)."""
        for slot in self.membership.workers.values():
            if not slot.draining or slot.drained:
                continue
            if slot.policy.num_waiting:
                self.move_waiting(slot)
            if slot.policy.has_unfinished() and now >= slot.drain_deadline and not slot.handing_back:
                slot.handing_back = True  # plan_steps sends it nothing more
                log.info("drain deadline passed; handing its sequences back", worker_id=slot.info.worker_id,
                         running=slot.policy.num_running, plans_in_flight=len(slot.in_flight))
            # the results of plans in flight first: a recompute starts from every token the worker published
            if slot.handing_back and not slot.in_flight and slot.policy.has_unfinished():
                moved = slot.policy.take_all()
                log.warning("recomputing a draining worker's sequences elsewhere", worker_id=slot.info.worker_id,
                            sequences_moved=len(moved))
                self.router.readmit(moved)
            if not slot.policy.has_unfinished():
                wid = slot.info.worker_id
                # step -1 matches no open step; after the plans in flight, in stream order
                self.book.ops.append(SendPlan(self.book.keys.steps(wid),
                                              StepPlan(-1, wid, epoch=epoch, drained=True).to_wire()))
                slot.drained = True
                log.info("worker drained; it may exit", worker_id=wid)
                self.counters.dirty = True
