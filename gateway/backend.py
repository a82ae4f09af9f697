"""The gateway's Redis side: submit and cancel sequences, receive their tokens, see the workers.

One pub/sub subscription on the gateway's channel lives as long as the gateway;
a reader task decodes each TokenBatch and routes every TokenEvent by seq_id to
the stream of the request that owns it. Offsets make delivery exactly-once from
the client's point of view: duplicates (a step replayed after a worker died)
are dropped, overlaps trimmed, gaps logged.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgpack
import redis.asyncio as aioredis
import redis.exceptions
import structlog

from phaseserve.wire import FIELD, CancelRequest, Keys, SubmitRequest, TokenBatch, TokenEvent, WireError, WorkerInfo

log = structlog.get_logger("gateway.backend")

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RequestStream:
    """The token events of one request's sequences, in arrival order, deduplicated by offset."""

    def __init__(self, backend: "Backend", seq_ids: list[str]):
        self.backend = backend
        self.seq_ids = list(seq_ids)
        self.expected = {s: 0 for s in seq_ids}  # next output offset each sequence should receive
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def deliver(self, ev: TokenEvent) -> None:
        expected = self.expected.get(ev.seq_id)
        if expected is None:
            return
        final = ev.finish_reason is not None or ev.error is not None
        if ev.offset > expected:
            log.warning("token gap", seq_id=ev.seq_id, expected_offset=expected, got_offset=ev.offset,
                        missing=ev.offset - expected)
        elif ev.offset < expected:
            skip = expected - ev.offset
            if skip >= len(ev.token_ids) and not final:
                log.debug("duplicate tokens dropped", seq_id=ev.seq_id, offset=ev.offset)
                return
            ev = replace(ev, offset=expected, token_ids=ev.token_ids[skip:],
                         logprobs=ev.logprobs[skip:] if ev.logprobs is not None else None)
        self.expected[ev.seq_id] = max(expected, ev.offset + len(ev.token_ids))
        if final:  # nothing more belongs to this sequence
            self.expected.pop(ev.seq_id, None)
            self.backend._routes.pop(ev.seq_id, None)
        self.queue.put_nowait(ev)

    async def get(self) -> TokenEvent:
        return await self.queue.get()

    def forget(self, seq_id: str) -> None:
        """Stop routing one sequence (the gateway ended it, e.g. on a stop string)."""
        self.expected.pop(seq_id, None)
        if self.backend._routes.get(seq_id) is self:
            del self.backend._routes[seq_id]

    def close(self) -> None:
        for s in self.seq_ids:
            if self.backend._routes.get(s) is self:
                del self.backend._routes[s]
        self.expected.clear()


class Backend:
    def __init__(self, redis_url: str, keys: Keys, gateway_id: str, worker_cache_s: float = 0.5,
                 max_connections: int = 64, pool_timeout: float = 30.0):
        self.redis_url = redis_url
        self.keys = keys
        self.gateway_id = gateway_id
        self.channel = keys.gateway_channel(gateway_id)
        self.worker_cache_s = worker_cache_s
        # Commands share a bounded pool: a burst of requests waits up to pool_timeout for a connection
        # instead of opening one each (1,000 streams at once hit Redis's 'Too many connections' and got
        # 503s). A dead Redis still fails fast (connect/read timeouts -> 503). from_url honours a password
        # (redis://:pw@host) and TLS (rediss://). The subscriber blocks on reads: its own connection.
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max(1, max_connections), timeout=pool_timeout,
            socket_connect_timeout=2.0, socket_timeout=5.0)
        self.redis = aioredis.Redis(connection_pool=pool)
        self._sub_redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2.0)
        self._routes: dict[str, RequestStream] = {}
        self._reader: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.subscribed = asyncio.Event()
        self._workers_cache: tuple[float, list[WorkerInfo]] = (0.0, [])

    # ---------------------------------------------------------------- lifecycle

    async def start(self, wait_s: float = 5.0) -> None:
        """Start the subscriber; waits a little for it, but a Redis that is down only means 503s until it is up."""
        self._reader = asyncio.create_task(self._read_loop(), name="token-reader")
        try:
            await asyncio.wait_for(self.subscribed.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("not subscribed yet; serving 503 until Redis answers", redis_url=self.redis_url)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()
        await self._sub_redis.aclose()

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
            batch = TokenBatch.from_wire(data)
        except (WireError, KeyError, TypeError, ValueError) as e:
            log.warning("undecodable message on token channel", error=str(e))
            return
        for ev in batch.events:
            stream = self._routes.get(ev.seq_id)
            if stream is None:
                log.debug("tokens for unknown sequence", seq_id=ev.seq_id)  # finished or cancelled
                continue
            stream.deliver(ev)

    # ---------------------------------------------------------------- requests

    def open(self, seq_ids: list[str]) -> RequestStream:
        """Route these sequences' tokens to a new stream. Call before submit, so nothing is missed."""
        stream = RequestStream(self, seq_ids)
        for s in seq_ids:
            self._routes[s] = stream
        return stream

    async def submit(self, requests: list[SubmitRequest]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in requests:
                pipe.xadd(self.keys.requests, {FIELD: r.to_wire()})
            await pipe.execute()

    async def cancel(self, seq_ids: list[str], reason: str = "abort") -> None:
        if not seq_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.xadd(self.keys.requests, {FIELD: CancelRequest(s, reason).to_wire()})
            await pipe.execute()

    def cancel_soon(self, seq_ids: list[str], reason: str = "abort") -> None:
        """Cancel from a context that may itself be cancelled (a client that went away)."""
        task = asyncio.get_running_loop().create_task(self._cancel_logged(seq_ids, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
