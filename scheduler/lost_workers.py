"""Workers that went away, pure: a lapsed heartbeat or a new life retires the worker, and its sequences are
recomputed elsewhere; one that was running there gets a strike, and is failed at the quarantine's limit
instead of being moved again (scheduler/quarantine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from phaseserve.wire import ERROR_QUARANTINED, WorkerInfo
from phaseserve.scheduler.cluster_stats import ClusterCounters
from phaseserve.scheduler.membership import Membership
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.routing import RequestRouter

log = structlog.get_logger("phaseserve.scheduler.cluster")


@dataclass
class LostWorkers:
    membership: Membership
    router: RequestRouter
    book: RequestBook
    counters: ClusterCounters

    def gone(self, live: dict[str, WorkerInfo], blameless: bool = False) -> None:
        """Retire every worker whose heartbeat lapsed, or that started a new life. `blameless`: the scheduler
        could not reach Redis just before (heartbeats lapsed with the outage): no strike for anyone."""
        for wid, why in self.membership.lapsed(live):
            self.retire(wid, why, blameless)

    def retire(self, wid: str, why: str, blameless: bool = False) -> None:
        """The worker is gone: its sequences are recomputed elsewhere, but one that was running on it gets a
        strike (unless the worker left on purpose, or `blameless`), and is failed at the quarantine's limit."""
        slot = self.membership.remove(wid)
        self.counters.retire(slot.policy)
        suspects = set() if blameless or slot.draining else slot.policy.running_ids()
        moved = slot.policy.take_all()
        if slot.drained and not moved:
            log.info("worker left after draining", worker_id=wid)
        else:
            log.warning("worker lost", worker_id=wid, reason=why, sequences_moved=len(moved),
                        sequences_struck=len(suspects))
        quarantine = self.book.quarantine
        for req, output_ids in moved:
            rid = req.request_id
            self.book.owner.pop(rid, None)
            if rid in suspects:
                if quarantine.strike(rid):
                    log.error("request quarantined", request_id=rid, worker_id=wid,
                              failures=quarantine.max_failures)
                    self.book.fail_request(req, quarantine.message(), ERROR_QUARANTINED)
                    continue
                self.book.strike_recorded(rid)
            self.book.parked.append((req, output_ids))
        self.counters.dirty = True
        if self.membership.workers:
            self.router.place_parked()
