"""Stored Responses in Redis: any gateway of the stack reads them, they expire after --responses-ttl.

One key a response (`Keys.response(id)`), JSON: the Response object, the whole conversation up to and
including its output (what a request naming it as `previous_response_id` continues), and its owner: a
digest of the API key that created it. A response is read only with the same key; another key gets the
same answer as an unknown id (404), so ids learn nothing across keys. Without API keys (none configured)
the owner is the empty digest, shared by every client.
"""

from __future__ import annotations

import hmac
import json

import redis.asyncio as aioredis

from phaseserve.wire import Keys


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float, replicas=lambda: 0,
                 wait_timeout_ms: int = 500):
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.replicas = replicas  # -> replicas a save waits for (--redis-wait-replicas; docs/redis.md)
        self.wait_timeout_ms = wait_timeout_ms

    async def save(self, response: dict, conversation: list[dict], owner: str) -> None:
        """Store (or replace) a response. Nothing rebuilds one that a failover loses, so the save WAITs for
        the replicas the submit waits for (a conversation would otherwise answer 404 on its next turn)."""
        record = {"owner": owner, "response": response, "conversation": conversation}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.response(response["id"]), json.dumps(record, ensure_ascii=False), px=self.ttl_ms)
            wanted = self.replicas()
            if wanted:
                pipe.wait(wanted, self.wait_timeout_ms)
            await pipe.execute()

    async def load(self, response_id: str, owner: str) -> dict | None:
        """The record ({owner, response, conversation}), or None: unknown, expired, or another key's."""
        raw = await self.redis.get(self.keys.response(response_id))
        if raw is None:
            return None
        record = json.loads(raw)
        return record if hmac.compare_digest(record.get("owner", ""), owner) else None

    async def update_status(self, response_id: str, owner: str, status: str) -> dict | None:
        """Set a stored response's status (cancel), keeping its expiry; -> the record, or None."""
        record = await self.load(response_id, owner)
        if record is None:
            return None
        record["response"]["status"] = status
        await self.redis.set(self.keys.response(response_id), json.dumps(record, ensure_ascii=False), keepttl=True)
        return record

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.load(response_id, owner) is None:
            return False
        return bool(await self.redis.delete(self.keys.response(response_id)))
