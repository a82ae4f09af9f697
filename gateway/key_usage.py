"""Each API key's usage so far (`Keys.key_usage`, a hash added to by every gateway as its requests end; read
by GET /v1/usage, docs/tenants.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
import structlog

from phaseserve.gateway.redis_connections import REDIS_ERRORS, BackgroundTasks
from phaseserve.wire import Keys

log = structlog.get_logger("gateway.usage")


@dataclass
class RequestUsage:
    """What one finished request adds to its key's usage: the hash's fields, by name."""

    requests: int = 1
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class KeyUsage:
    def __init__(self, redis: aioredis.Redis, keys: Keys, background: BackgroundTasks):
        self.redis, self.keys, self.background = redis, keys, background

    def add(self, key_name: str, usage: RequestUsage) -> None:
        """Add a finished request's counts to its key's usage (in the background: the response is sent)."""
        self.background.spawn(self._add(key_name, usage))

    async def _add(self, key_name: str, usage: RequestUsage) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, n in asdict(usage).items():
                    pipe.hincrby(self.keys.key_usage(key_name), name, n)
                await pipe.execute()
        except REDIS_ERRORS as e:
            log.warning("usage not recorded", error=str(e))

    async def read(self, key_name: str) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.key_usage(key_name))
        return {k.decode(): int(v) for k, v in raw.items()}
