"""The one reader of worker heartbeats (phaseserve/live_workers.py), against a real Redis."""

from __future__ import annotations

import asyncio

from phaseserve.live_workers import LiveWorkers, read_live_workers
from phaseserve.redis_client import connect_async
from phaseserve.wire import Keys, WorkerInfo


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "mixed", "m", num_blocks=64, block_size=16, max_model_len=512)


def test_live_workers_are_the_announced_ones_with_a_readable_heartbeat(redis_server):
    async def main():
        keys = Keys("lw")
        redis = connect_async(redis_server, None, keys.prefix)
        try:
            await redis.sadd(keys.workers, "w-b", "w-a", "w-gone", "w-garbled")
            await redis.set(keys.worker_heartbeat("w-a"), info("w-a").to_wire(), px=5000)
            await redis.set(keys.worker_heartbeat("w-b"), info("w-b").to_wire(), px=5000)
            await redis.set(keys.worker_heartbeat("w-garbled"), b"\x01not msgpack", px=5000)
            live = await read_live_workers(redis, keys)
            assert list(live) == ["w-a", "w-b"]  # in id order; the expired and the unreadable one are not live
            assert live["w-a"] == info("w-a")

            cache = LiveWorkers(redis, keys, max_age_s=60.0)
            assert [w.worker_id for w in await cache.alive()] == ["w-a", "w-b"]
            await redis.delete(keys.worker_heartbeat("w-b"))  # w-b stops beating
            assert [w.worker_id for w in await cache.alive()] == ["w-a", "w-b"]  # a young answer is reused
            assert [w.worker_id for w in await cache.alive(max_age_s=0.0)] == ["w-a"]

            await redis.delete(keys.workers)
            assert await read_live_workers(redis, keys) == {}
        finally:
            await redis.aclose()

    asyncio.run(main())
