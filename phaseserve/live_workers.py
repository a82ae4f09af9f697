"""The live workers of a stack: those whose heartbeat (a WorkerInfo under `Keys.worker_heartbeat`, set with a
TTL by each worker's relay) is there and readable. The one reader of heartbeats: the scheduler refreshes its
workers from it, the gateway bounds requests by it and reports it in /health."""

from __future__ import annotations

import time

import structlog

from phaseserve.wire import Keys, WireError, WorkerInfo

log = structlog.get_logger("phaseserve.live_workers")


def heartbeat_keys(keys: Keys, members: list[str]) -> list[str]:
    """The heartbeat keys of these workers, for one MGET (a caller may read more keys in the same one)."""
    return [keys.worker_heartbeat(m) for m in members]


def live_workers(members: list[str], heartbeats: list[bytes | None]) -> dict[str, WorkerInfo]:
    """The workers whose heartbeat is there and readable, by id (`heartbeats` answers `heartbeat_keys(members)`)."""
    live: dict[str, WorkerInfo] = {}
    for wid, data in zip(members, heartbeats):
        if data is None:
            continue  # expired: the worker stopped beating
        try:
            live[wid] = WorkerInfo.from_wire(data)
        except (WireError, TypeError) as e:
            log.warning("unreadable heartbeat", worker_id=wid, error=str(e))
    return live


async def worker_ids(redis, keys: Keys) -> list[str]:
    """Every worker ever announced (the set the relays add to), sorted."""
    return sorted(m.decode() if isinstance(m, bytes) else m for m in await redis.smembers(keys.workers))


async def read_live_workers(redis, keys: Keys) -> dict[str, WorkerInfo]:
    """The live workers, by id in id order: the announced set, then their heartbeats in one MGET."""
    members = await worker_ids(redis, keys)
    if not members:
        return {}
    return live_workers(members, await redis.mget(heartbeat_keys(keys, members)))


class LiveWorkers:
    """`read_live_workers` for a process that asks often (a gateway, on every request): an answer younger than
    `max_age_s` is reused."""

    def __init__(self, redis, keys: Keys, max_age_s: float = 0.5):
        self.redis, self.keys, self.max_age_s = redis, keys, max_age_s
        self._read_at = 0.0
        self._workers: list[WorkerInfo] = []

    async def alive(self, max_age_s: float | None = None) -> list[WorkerInfo]:
        """The live workers in id order, read anew when the last read is older than `max_age_s` (default: the
        cache's; 0: always)."""
        max_age = self.max_age_s if max_age_s is None else max_age_s
        if time.monotonic() - self._read_at < max_age:
            return self._workers
        self._workers = list((await read_live_workers(self.redis, self.keys)).values())
        self._read_at = time.monotonic()
        return self._workers
