"""The requests the cluster holds, pure: which worker owns each, which wait for a worker (parked), how much
of each one's output its record holds, and the writes to its record and its client that follow. The writes
are typed (scheduler/redis_writes.py) and wait in `ops` for the service's next turn."""

from __future__ import annotations

import structlog

from phaseserve.wire import Keys, SequenceProgress, SubmitRequest, TokenBatch, TokenEvent
from phaseserve.scheduler.membership import Membership
from phaseserve.scheduler.quarantine import STRIKES_FIELD, Quarantine
from phaseserve.scheduler.redis_writes import DeleteRecord, Publish, RedisWrite, SaveOutputs, SetRecordField, TellError

log = structlog.get_logger("phaseserve.scheduler.cluster")

# confirmed tokens go into a request's record in runs of this many: one Redis command per run, not per token
# (a command per token was most of the scheduler's CPU). A takeover resumes from the record, up to this far
# behind the client, and regenerates the rest: the same tokens (greedy, or sampled with the request's seed,
# exactly in float32), or it reads them from the relay's token log when there is one.
OUTPUTS_PER_WRITE = 16


class RequestBook:
    def __init__(self, keys: Keys, membership: Membership, quarantine: Quarantine):
        self.keys = keys
        self.membership = membership
        self.quarantine = quarantine  # strikes of sequences present at worker failures
        self.owner: dict[str, str] = {}  # request id -> worker id
        self.parked: list[tuple[SubmitRequest, list[int] | None]] = []  # no live worker to run them yet
        self.outputs_written: dict[str, int] = {}  # request id -> confirmed outputs its record holds
        self.ops: list[RedisWrite] = []  # Redis writes decided, sent with the service's next turn

    def is_known(self, request_id: str) -> bool:
        return request_id in self.owner or any(r.request_id == request_id for r, _ in self.parked)

    def request_of(self, request_id: str) -> SubmitRequest | None:
        """A known request as admitted (placed or parked), or None."""
        wid = self.owner.get(request_id)
        workers = self.membership.workers
        if wid is not None and wid in workers:
            return workers[wid].policy.request_of(request_id)
        return next((r for r, _ in self.parked if r.request_id == request_id), None)

    def sequence_ids(self) -> list[str]:
        """Every sequence the cluster holds, placed or parked."""
        return list(self.owner) + [r.request_id for r, _ in self.parked]

    def unpark(self, request_id: str) -> bool:
        """Drop a parked request; False if it was not parked."""
        before = len(self.parked)
        self.parked[:] = [(r, o) for r, o in self.parked if r.request_id != request_id]
        return len(self.parked) < before

    def take_parked(self) -> list[tuple[SubmitRequest, list[int] | None]]:
        parked = list(self.parked)
        self.parked.clear()
        return parked

    def placed(self, request_id: str, worker_id: str) -> None:
        """The request runs on `worker_id` now: its record says so (a takeover reads it)."""
        self.owner[request_id] = worker_id
        self.ops.append(SetRecordField(self.keys.request_record(request_id), "worker", worker_id))

    def confirmed(self, request_id: str, outputs: list[int]) -> None:
        """The request's confirmed outputs so far: its record gets them a run at a time (a takeover resumes
        from there)."""
        written = self.outputs_written.get(request_id, 0)
        if len(outputs) - written >= OUTPUTS_PER_WRITE:
            self.ops.append(SaveOutputs(self.keys.request_record(request_id), written, outputs[written:]))
            self.outputs_written[request_id] = len(outputs)

    def strike_recorded(self, request_id: str) -> None:
        """The quarantine's count for the request goes into its record (a takeover keeps counting)."""
        self.ops.append(SetRecordField(self.keys.request_record(request_id), STRIKES_FIELD,
                                       self.quarantine.count(request_id)))

    def forget(self, request_id: str) -> None:
        """The request is done with (finished, failed or cancelled): its record goes."""
        self.ops.append(DeleteRecord(self.keys.request_record(request_id)))
        self.outputs_written.pop(request_id, None)
        self.quarantine.forget(request_id)

    def finished(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.forget(request_id)

    def fail_request(self, req: SubmitRequest, message: str, error_kind: str | None = None) -> None:
        self.tell_error(req.request_id, req.gateway_id, message, error_kind)
        self.forget(req.request_id)

    def tell_error(self, rid: str, gateway_id: str, message: str, error_kind: str | None = None) -> None:
        """An error event for a request's client: published, and in its token log, so a gateway that missed
        the message (or a client resuming later) still reads it instead of waiting for a deadline."""
        event = TokenEvent(rid, 0, [], "error", None, message, error_kind)
        self.ops.append(TellError(self.keys.gateway_channel(gateway_id), TokenBatch(-1, "scheduler", [event]).to_wire(),
                                  event.to_list()))

    def vouch_for_quiet(self, slots: list) -> None:
        """Tell each gateway which of its sequences are waiting at a live worker or prefilling
        (SequenceProgress): no token shows it, yet they are not stalled, and its no-progress deadline must
        not fail them. Parked ones (no worker to run them) are not vouched for: that deadline bounds their
        wait. `slots`: the live WorkerSlots."""
        by_gateway: dict[str, list[str]] = {}
        for req in (r for s in slots for r in s.policy.quiet_progress()):
            by_gateway.setdefault(req.gateway_id, []).append(req.request_id)
        for gateway_id, seq_ids in by_gateway.items():
            self.ops.append(Publish(self.keys.gateway_channel(gateway_id), SequenceProgress(seq_ids).to_wire()))
