"""What the gateway reads of the scheduler, for /health and /metrics: its liveness mark and its stats."""

from __future__ import annotations

import msgpack
import redis.asyncio as aioredis
import structlog

from phaseserve.wire import Keys

log = structlog.get_logger("gateway.scheduler_state")


class SchedulerState:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys

    async def alive(self) -> bool:
        """Whether the active scheduler's mark is there (it expires a few worker refreshes after its last)."""
        return bool(await self.redis.exists(self.keys.scheduler_alive()))

    async def stats(self) -> dict | None:
        raw = await self.redis.get(self.keys.scheduler_stats())
        if raw is None:
            return None
        try:
            stats = msgpack.unpackb(raw, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
            log.warning("bad scheduler stats", error=str(e))
            return None
        return stats if isinstance(stats, dict) else None
