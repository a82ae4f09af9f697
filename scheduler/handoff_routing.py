"""Handoffs between workers, pure: whether a prefill worker streams its prefills' KV out (and over which
transport), which decode worker takes a sequence whose prefill finished, and what the transfers came to.
(A worker's own handoff bookkeeping is its policy's: scheduler/handoffs.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from phaseserve.wire import StepResult
from phaseserve.scheduler.handoff_counters import HandoffCounters
from phaseserve.scheduler.membership import Membership
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")


@dataclass
class HandoffRouter:
    membership: Membership
    book: RequestBook
    kv_transport: str  # PolicyLimits.kv_transport: "auto", "shm" or "redis"
    counters: HandoffCounters = field(default_factory=HandoffCounters)

    def set_kv_transports(self) -> None:
        """A prefill worker streams its prefills out while a decode worker exists (else it decodes them
        itself, as a mixed one): over shared memory when every decode worker shares its host, else Redis."""
        workers = self.membership.workers.values()
        decode_hosts = {s.info.host for s in workers if s.role == "decode" and not s.draining}
        for slot in workers:
            if slot.role != "prefill" or not decode_hosts:
                transport = None
            elif self.kv_transport != "auto":
                transport = self.kv_transport
            else:
                transport = "shm" if decode_hosts == {slot.info.host} and slot.info.host else "redis"
            slot.policy.kv_transport = transport

    def hand_off_ready(self, src: WorkerSlot) -> None:
        """Move the sequences whose prefill finished on `src` to the decode worker with the most free blocks
        that can take them; with none, they decode on `src`."""
        for rid in src.policy.ready_handoffs():
            ready = src.policy.handoff_of(rid)
            takers = [s for s in self.membership.workers.values()
                      if s.role == "decode" and not s.draining and s.policy.can_accept_handoff(ready)]
            if not takers:
                src.policy.keep(rid)
                self.counters.kept += 1
                log.info("no decode worker has room; decoding on the prefill worker", request_id=rid,
                         worker_id=src.info.worker_id)
                continue
            dst = max(takers, key=lambda s: (s.policy.num_free_blocks - s.policy.num_running, s.info.worker_id))
            handoff = src.policy.hand_off(rid)
            dst.policy.accept_handoff(handoff)
            self.book.placed(rid, dst.info.worker_id)
            self.counters.handed(handoff.kv_send.transfer_id, handoff.kv_send.transport)
            log.info("handed to a decode worker", request_id=rid, source=src.info.worker_id,
                     worker_id=dst.info.worker_id, num_cached=handoff.num_cached,
                     transfer_id=handoff.kv_send.transfer_id, transport=handoff.kv_send.transport)

    def count_results(self, result: StepResult) -> None:
        """A decode worker's reports of the transfers it received."""
        for h in result.handoffs:
            if h.ok:
                self.counters.received_kv(h.transfer_id, h.num_blocks, h.num_bytes, h.seconds)
            else:
                self.counters.failed += 1
                log.warning("KV handoff failed; recomputing the sequence", request_id=h.seq_id,
                            worker_id=result.worker_id, transfer_id=h.transfer_id, error=h.error)
