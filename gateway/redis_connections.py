"""The gateway's Redis connections, and the background tasks its Redis writes run in.

Commands share a bounded pool: a burst of requests waits up to pool_timeout for a connection instead of
opening one each (a burst of streams would hit Redis's 'Too many connections' and answer 503). A command on a
connection a Redis restart broke is retried on a new one (a re-sent submit is dropped by the scheduler as a
duplicate); a dead Redis still fails within the retries' connect timeouts (-> 503). The subscriber and the
follower block on reads: each has its own connection, and its loop reconnects (to a new primary after a
failover) and resubscribes.
"""

from __future__ import annotations

import asyncio

import redis.exceptions

from phaseserve.redis_client import connect_async

# what a lost or unreachable Redis raises: logged and retried (or answered 503), never a traceback
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisConnections:
    """The command pool, the token channel's subscriber, and the token-log follower's connection."""

    def __init__(self, redis_url: str, key_prefix: str, max_connections: int = 64, pool_timeout: float = 30.0):
        self.url = redis_url
        self.commands = connect_async(redis_url, None, key_prefix, max_connections=max(1, max_connections),
                                      pool_timeout=pool_timeout, socket_timeout=5.0)
        self.subscriber = connect_async(redis_url, None, key_prefix, retries=0, socket_timeout=None)
        self.follower = connect_async(redis_url, None, key_prefix, retries=0, socket_timeout=10.0)

    async def close(self) -> None:
        await self.commands.aclose()
        await self.commands.connection_pool.disconnect()
        await self.subscriber.aclose()
        await self.follower.aclose()


class BackgroundTasks:
    """Writes a request's handler does not wait for (a cancel from a handler being cancelled, usage, lease
    releases), kept referenced until they end and awaited a little at shutdown."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
