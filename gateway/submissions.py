"""Submitting and cancelling sequences on the stream `requests`.

A submit takes the sequences' client leases in its round trip. An accepted request must survive a failover:
with --redis-wait-replicas its submit is on that many replicas (WAIT) before the client is answered
(docs/redis.md). A cancel also ends the sequence's token log, so a client resuming later reads its end
instead of waiting for tokens.
"""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from phaseserve.gateway.client_leases import ClientLeases
from phaseserve.gateway.redis_connections import REDIS_ERRORS, BackgroundTasks
from phaseserve import token_log
from phaseserve.wire import FIELD, CancelRequest, Keys, SubmitRequest

log = structlog.get_logger("gateway.submissions")


class Submissions:
    def __init__(self, redis: aioredis.Redis, keys: Keys, leases: ClientLeases, background: BackgroundTasks,
                 wait_replicas: int = 0, wait_timeout_s: float = 0.5):
        self.redis, self.keys, self.leases, self.background = redis, keys, leases, background
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, max(1, int(wait_timeout_s * 1000))

    async def submit(self, requests: list[SubmitRequest]) -> str:
        """XADD the sequences, taking their client leases in the same round trip; -> the leases' token."""
        seq_ids = [r.request_id for r in requests]
        async with self.redis.pipeline(transaction=False) as pipe:
            token = self.leases.take(pipe, seq_ids)
            for r in requests:
                pipe.xadd(self.keys.requests, {FIELD: r.to_wire()})
            wanted = self.replicas_to_wait_for()
            if wanted:  # same connection: WAIT covers the writes above
                pipe.wait(wanted, self.wait_timeout_ms)
            try:
                replies = await pipe.execute()
            except BaseException:
                self.leases.drop(seq_ids)
                raise
        if wanted and replies[-1] < wanted:
            log.warning("an accepted request reached fewer replicas than --redis-wait-replicas in time; a failover "
                        "now could lose it", replicas=replies[-1], wanted=wanted, request_ids=seq_ids)
        return token

    def replicas_to_wait_for(self) -> int:
        """--redis-wait-replicas, but no more than the primary had connected at the last look."""
        connected = self.leases.connected_replicas
        return self.wait_replicas if connected is None else min(self.wait_replicas, connected)

    async def cancel(self, seq_ids: list[str], reason: str = "abort") -> None:
        if not seq_ids:
            return
        self.leases.drop(seq_ids)
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.xadd(self.keys.requests, {FIELD: CancelRequest(s, reason).to_wire()})
                # a client resuming later reads the end of the sequence instead of waiting for tokens
                token_log.append_abort(pipe, self.keys, s, 0, reason)
                pipe.delete(self.keys.client_lease(s))
            await pipe.execute()

    def cancel_soon(self, seq_ids: list[str], reason: str = "abort") -> None:
        """Cancel from a context that may itself be cancelled (a client that went away)."""
        self.leases.drop(seq_ids)
        self.background.spawn(self.cancel_logged(seq_ids, reason))

    async def cancel_logged(self, seq_ids: list[str], reason: str = "abort") -> None:
        try:
            await self.cancel(seq_ids, reason)
            log.info("cancelled", seq_ids=seq_ids, reason=reason)
        except REDIS_ERRORS as e:
            log.warning("cancel failed", seq_ids=seq_ids, error=str(e))
