"""Client leases: who serves a client of each sequence.

While this gateway serves a client of a sequence, it refreshes `Keys.client_lease(seq)` (value: this
serving's token) with the GatewayInfo heartbeat, and deletes it when the serving ends. A resume takes the
leases only where none is held (SET NX): a client still connected keeps its stream. A client that goes away
leaves its sequences running for `resume_grace_s`; then they are cancelled unless another serving (a resume)
has taken the lease. The refresh also asks, when submits WAIT for replicas, how many the primary has.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Awaitable, Callable

import redis.asyncio as aioredis
import structlog

from phaseserve.gateway.redis_connections import REDIS_ERRORS, BackgroundTasks
from phaseserve.gateway.token_delivery import DeliveryConfig
from phaseserve.wire import GatewayInfo, Keys

log = structlog.get_logger("gateway.leases")

# delete each lease that still holds this serving's token (a resume elsewhere may have taken it meanwhile)
_RELEASE_LEASES = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
"""


class ClientLeases:
    def __init__(self, redis: aioredis.Redis, keys: Keys, info: GatewayInfo, config: DeliveryConfig,
                 background: BackgroundTasks, cancel_orphans: Callable[[list[str]], Awaitable[None]],
                 watch_replicas: bool = False):
        self.redis, self.keys, self.info, self.config = redis, keys, info, config
        self.background = background
        self.cancel_orphans = cancel_orphans  # sequences nobody serves after their grace
        self.watch_replicas = watch_replicas
        # replicas the primary had at the last refresh: a WAIT waits for no more than are there, so a primary
        # left alone by a failover does not cost every submit the timeout
        self.connected_replicas: int | None = None
        self._held: dict[str, str] = {}  # seq id -> token of the serving that holds its lease here
        self._graces: dict[str, tuple[list[str], asyncio.Task]] = {}  # token -> its sequences, its timer
        self._release_script = redis.register_script(_RELEASE_LEASES)

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.config.lease_ttl_s * 1000))

    def new_token(self) -> str:
        return f"{self.info.gateway_id}:{uuid.uuid4().hex[:12]}"

    async def refresh(self) -> None:
        """Every third of the lease TTL: the gateway heartbeat and the lease of every sequence served here (and,
        when submits WAIT, how many replicas the primary has)."""
        while True:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(self.keys.gateway_heartbeat(self.info.gateway_id), self.info.to_wire(), px=self.ttl_ms)
                    for seq_id, token in self._held.items():
                        pipe.set(self.keys.client_lease(seq_id), token, px=self.ttl_ms)
                    if self.watch_replicas:
                        pipe.info("replication")
                    replies = await pipe.execute()
                if self.watch_replicas:
                    self.connected_replicas = int(replies[-1].get("connected_slaves", 0))
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                log.warning("refreshing client leases failed", error=str(e))
            await asyncio.sleep(self.config.lease_ttl_s / 3)

    def take(self, pipe, seq_ids: list[str]) -> str:
        """Queue the leases of new sequences on `pipe` (their submit's round trip); -> the serving's token."""
        token = self.new_token()
        for s in seq_ids:
            self._held[s] = token
            pipe.set(self.keys.client_lease(s), token, px=self.ttl_ms)
        return token

    async def attach(self, seq_ids: list[str]) -> str | None:
        """A resumed client is served here now: take the sequences' leases (a grace elsewhere then keeps them);
        -> their token, or None when another serving holds one."""
        token = self.new_token()
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.set(self.keys.client_lease(s), token, px=self.ttl_ms, nx=True)
            taken = await pipe.execute()
        if not all(taken):
            if any(taken):
                await self._release_script(keys=[self.keys.client_lease(s) for s, t in zip(seq_ids, taken) if t],
                                           args=[token])
            return None
        for s in seq_ids:
            self._held[s] = token
        return token

    def drop(self, seq_ids: list[str], token: str | None = None) -> None:
        """Stop refreshing these leases (only those this serving holds, when its token is given: a client
        that resumed on this same gateway holds them under a new token)."""
        for s in seq_ids:
            if token is None or self._held.get(s) == token:
                self._held.pop(s, None)

    def release(self, seq_ids: list[str], token: str | None) -> None:
        """The serving that holds these leases ended: stop refreshing them and delete them now (not when they
        expire), so the client can resume at once."""
        self.drop(seq_ids, token)
        if seq_ids and token:
            self.background.spawn(self._release_logged(seq_ids, token))

    async def _release_logged(self, seq_ids: list[str], token: str) -> None:
        try:
            await self._release_script(keys=[self.keys.client_lease(s) for s in seq_ids], args=[token])
        except REDIS_ERRORS as e:  # they expire anyway
            log.warning("releasing client leases failed", error=str(e))

    def cancel_after_grace(self, seq_ids: list[str], token: str) -> None:
        """The client went away: cancel after the resume grace, unless a resume took the lease meanwhile."""
        self.release(seq_ids, token)
        timer = self.background.spawn(self._cancel_unless_resumed(seq_ids, token, self.config.resume_grace_s))
        self._graces[token] = (seq_ids, timer)
        timer.add_done_callback(lambda _t: self._graces.pop(token, None))

    def end_graces(self) -> None:
        """Shutting down: requests waiting for a resume are decided now (cancelled unless another gateway
        took them)."""
        for token, (seq_ids, timer) in list(self._graces.items()):
            timer.cancel()
            self.background.spawn(self._cancel_unless_resumed(seq_ids, token, 0.0))

    async def _cancel_unless_resumed(self, seq_ids: list[str], token: str, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            holders = await self.redis.mget([self.keys.client_lease(s) for s in seq_ids])
        except REDIS_ERRORS as e:
            log.warning("reading client leases failed; cancelling", error=str(e))
            holders = [None] * len(seq_ids)
        orphans = [s for s, h in zip(seq_ids, holders) if h is None or h.decode() == token]
        if len(orphans) < len(seq_ids):
            log.info("resumed elsewhere: not cancelled", seq_ids=[s for s in seq_ids if s not in orphans])
        if orphans:
            await self.cancel_orphans(orphans)
