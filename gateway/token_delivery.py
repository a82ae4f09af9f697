"""Delivery of token events to the requests waiting for them.

Every TokenEvent is routed by seq_id to the stream of the request that owns it, wherever it came from (the
gateway's channel, or a read of the sequence's token log). Offsets make delivery exactly-once from the
client's point of view: duplicates (a step replayed after a worker died) are dropped, overlaps trimmed, and
a gap holds the events after it and asks for a fill from the token log.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import structlog

from phaseserve.gateway.slow_client import SlowClient
from phaseserve.wire import TokenEvent

log = structlog.get_logger("gateway.delivery")

# TokenEvent.error_kind of the gateway's own errors: no token for progress_timeout_s (504); the gateway is
# shutting down (503: retry, on another gateway)
ERROR_TIMEOUT = "timeout"
ERROR_SHUTDOWN = "shutdown"


@dataclass
class DeliveryConfig:
    silence_s: float = 1.0  # no message this long while running: re-read the token log
    progress_timeout_s: float = 60.0  # no new token this long: the request fails
    lease_ttl_s: float = 5.0  # client leases and the gateway heartbeat live this long unless refreshed
    resume_grace_s: float = 10.0  # a request without a client waits this long for a resume


class RequestStream:
    """The token events of one request's sequences, in offset order, deduplicated by offset."""

    def __init__(self, routes: "TokenRoutes", seq_ids: list[str], follow: bool = False):
        self.routes = routes
        self.seq_ids = list(seq_ids)
        self.expected = {s: 0 for s in seq_ids}  # next output offset each sequence should receive
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.held: dict[str, list[TokenEvent]] = {}  # events after a gap, until the log fills it
        self.follow = follow  # read from the token log only (a resume: not on this gateway's channel)
        self.last_message = self.last_progress = time.monotonic()
        self.max_events = 0  # events waiting for the handler, at most (0: no cap); then overflowed
        self.overflowed = False
        self.on_overflow = lambda: None

    @property
    def open_seqs(self) -> list[str]:
        return list(self.expected)

    def deliver(self, ev: TokenEvent, from_log: bool = False) -> None:
        expected = self.expected.get(ev.seq_id)
        if expected is None:
            return
        now = time.monotonic()
        self.last_message = now
        final = ev.finish_reason is not None or ev.error is not None
        if ev.offset > expected:
            if not from_log:  # pub/sub lost a message: the log has it (written before the publish)
                self.held.setdefault(ev.seq_id, []).append(ev)
                self.routes.request_fill(self)
                return
            log.warning("token gap the token log cannot fill", seq_id=ev.seq_id, expected_offset=expected,
                        got_offset=ev.offset, missing=ev.offset - expected)
        elif ev.offset < expected:
            skip = expected - ev.offset
            if skip >= len(ev.token_ids) and not final:
                return  # a duplicate (a replayed step, or pub/sub and the log both)
            ev = replace(ev, offset=expected, token_ids=ev.token_ids[skip:],
                         logprobs=ev.logprobs[skip:] if ev.logprobs is not None else None)
        if ev.token_ids or final:
            self.last_progress = now
        self.expected[ev.seq_id] = max(expected, ev.offset + len(ev.token_ids))
        if final:  # nothing more belongs to this sequence
            self.expected.pop(ev.seq_id, None)
            self.held.pop(ev.seq_id, None)
            self.routes.by_seq.pop(ev.seq_id, None)
        if self.max_events and self.queue.qsize() >= self.max_events:
            if not self.overflowed:
                self.overflowed = True
                self.on_overflow()
            return
        self.queue.put_nowait(ev)

    def release_held(self) -> None:
        """After a fill: what was held behind a gap goes on (a gap still open is passed on, logged)."""
        held, self.held = self.held, {}
        for events in held.values():
            for ev in sorted(events, key=lambda e: e.offset):
                self.deliver(ev, from_log=True)

    def fail_open(self, message: str, error_kind: str) -> None:
        """End every open sequence with one of the gateway's own errors."""
        for seq_id, offset in list(self.expected.items()):
            self.deliver(TokenEvent(seq_id, offset, [], "error", None, message, error_kind), from_log=True)

    def fail_stalled(self, timeout_s: float) -> None:
        """No new token for timeout_s: end every open sequence with the gateway's timeout error."""
        self.fail_open(f"no progress for {timeout_s:g} s: the request was given up", ERROR_TIMEOUT)

    async def get(self) -> TokenEvent:
        if self.overflowed:
            raise SlowClient(f"more than {self.max_events} token events waited for the client")
        return await self.queue.get()

    def forget(self, seq_id: str) -> None:
        """Stop routing one sequence (the gateway ended it, e.g. on a stop string)."""
        self.expected.pop(seq_id, None)
        self.held.pop(seq_id, None)
        self.routes.unroute(seq_id, self)

    def close(self) -> None:
        for s in self.seq_ids:
            self.routes.unroute(s, self)
        self.expected.clear()
        self.held.clear()
        self.routes.streams.discard(self)


class TokenRoutes:
    """Which open request each sequence's events go to, and which requests want their token logs read."""

    def __init__(self):
        self.by_seq: dict[str, RequestStream] = {}
        self.streams: set[RequestStream] = set()  # every open request
        self.fill_wanted: set[RequestStream] = set()  # a gap to fill from the log
        self.fill_wake = asyncio.Event()  # the sweeper: a fill is wanted
        self.follow_wake = asyncio.Event()  # the follower: a resumed request opened

    def open(self, seq_ids: list[str], follow: bool = False) -> RequestStream:
        """Route these sequences' tokens to a new stream. Call before submit, so nothing is missed."""
        stream = RequestStream(self, seq_ids, follow)
        for s in seq_ids:
            self.by_seq[s] = stream
        self.streams.add(stream)
        if follow:
            self.follow_wake.set()
            self.request_fill(stream)  # the catch-up now, not after the follower's current read
        return stream

    def serves_any(self, seq_ids: list[str]) -> bool:
        return any(s in self.by_seq for s in seq_ids)

    def deliver(self, ev: TokenEvent, from_log: bool = False) -> bool:
        """To the request that owns its sequence; False when none does (finished or cancelled)."""
        stream = self.by_seq.get(ev.seq_id)
        if stream is None:
            return False
        stream.deliver(ev, from_log)
        return True

    def vouch(self, seq_ids: list[str]) -> None:
        """The scheduler vouches for sequences that show no token (queued, prefilling): progress for their
        no-progress deadline, and nothing for a silence fill to look for."""
        now = time.monotonic()
        for seq_id in seq_ids:
            stream = self.by_seq.get(seq_id)
            if stream is not None:
                stream.last_progress = stream.last_message = now

    def unroute(self, seq_id: str, stream: RequestStream) -> None:
        if self.by_seq.get(seq_id) is stream:
            del self.by_seq[seq_id]

    def request_fill(self, stream: RequestStream) -> None:
        self.fill_wanted.add(stream)
        self.fill_wake.set()

    def fail_open(self, message: str, error_kind: str) -> None:
        for stream in list(self.streams):
            stream.fail_open(message, error_kind)
