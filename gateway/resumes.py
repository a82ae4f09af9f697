"""What a resumed stream (SSE Last-Event-ID, gateway/sse_ids.py) needs from Redis: the stack's key of resume
tokens, and whether its sequences can still be resumed."""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from phaseserve.wire import Keys


class Resumes:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys
        self._secret: bytes | None = None

    async def secret(self) -> bytes:
        """The stack's key of resume tokens: the first gateway to need it sets it, every gateway reads it."""
        if self._secret is None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.resume_secret(), secrets.token_bytes(32), nx=True)
                pipe.get(self.keys.resume_secret())
                self._secret = (await pipe.execute())[1]
        return self._secret

    async def resumable(self, seq_ids: list[str]) -> bool:
        """Whether these sequences can be resumed: the scheduler still has them, or their token logs are alive."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in seq_ids:
                pipe.exists(self.keys.request_record(s), self.keys.token_log(s))
            counts = await pipe.execute()
        return all(counts)
