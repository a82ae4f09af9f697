"""The scheduler's one reader of live workers: the heartbeats (WorkerInfo) of the `workers` set's members.
Every place the scheduler learns which workers live goes through `read_live_workers`."""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from phaseserve.wire import Keys, WireError, WorkerInfo

log = structlog.get_logger("scheduler.cluster")


async def read_live_workers(client: aioredis.Redis, keys: Keys) -> dict[str, WorkerInfo]:
    """The workers whose heartbeat key is there (it expires when they stop beating) and readable, by id."""
    members = sorted(m.decode() for m in await client.smembers(keys.workers))
    heartbeats = await client.mget([keys.worker_heartbeat(m) for m in members]) if members else []
    return live_workers(members, heartbeats)


def live_workers(members: list[str], heartbeats: list[bytes | None]) -> dict[str, WorkerInfo]:
    """The workers whose heartbeat is there and readable, by id."""
    live: dict[str, WorkerInfo] = {}
    for wid, data in zip(members, heartbeats):
        if data is None:
            continue
        try:
            live[wid] = WorkerInfo.from_wire(data)
        except (WireError, TypeError) as e:
            log.warning("unreadable heartbeat", worker_id=wid, error=str(e))
    return live
