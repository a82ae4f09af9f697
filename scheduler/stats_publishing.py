"""What the scheduler shows of itself in Redis: the stats key (the gateways' /metrics read it), written at
most every STATS_INTERVAL_S and only when it changed, and the live view's snapshot while a gateway watches
(phaseserve/stack_view.py). Both are queued on the turn's pipeline."""

from __future__ import annotations

import dataclasses
import time

import msgpack

from phaseserve.scheduler_stats import SchedulerStats
from phaseserve.stack_view import STACK_VIEW_IDLE_INTERVAL_S, STACK_VIEW_INTERVAL_S, STACK_VIEW_TTL_S
from phaseserve.wire import Keys
from phaseserve.scheduler.cluster import Cluster

STATS_INTERVAL_S = 0.1  # the stats key is written at most ~10 times a second


class StatsWriter:
    def __init__(self, keys: Keys):
        self.keys = keys
        self.written_at = 0.0
        self.last: SchedulerStats | None = None

    def maybe_write(self, pipe, cluster: Cluster, now: float) -> float | None:
        """Queue the stats write if due; returns seconds until a deferred write is due (or None)."""
        if not cluster.stats_dirty:
            return None
        wait = self.written_at + STATS_INTERVAL_S - now
        if wait > 0:
            return wait
        stats = cluster.stats()
        cluster.stats_dirty = False
        if stats != self.last:
            self.last = stats
            published = dataclasses.replace(stats, updated_at=time.time())
            pipe.set(self.keys.scheduler_stats(), msgpack.packb(published.to_wire()))
            self.written_at = now
        return None


class ViewWriter:
    def __init__(self, keys: Keys):
        self.keys = keys
        self.written_at = 0.0

    def maybe_write(self, pipe, cluster: Cluster, now: float, wanted: bool) -> float | None:
        """Queue the live view's snapshot if someone watches (`wanted`) and it is due; returns seconds until
        the next is due (None: nobody watches)."""
        if not wanted:
            return None
        busy = bool(cluster.owner or cluster.parked)
        wait = self.written_at + (STACK_VIEW_INTERVAL_S if busy else STACK_VIEW_IDLE_INTERVAL_S) - now
        if wait > 0:
            return wait
        pipe.set(self.keys.stack_view(), cluster.view(time.time(), now).to_wire(), px=int(STACK_VIEW_TTL_S * 1000))
        self.written_at = now
        return STACK_VIEW_INTERVAL_S if busy else STACK_VIEW_IDLE_INTERVAL_S
