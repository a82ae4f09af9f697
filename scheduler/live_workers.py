"""The scheduler's one reader of live workers: the heartbeats (WorkerInfo) of the `workers` set's members,
read as they come back from Redis. Every place the scheduler learns which workers live goes through here."""

from __future__ import annotations

import structlog

from phaseserve.wire import WireError, WorkerInfo

log = structlog.get_logger("scheduler.cluster")


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
