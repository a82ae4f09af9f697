"""The scheduler's look at its workers, once a refresh interval (I/O): it marks itself alive, reads the
workers' heartbeats (phaseserve/live_workers.py, the one reader), fences every worker it adopts with its
epoch, tells the cluster who left, joined or drains, and cancels the sequences whose gateway and client are
gone (scheduler/client_lease.py)."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from phaseserve.live_workers import read_live_workers
from phaseserve.wire import FIELD, STREAM_MAXLEN, Keys, StepPlan, WorkerInfo
from phaseserve.scheduler.client_lease import OrphanTracker
from phaseserve.scheduler.cluster import Cluster
from phaseserve.scheduler.redis_writes import LogAbort


@dataclass
class WorkerRefresh:
    client: aioredis.Redis
    keys: Keys
    consumer: str  # the scheduler's name: its alive marks say it
    cluster: Cluster
    orphans: OrphanTracker  # sequences whose gateway and client are gone
    interval: float  # seconds between refreshes
    view_wanted: bool = False  # a gateway's live view is open (Keys.stack_view_wanted, read each refresh)

    async def refresh(self, now: float, epoch: int, blameless: bool) -> None:
        """One look; `blameless`: Redis was unreachable since the last (no strikes for workers lost with
        it)."""
        alive_ms = max(3000, int(3000 * self.interval))
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.scheduler_alive(), self.consumer, px=alive_ms)
        pipe.set(self.keys.scheduler_seen(self.consumer), epoch, px=alive_ms)
        pipe.exists(self.keys.stack_view_wanted())  # the live view's flag rides along: no round trip of its own
        *_marks, wanted = await pipe.execute()
        self.view_wanted = self.cluster.watched = bool(wanted)
        live = await read_live_workers(self.client, self.keys)
        self.cluster.gone_workers(live, blameless=blameless)
        for wid, info in live.items():
            if wid not in self.cluster.workers:
                await self.adopt(info, epoch)
            self.cluster.worker_seen(info, now)
        self.cluster.workers_refreshed()
        await self.cancel_orphans(now)
        self.cluster.vouch_for_quiet_sequences()

    async def adopt(self, info: WorkerInfo, epoch: int) -> None:
        # plans left in its stream by an earlier scheduler would write into blocks this one hands out
        # then a fence: the worker forgets every sequence it holds (another scheduler's, or a life we retired),
        # and from here on drops plans of an older epoch (a deposed scheduler's late ones). Its result
        # (step -1) matches no open step.
        steps = self.keys.steps(info.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xtrim(steps, maxlen=0)
        pipe.xadd(steps, {FIELD: StepPlan(-1, info.worker_id, epoch=epoch, reset=True).to_wire()},
                  maxlen=STREAM_MAXLEN, approximate=True)
        await pipe.execute()
        self.cluster.add_worker(info, epoch)

    async def cancel_orphans(self, now: float) -> None:
        """Cancel the sequences nobody serves any more: a gateway refreshes a client lease for every sequence
        it streams (scheduler/client_lease.py); one that died leaves leases that expire, and after the resume
        grace its sequences stop generating instead of running to the end of their context."""
        seq_ids = self.cluster.sequence_ids()
        leases = await self.client.mget([self.keys.client_lease(s) for s in seq_ids]) if seq_ids else []
        for rid in self.orphans.update(seq_ids, [v is not None for v in leases], now):
            self.cluster.cancel(rid, "no client or gateway left")
            self.cluster.ops.append(LogAbort(rid))
