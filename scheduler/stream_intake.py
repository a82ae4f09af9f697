"""What the scheduler reads from its streams, handed to the cluster: submits and cancels from `requests`,
step results from `results`. A message nobody can read goes to `Keys.dead_letters` with the reason, and a
submit whose request id and gateway can be read gets an error event. Every entry read is acknowledged with
the next turn (`acks`). No I/O of its own: the service reads, and sends what this decided."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

import msgpack
import structlog

from phaseserve.wire import (
    FIELD, FIELD_BYTES, CancelRequest, Keys, StepResult, SubmitRequest, WireError, peek_kind,
)
from phaseserve.scheduler.cluster import Cluster
from phaseserve.scheduler.redis_writes import DeadLetter, SaveSubmit

log = structlog.get_logger("phaseserve.scheduler.service")


class StreamIntake:
    def __init__(self, cluster: Cluster, keys: Keys, epoch: Callable[[], int], admit: Callable):
        self.cluster = cluster
        self.keys = keys
        self.epoch = epoch  # the scheduler's epoch now
        self.admit = admit  # admits a new request (the service's, so a test can wrap it)
        self.acks: list[tuple[str, list]] = []  # (stream, entry ids) read since the last turn
        self.num_dead_letters = 0
        self.num_duplicates = 0

    def handle(self, resp) -> None:
        if isinstance(resp, dict):  # RESP3 replies map stream -> entries
            resp = list(resp.items())
        for stream, entries in resp or ():
            stream = stream.decode() if isinstance(stream, bytes) else stream
            ids = []
            for entry_id, fields in entries:
                ids.append(entry_id)
                if not fields:  # deleted from the stream while pending (XAUTOCLAIM reports it so): nothing to do
                    continue
                data = fields.get(FIELD_BYTES)
                if data is None:
                    self.dead_letter(stream, entry_id, b"", f"no {FIELD!r} field")
                    continue
                try:
                    if stream == self.keys.results:
                        self.on_result(data)
                    else:
                        kind = peek_kind(data)
                        if kind == SubmitRequest.KIND:
                            self.on_submit(data)
                        elif kind == CancelRequest.KIND:
                            self.on_cancel(data)
                        else:
                            raise WireError(f"unknown message kind {kind!r}")
                except Exception as e:  # noqa: BLE001 -- one bad message must not stop the scheduler
                    self.dead_letter(stream, entry_id, data, f"{type(e).__name__}: {e}")
            if ids:
                self.acks.append((stream, ids))

    def on_submit(self, data: bytes) -> None:
        req = SubmitRequest.from_wire(data)
        cluster = self.cluster
        if cluster.is_known(req.request_id):  # a claimed pending entry of a request recovered from its record
            self.num_duplicates += 1
            log.info("dropping a duplicate submit", request_id=req.request_id)
            # or the entry came back because a Redis failover lost our ack of it, and with it (written
            # before it, so lost too) the request's record: written again, with its outputs at the next write
            admitted = cluster.request_of(req.request_id)
            if admitted is not None:
                cluster.ops.append(SaveSubmit(self.keys.request_record(req.request_id), admitted.to_wire()))
                if req.request_id in cluster.outputs_written:
                    cluster.outputs_written[req.request_id] = 0
            return
        if req.params.seed is None and not req.params.greedy:
            # a seed of its own, kept in the record: a recompute (worker lost, scheduler fail-over) then
            # samples again the tokens its client already has, so the stream stays one sample
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=random.getrandbits(63)))
            data = req.to_wire()
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        try:
            # the record first (same pipeline, earlier): a restarted scheduler finds every admitted request
            cluster.ops.append(SaveSubmit(self.keys.request_record(req.request_id), data))
            self.admit(req)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def on_cancel(self, data: bytes) -> None:
        msg = CancelRequest.from_wire(data)
        self.cluster.cancel(msg.request_id, msg.reason)

    def on_result(self, data: bytes) -> None:
        self.cluster.apply_result(StepResult.from_wire(data), self.epoch(), time.monotonic())

    def dead_letter(self, stream: str, entry_id, data: bytes, reason: str) -> None:
        """An entry nobody can read: kept in the dead-letter stream with the reason, and when it is a submit
        whose request id and gateway can still be read, its client gets an error instead of silence."""
        self.num_dead_letters += 1
        log.error("unreadable message; dead-lettered", stream=stream, entry_id=entry_id, reason=reason)
        self.cluster.ops.append(DeadLetter(stream, data, entry_id, reason))
        if stream != self.keys.requests:
            return
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:  # not even msgpack: nobody to tell
            return
        if not isinstance(body, dict) or body.get("k") == CancelRequest.KIND:
            return
        rid, gateway = body.get("request_id"), body.get("gateway_id")
        if isinstance(rid, str) and isinstance(gateway, str) and not self.cluster.is_known(rid):
            self.cluster.tell_error(rid, gateway, f"the scheduler could not read this request: {reason}")
