"""The gateway's Redis side: submit and cancel sequences, receive their tokens, see the workers.

One pub/sub subscription on the gateway's channel lives as long as the gateway;
a reader task decodes each TokenBatch and routes every TokenEvent by seq_id to
the stream of the request that owns it. Offsets make delivery exactly-once from
the client's point of view: duplicates (a step replayed after a worker died)
are dropped, overlaps trimmed.

Pub/sub may drop messages, so every token also has a durable copy, the
sequence's token log (phaseserve/token_log.py). A gap in offsets holds the
events after it and asks for a fill; a running request with no message for
`silence_s` is also filled. Both are one non-blocking multi-key XREAD a round
(the sweeper task). A resumed request (SSE Last-Event-ID) is not on this
gateway's channel at all: the follower task reads its log with a blocking XREAD.
A request with no new token for `progress_timeout_s` gets an error event
(ERROR_TIMEOUT), never an endless wait; the scheduler's SequenceProgress (a
sequence waiting in its queue, or prefilling a long prompt) counts as progress.

Client leases: while this gateway serves a client of a sequence, it refreshes
`Keys.client_lease(seq)` (value: this serving's token) with the GatewayInfo
heartbeat, and deletes it when the serving ends. A resume takes the leases
only where none is held (SET NX): a client still connected keeps its stream.
A client that goes away leaves its sequences running for `resume_grace_s`;
then they are cancelled unless another serving (a resume) has taken the lease.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import uuid
from dataclasses import dataclass, replace

import msgpack
import redis.asyncio as aioredis
import redis.exceptions
import structlog

from gateway.slow_client import SlowClient
from phaseserve import token_log
from phaseserve.redis_client import connect_async, redacted
from phaseserve.wire import (FIELD, CancelRequest, GatewayInfo, Keys, SequenceProgress, SubmitRequest, TokenEvent,
                             WireError, WorkerInfo, channel_message)

log = structlog.get_logger("gateway.backend")

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

# TokenEvent.error_kind of the gateway's own errors: no token for progress_timeout_s (504); the gateway is
# shutting down (503: retry, on another gateway)
ERROR_TIMEOUT = "timeout"
ERROR_SHUTDOWN = "shutdown"
FILL_COUNT = 4096  # entries per sequence per fill read
# delete each lease that still holds this serving's token (a resume elsewhere may have taken it meanwhile)
_RELEASE_LEASES = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
"""


@dataclass
class DeliveryConfig:
    silence_s: float = 1.0  # no message this long while running: re-read the token log
    progress_timeout_s: float = 60.0  # no new token this long: the request fails
    lease_ttl_s: float = 5.0  # client leases and the gateway heartbeat live this long unless refreshed
    resume_grace_s: float = 10.0  # a request without a client waits this long for a resume


class RequestStream:
    """The token events of one request's sequences, in offset order, deduplicated by offset."""

    def __init__(self, backend: "Backend", seq_ids: list[str], follow: bool = False):
        self.backend = backend
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
                self.backend.request_fill(self)
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
            self.backend._routes.pop(ev.seq_id, None)
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

    def fail_stalled(self, timeout_s: float) -> None:
        """No new token for timeout_s: end every open sequence with the gateway's timeout error."""
        for seq_id, offset in list(self.expected.items()):
            self.deliver(TokenEvent(seq_id, offset, [], "error", None,
                                    f"no progress for {timeout_s:g} s: the request was given up", ERROR_TIMEOUT),
                         from_log=True)

    async def get(self) -> TokenEvent:
        if self.overflowed:
            raise SlowClient(f"more than {self.max_events} token events waited for the client")
        return await self.queue.get()

    def forget(self, seq_id: str) -> None:
        """Stop routing one sequence (the gateway ended it, e.g. on a stop string)."""
        self.expected.pop(seq_id, None)
        self.held.pop(seq_id, None)
        if self.backend._routes.get(seq_id) is self:
            del self.backend._routes[seq_id]

    def close(self) -> None:
        for s in self.seq_ids:
            if self.backend._routes.get(s) is self:
                del self.backend._routes[s]
        self.expected.clear()
        self.held.clear()
        self.backend._streams.discard(self)


class Backend:
    def __init__(self, redis_url: str, keys: Keys, gateway_id: str, worker_cache_s: float = 0.5,
                 max_connections: int = 64, pool_timeout: float = 30.0, delivery: DeliveryConfig | None = None,
                 wait_replicas: int = 0, wait_timeout_s: float = 0.5):
        self.redis_url = redis_url
        self.keys = keys
        self.gateway_id = gateway_id
        self.channel = keys.gateway_channel(gateway_id)
        self.worker_cache_s = worker_cache_s
        self.delivery = delivery or DeliveryConfig()
        # Commands share a bounded pool: a burst of requests waits up to pool_timeout for a connection
        # instead of opening one each (a burst of streams would hit Redis's 'Too many connections' and answer
        # 503). A command on a connection a Redis restart broke is retried on a new one (a re-sent submit is
        # dropped by the scheduler as a duplicate); a dead Redis still fails within the retries' connect
        # timeouts (-> 503). The subscriber and the follower block on reads: each has its own connection, and
        # its loop reconnects (to a new primary after a failover) and resubscribes.
        self.redis = connect_async(redis_url, None, keys.prefix,
                                   max_connections=max(1, max_connections), pool_timeout=pool_timeout,
                                   socket_timeout=5.0)
        self._sub_redis = connect_async(redis_url, None, keys.prefix, retries=0, socket_timeout=None)
        self._follow_redis = connect_async(redis_url, None, keys.prefix, retries=0, socket_timeout=10.0)
        # an accepted request must survive a failover: its submit is on this many replicas before the client
        # is answered (docs/redis.md); 0: no WAIT
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, max(1, int(wait_timeout_s * 1000))
        # replicas the primary had at the last look (the lease loop's): a WAIT waits for no more than are
        # there, so a primary left alone by a failover does not cost every submit the timeout
        self.connected_replicas: int | None = None
        self._routes: dict[str, RequestStream] = {}
        self._streams: set[RequestStream] = set()
        self._fill_wanted: set[RequestStream] = set()
        self._fill_wake = asyncio.Event()
        self._follow_wake = asyncio.Event()
        self._leases: dict[str, str] = {}  # seq id -> token of the serving that holds its lease here
        self._graces: dict[str, tuple[list[str], asyncio.Task]] = {}  # token -> its sequences, its timer
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.subscribed = asyncio.Event()
        self._workers_cache: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._resume_secret: bytes | None = None
        self._release_script = self.redis.register_script(_RELEASE_LEASES)
        self.info = GatewayInfo(gateway_id, os.getpid(), time.time(), self.delivery.lease_ttl_s,
                                self.delivery.resume_grace_s)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, wait_s: float = 5.0) -> None:
        """Start the subscriber; waits a little for it, but a Redis that is down only means 503s until it is up."""
        self._tasks = [asyncio.create_task(self._read_loop(), name="token-reader"),
                       asyncio.create_task(self._sweep_loop(), name="token-sweeper"),
                       asyncio.create_task(self._follow_loop(), name="token-follower"),
                       asyncio.create_task(self._lease_loop(), name="client-leases")]
        try:
            await asyncio.wait_for(self.subscribed.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("not subscribed yet; serving 503 until Redis answers", redis_url=redacted(self.redis_url))

    def fail_open_requests(self) -> None:
        """The gateway is shutting down: every open request ends now with an error (ERROR_SHUTDOWN) instead
        of being cut off when the server stops waiting for its handler."""
        for st in list(self._streams):
            for seq_id, offset in list(st.expected.items()):
                st.deliver(TokenEvent(seq_id, offset, [], "error", None,
                                      "the gateway is shutting down; retry the request", ERROR_SHUTDOWN),
                           from_log=True)

    async def close(self) -> None:
        # shutting down: requests waiting for a resume are decided now (cancelled unless another gateway took them)
        for token, (seq_ids, timer) in list(self._graces.items()):
            timer.cancel()
            self._spawn(self._cancel_unless_resumed(seq_ids, token, 0.0))
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.redis.delete(self.keys.gateway_heartbeat(self.gateway_id))
        except _REDIS_ERRORS:
            pass
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()
        await self._sub_redis.aclose()
        await self._follow_redis.aclose()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _read_loop(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._sub_redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while (msg := await pubsub.get_message(timeout=1.0)) is None or msg["type"] != "subscribe":
                    pass
                self.subscribed.set()
                log.info("subscribed", channel=self.channel)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg["type"] == "message":
                        self._on_message(msg["data"])
            except asyncio.CancelledError:
                raise
            except _REDIS_ERRORS as e:
                if self.subscribed.is_set():
                    log.warning("token channel lost; resubscribing", error=str(e))
                self.subscribed.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # the connection may already be gone
                    pass

    def _on_message(self, data: bytes) -> None:
        try:
            batch = channel_message(data)
        except (WireError, KeyError, TypeError, ValueError) as e:
            log.warning("undecodable message on token channel", error=str(e))
            return
        if isinstance(batch, SequenceProgress):
            self._on_progress(batch)
            return
        for ev in batch.events:
            stream = self._routes.get(ev.seq_id)
            if stream is None:
                log.debug("tokens for unknown sequence", seq_id=ev.seq_id)  # finished or cancelled
                continue
            stream.deliver(ev)

    def _on_progress(self, progress: SequenceProgress) -> None:
        """The scheduler vouches for sequences that show no token (queued, prefilling): progress for their
        no-progress deadline, and nothing for a silence fill to look for."""
        now = time.monotonic()
        for seq_id in progress.seq_ids:
            stream = self._routes.get(seq_id)
            if stream is not None:
                stream.last_progress = stream.last_message = now

    # ---------------------------------------------------------------- the token log: fills and follows

    def request_fill(self, stream: RequestStream) -> None:
        self._fill_wanted.add(stream)
        self._fill_wake.set()

    async def _read_logs(self, client: aioredis.Redis, streams: list[RequestStream], block_ms: int | None) -> None:
        """One XREAD over the token logs of these requests' open sequences, each from the offset it has."""
        want = {}
        for st in streams:
            for seq_id, offset in st.expected.items():
                want[self.keys.token_log(seq_id)] = token_log.read_from(offset)
        if not want:
            return
        got = await client.xread(want, count=FILL_COUNT, block=block_ms)
        for key, entries in got or ():
            seq_id = (key.decode() if isinstance(key, bytes) else key).split(":out:", 1)[1]
            stream = self._routes.get(seq_id)
            if stream is None:
                continue
            for _entry_id, fields in entries:
                try:
                    stream.deliver(token_log.decode_entry(fields), from_log=True)
                except (WireError, TypeError, ValueError, IndexError) as e:
                    log.warning("undecodable token log entry", seq_id=seq_id, error=str(e))

    async def _sweep_loop(self) -> None:
        """Fills (gaps, silences) and deadlines: one non-blocking XREAD for every request that needs one."""
        cfg = self.delivery
        tick = max(0.02, min(cfg.silence_s, cfg.progress_timeout_s) / 4)
        while True:
            try:
                await asyncio.wait_for(self._fill_wake.wait(), tick)
            except asyncio.TimeoutError:
                pass
            self._fill_wake.clear()
            now = time.monotonic()
            for st in list(self._streams):
                if st.expected and now - st.last_progress > cfg.progress_timeout_s:
                    log.warning("request stalled: giving up", seq_ids=st.open_seqs,
                                seconds=round(now - st.last_progress, 1))
                    st.fail_stalled(cfg.progress_timeout_s)
            wanted, self._fill_wanted = self._fill_wanted, set()
            silent = {st for st in self._streams
                      if st.expected and not st.follow and now - st.last_message > cfg.silence_s}
            todo = [st for st in wanted | silent if st.expected]
            if not todo:
                for st in wanted:
                    st.release_held()
                continue
            for st in silent:
                st.last_message = now  # the next look after another silence, not on every tick
            try:
                await self._read_logs(self.redis, todo, None)
            except asyncio.CancelledError:
                raise
            except _REDIS_ERRORS as e:
                log.warning("reading token logs failed", error=str(e))
            for st in wanted:
                st.release_held()

    async def _follow_loop(self) -> None:
        """Resumed requests: their tokens come from their logs only, read as they are written."""
        backoff = 0.1
        while True:
            following = [st for st in self._streams if st.follow and st.expected]
            if not following:
                self._follow_wake.clear()
                await self._follow_wake.wait()
                continue
            try:
                await self._read_logs(self._follow_redis, following, 500)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except _REDIS_ERRORS as e:
                log.warning("following token logs failed", error=str(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # ---------------------------------------------------------------- client leases

    async def _lease_loop(self) -> None:
        """Every third of the lease TTL: the gateway heartbeat and the lease of every sequence served here (and,
        when submits WAIT, how many replicas the primary has)."""
        ttl_ms = max(1, int(self.delivery.lease_ttl_s * 1000))
        while True:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(self.keys.gateway_heartbeat(self.gateway_id), self.info.to_wire(), px=ttl_ms)
                    for seq_id, token in self._leases.items():
                        pipe.set(self.keys.client_lease(seq_id), token, px=ttl_ms)
                    if self.wait_replicas:
                        pipe.info("replication")
                    replies = await pipe.execute()
                if self.wait_replicas:
                    self.connected_replicas = int(replies[-1].get("connected_slaves", 0))
            except asyncio.CancelledError:
                raise
            except _REDIS_ERRORS as e:
                log.warning("refreshing client leases failed", error=str(e))
            await asyncio.sleep(self.delivery.lease_ttl_s / 3)

    def _take_leases(self, pipe, seq_ids: list[str]) -> str:
        token = f"{self.gateway_id}:{uuid.uuid4().hex[:12]}"
        for s in seq_ids:
            self._leases[s] = token
            pipe.set(self.keys.client_lease(s), token, px=max(1, int(self.delivery.lease_ttl_s * 1000)))
        return token

    def drop_leases(self, seq_ids: list[str], token: str | None = None) -> None:
        """Stop refreshing these leases (only those this serving holds, when its token is given: a client
        that resumed on this same gateway holds them under a new token)."""
        for s in seq_ids:
            if token is None or self._leases.get(s) == token:
                self._leases.pop(s, None)

    def release_leases(self, seq_ids: list[str], token: str | None) -> None:
        """The serving that holds these leases ended: stop refreshing them and delete them now (not when they
        expire), so the client can resume at once."""
        self.drop_leases(seq_ids, token)
        if seq_ids and token:
            self._spawn(self._release_logged(seq_ids, token))

    async def _release_logged(self, seq_ids: list[str], token: str) -> None:
        try:
            await self._release_script(keys=[self.keys.client_lease(s) for s in seq_ids], args=[token])
        except _REDIS_ERRORS as e:  # they expire anyway
            log.warning("releasing client leases failed", error=str(e))

    def cancel_after_grace(self, seq_ids: list[str], token: str) -> None:
        """The client went away: cancel after the resume grace, unless a resume took the lease meanwhile."""
        self.release_leases(seq_ids, token)
        timer = self._spawn(self._cancel_unless_resumed(seq_ids, token, self.delivery.resume_grace_s))
        self._graces[token] = (seq_ids, timer)
        timer.add_done_callback(lambda _t: self._graces.pop(token, None))

    async def _cancel_unless_resumed(self, seq_ids: list[str], token: str, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            holders = await self.redis.mget([self.keys.client_lease(s) for s in seq_ids])
        except _REDIS_ERRORS as e:
            log.warning("reading client leases failed; cancelling", error=str(e))
            holders = [None] * len(seq_ids)
        orphans = [s for s, h in zip(seq_ids, holders) if h is None or h.decode() == token]
        if len(orphans) < len(seq_ids):
            log.info("resumed elsewhere: not cancelled", seq_ids=[s for s in seq_ids if s not in orphans])
        if orphans:
            await self._cancel_logged(orphans, "abort")

    # ---------------------------------------------------------------- requests

    def open(self, seq_ids: list[str], follow: bool = False) -> RequestStream:
        """Route these sequences' tokens to a new stream. Call before submit, so nothing is missed."""
        stream = RequestStream(self, seq_ids, follow)
        for s in seq_ids:
            self._routes[s] = stream
        self._streams.add(stream)
        if follow:
            self._follow_wake.set()
            self.request_fill(stream)  # the catch-up now, not after the follower's current read
        return stream

    async def submit(self, requests: list[SubmitRequest]) -> str:
        """XADD the sequences, taking their client leases in the same round trip; -> the leases' token."""
        async with self.redis.pipeline(transaction=False) as pipe:
            token = self._take_leases(pipe, [r.request_id for r in requests])
            for r in requests:
                pipe.xadd(self.keys.requests, {FIELD: r.to_wire()})
            wanted = self.replicas_to_wait_for()
            if wanted:  # same connection: WAIT covers the writes above
                pipe.wait(wanted, self.wait_timeout_ms)
            try:
                replies = await pipe.execute()
            except BaseException:
                self.drop_leases([r.request_id for r in requests])
                raise
        if wanted and replies[-1] < wanted:
            log.warning("an accepted request reached fewer replicas than --redis-wait-replicas in time; a failover "
                        "now could lose it", replicas=replies[-1], wanted=wanted,
                        request_ids=[r.request_id for r in requests])
        return token

    def replicas_to_wait_for(self) -> int:
        """--redis-wait-replicas, but no more than the primary had connected at the last look."""
        if self.connected_replicas is None:
            return self.wait_replicas
        return min(self.wait_replicas, self.connected_replicas)

    async def resumable(self, seq_ids: list[str]) -> bool:
        """Whether these sequences can be resumed: the scheduler still has them, or their token logs are alive."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.exists(self.keys.request_record(s), self.keys.token_log(s))
            counts = await pipe.execute()
        return all(counts)

    async def resume_secret(self) -> bytes:
        """The stack's key of resume tokens: the first gateway to need it sets it, every gateway reads it."""
        if self._resume_secret is None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.resume_secret(), secrets.token_bytes(32), nx=True)
                pipe.get(self.keys.resume_secret())
                self._resume_secret = (await pipe.execute())[1]
        return self._resume_secret

    async def attach(self, seq_ids: list[str]) -> str | None:
        """A resumed client is served here now: take the sequences' leases (a grace elsewhere then keeps them);
        -> their token, or None when a serving still holds one (its client is connected: it keeps the stream)."""
        if any(s in self._routes for s in seq_ids):
            return None
        token = f"{self.gateway_id}:{uuid.uuid4().hex[:12]}"
        ttl_ms = max(1, int(self.delivery.lease_ttl_s * 1000))
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.set(self.keys.client_lease(s), token, px=ttl_ms, nx=True)
            taken = await pipe.execute()
        if not all(taken):
            if any(taken):
                await self._release_script(keys=[self.keys.client_lease(s) for s, t in zip(seq_ids, taken) if t],
                                           args=[token])
            return None
        for s in seq_ids:
            self._leases[s] = token
        return token

    async def cancel(self, seq_ids: list[str], reason: str = "abort") -> None:
        if not seq_ids:
            return
        self.drop_leases(seq_ids)
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.xadd(self.keys.requests, {FIELD: CancelRequest(s, reason).to_wire()})
                # a client resuming later reads the end of the sequence instead of waiting for tokens
                token_log.append_abort(pipe, self.keys, s, 0, reason)
                pipe.delete(self.keys.client_lease(s))
            await pipe.execute()

    # ---------------------------------------------------------------- usage per key

    def add_usage(self, key_name: str, counts: dict[str, int]) -> None:
        """Add a finished request's counts to its key's usage (in the background: the response is sent)."""
        self._spawn(self._add_usage(key_name, counts))

    async def _add_usage(self, key_name: str, counts: dict[str, int]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, n in counts.items():
                    pipe.hincrby(self.keys.key_usage(key_name), name, n)
                await pipe.execute()
        except _REDIS_ERRORS as e:
            log.warning("usage not recorded", error=str(e))

    async def usage(self, key_name: str) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.key_usage(key_name))
        return {k.decode(): int(v) for k, v in raw.items()}

    def cancel_soon(self, seq_ids: list[str], reason: str = "abort") -> None:
        """Cancel from a context that may itself be cancelled (a client that went away)."""
        self.drop_leases(seq_ids)
        self._spawn(self._cancel_logged(seq_ids, reason))

    async def _cancel_logged(self, seq_ids: list[str], reason: str) -> None:
        try:
            await self.cancel(seq_ids, reason)
            log.info("cancelled", seq_ids=seq_ids, reason=reason)
        except _REDIS_ERRORS as e:
            log.warning("cancel failed", seq_ids=seq_ids, error=str(e))

    # ---------------------------------------------------------------- cluster state

    async def alive_workers(self, max_age_s: float | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat key exists (it expires when they stop beating)."""
        max_age = self.worker_cache_s if max_age_s is None else max_age_s
        stamp, cached = self._workers_cache
        if time.monotonic() - stamp < max_age:
            return cached
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in await self.redis.smembers(self.keys.workers))
        workers: list[WorkerInfo] = []
        if ids:
            for wid, raw in zip(ids, await self.redis.mget([self.keys.worker_heartbeat(i) for i in ids])):
                if raw is None:
                    continue
                try:
                    workers.append(WorkerInfo.from_wire(raw))
                except (WireError, TypeError) as e:
                    log.warning("bad worker heartbeat", worker_id=wid, error=str(e))
        self._workers_cache = (time.monotonic(), workers)
        return workers

    async def scheduler_alive(self) -> bool:
        """Whether the active scheduler's mark is there (it expires a few worker refreshes after its last)."""
        return bool(await self.redis.exists(self.keys.scheduler_alive()))

    async def scheduler_stats(self) -> dict | None:
        raw = await self.redis.get(self.keys.scheduler_stats())
        if raw is None:
            return None
        try:
            stats = msgpack.unpackb(raw, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
            log.warning("bad scheduler stats", error=str(e))
            return None
        return stats if isinstance(stats, dict) else None
