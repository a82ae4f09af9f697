"""The scheduler service: the loop that moves messages between Redis and the scheduler's decisions, which
live elsewhere and are pure: each worker's steps in scheduler/policy.py, the choices between workers in
scheduler/cluster.py. Its I/O parts: the lease, epoch and takeover recovery (scheduler/leadership.py), the
look at the workers (worker_refresh.py), the streams read (stream_intake.py), the writes sent
(redis_writes.py) and the stats and live view shown (stats_publishing.py).

One loop, one Redis round trip per turn: a single non-transactional pipeline carries everything decided
since the last turn (step plans XADDed to each worker, XACKs, request records, the stats key) and ends with
ONE XREADGROUP that blocks on both the `requests` and the `results` stream. Each worker may have two plans
in flight, so it never idles on the scheduler's round trip (decode chunks need no token ids from the
scheduler: the worker owns the tokens).

Workers are discovered from the `workers` set plus their expiring heartbeat keys. A plan in flight has a
deadline (`step_timeout` from when it is due, plus a margin); a lost plan or result never strands a worker.
An unseeded sampled request is given a seed at admission (kept in its record), so a recompute samples the
tokens the client already has (exactly in float32; see docs/architecture.md for bf16). Redis outages:
commands retry with backoff, the loop waits and resumes, consumer groups are recreated.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from phaseserve import event_loop
from phaseserve.procs import freeze_startup_heap
from phaseserve.redis_client import CONNECTION_ERRORS, Backoff, connect_async
from phaseserve.wire import FIELD, STREAM_MAXLEN, Keys, SubmitRequest
from phaseserve.scheduler.client_lease import OrphanTracker
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.scheduler.leadership import READ_COUNT, Leadership, LeaseLost, claim_pending, create_groups, recover_records
from phaseserve.scheduler.redis_writes import queue_writes
from phaseserve.scheduler.stats_publishing import StatsWriter, ViewWriter
from phaseserve.scheduler.step_deadlines import StepTimeouts
from phaseserve.scheduler.stream_intake import StreamIntake
from phaseserve.scheduler.worker_refresh import WorkerRefresh

log = structlog.get_logger("phaseserve.scheduler.service")


class SchedulerService:
    def __init__(self, client: aioredis.Redis, keys: Keys, limits: PolicyLimits, *, consumer: str | None = None,
                 heartbeat_interval: float = 1.0, plans_in_flight: int = 2, plan_ahead_s: float = 0.1,
                 step_timeout: float = 30.0, lease_ttl: float = 5.0, resume_grace: float = 10.0,
                 drain_timeout: float = 30.0, step_timeout_floor: float = 3.0, step_timeout_factor: float = 10.0,
                 quarantine_after: int = 2):
        self.client = client
        self.keys = keys
        self.limits = limits
        # unique per process: pending entries of a dead scheduler are another consumer's, claimed at takeover
        self.consumer = consumer or f"scheduler-{socket.gethostname()}-{os.getpid()}"
        self.refresh_interval = max(0.05, heartbeat_interval)
        self.plans_in_flight = max(1, plans_in_flight)
        self.plan_ahead_s = plan_ahead_s  # see WorkerSteps.plan
        # the margin: a refresh longer than the relay waits, so a hung model's heartbeat is withdrawn first
        self.timeouts = StepTimeouts(step_timeout, step_timeout_floor, step_timeout_factor,
                                     limits.max_num_batched_tokens, margin_s=max(1.0, self.refresh_interval))
        self.leadership = Leadership(client, keys, self.consumer, lease_ttl)
        self.lease_ttl_ms = self.leadership.lease_ttl_ms
        self.resume_grace = resume_grace
        self.drain_timeout = drain_timeout  # how long a draining worker's running sequences may finish there
        self.quarantine_after = quarantine_after  # worker failures a sequence may be present at (quarantine.py)
        self._reset_state()

    def _reset_state(self) -> None:
        """Everything a scheduler knows is rebuilt from Redis when it takes the lease."""
        self.cluster = Cluster(self.keys, self.limits, self.drain_timeout, self.quarantine_after)
        # Redis was unreachable (or came back empty) since the last refresh: workers whose heartbeats lapsed
        # with it are retired without a strike against their sequences (scheduler/quarantine.py)
        self.redis_trouble = getattr(self, "redis_trouble", False)
        self.leadership.renew_at = 0.0
        self.stopping = getattr(self, "stopping", None) or asyncio.Event()
        self._next_refresh = 0.0
        self._next_claim = 0.0
        self.refresher = WorkerRefresh(self.client, self.keys, self.consumer, self.cluster,
                                       OrphanTracker(self.resume_grace), self.refresh_interval)
        # `admit` looked up at each call: a test wraps the service's to time admissions
        self.intake = StreamIntake(self.cluster, self.keys, lambda: self.epoch, lambda req: self.admit(req))
        self.stats_writer = StatsWriter(self.keys)
        self.view_writer = ViewWriter(self.keys)

    # the parts' state and queries, as callers (and tests) read them
    workers = property(lambda self: self.cluster.workers)
    owner = property(lambda self: self.cluster.owner)
    parked = property(lambda self: self.cluster.parked)
    handoffs = property(lambda self: self.cluster.handoffs)
    num_steps_given_up = property(lambda self: self.cluster.num_steps_given_up)
    is_known = property(lambda self: self.cluster.is_known)
    stats = property(lambda self: self.cluster.stats)
    epoch = property(lambda self: self.leadership.epoch)
    orphans = property(lambda self: self.refresher.orphans)
    view_wanted = property(lambda self: self.refresher.view_wanted)
    num_dead_letters = property(lambda self: self.intake.num_dead_letters)
    num_duplicates = property(lambda self: self.intake.num_duplicates)
    base_step_timeout = property(lambda self: self.timeouts.base_s)
    step_timeout_floor = property(lambda self: self.timeouts.floor_s)
    step_timeout = property(lambda self: self.timeouts.step_timeout)
    plan_timeout = property(lambda self: self.timeouts.plan_timeout)

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        """(A method, not an alias: a test wraps it to time admissions.)"""
        return self.cluster.admit(req, output_ids)

    # ------------------------------------------------------------------ lease and takeover

    async def acquire_lease(self) -> None:
        await self.leadership.acquire(self.stopping)

    async def release_lease(self) -> None:
        await self.leadership.release()

    async def setup(self) -> None:
        await create_groups(self.client, self.keys)
        await self.refresh_workers(time.monotonic())
        await recover_records(self.client, self.keys, self.cluster)
        await self.claim_pending()

    async def claim_pending(self, min_idle_ms: int = 0) -> None:
        await claim_pending(self.client, self.keys, self.consumer, self.intake.handle, min_idle_ms)
        self._next_claim = time.monotonic() + self.lease_ttl_ms / 1000

    async def refresh_workers(self, now: float) -> None:
        self._next_refresh = now + self.refresh_interval
        await self.refresher.refresh(now, self.epoch, blameless=self.redis_trouble)
        self.redis_trouble = False

    # ------------------------------------------------------------------ the loop

    def plan_steps(self, pipe, now: float | None = None) -> int:
        """Fill every worker's pipeline of plans; returns how many plans were queued."""
        now = time.monotonic() if now is None else now
        plans = self.cluster.plan_steps(now, self.epoch, self.plans_in_flight, self.timeouts.plan_timeout,
                                        self.timeouts.margin_s, self.plan_ahead_s)
        for wid, plan in plans:
            pipe.xadd(self.keys.steps(wid), {FIELD: plan.to_wire()}, maxlen=STREAM_MAXLEN, approximate=True)
        return len(plans)

    def maybe_write_stats(self, pipe, now: float) -> float | None:
        return self.stats_writer.maybe_write(pipe, self.cluster, now)

    def maybe_write_view(self, pipe, now: float) -> float | None:
        return self.view_writer.maybe_write(pipe, self.cluster, now, self.view_wanted)

    async def run(self) -> None:
        """Standby until the lease is ours, then lead until stopped (or the lease is lost: standby again).
        A Redis outage is waited out with backoff; the state survives it."""
        backoff = Backoff()
        ready = False
        try:
            while not self.stopping.is_set():
                try:
                    if not self.leadership.is_leader:
                        ready = False
                        self._reset_state()
                        await self.acquire_lease()
                        if self.stopping.is_set():
                            break
                    if not ready:
                        await self.setup()
                        ready = True
                        log.info("scheduler ready", consumer=self.consumer, epoch=self.epoch,
                                 workers=len(self.workers))
                    await self.lead(backoff)
                except LeaseLost as e:
                    log.error("lease lost to another scheduler; standing by", holder=str(e))
                    self.leadership.is_leader = False
                except ResponseError as e:
                    # Redis came back without its data (a claim or read met no group): set up again, which
                    # recreates the groups; the lease is renewed by the next turn (RENEW_LEASE takes it back)
                    if "NOGROUP" not in str(e):
                        raise
                    log.warning("consumer group missing; recreating", error=str(e))
                    ready = False
                    self.redis_trouble = True
                except CONNECTION_ERRORS as e:
                    self.redis_trouble = True
                    delay = backoff.next_delay()
                    log.warning("redis unreachable; retrying", error=str(e), retry_in_s=round(delay, 2))
                    try:
                        await asyncio.wait_for(self.stopping.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
        finally:
            try:
                await self.release_lease()
            except (*CONNECTION_ERRORS, ResponseError):
                pass
        log.info("scheduler stopped")

    async def lead(self, backoff: Backoff) -> None:
        streams = {self.keys.requests: ">", self.keys.results: ">"}
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= self._next_refresh:
                await self.refresh_workers(now)
            if now >= self._next_claim:
                await self.claim_pending(min_idle_ms=2 * self.lease_ttl_ms)
            next_deadline = self.cluster.give_up_overdue_steps(now)
            self.cluster.advance_drains(now, self.epoch)
            ops, acks = list(self.cluster.ops), list(self.intake.acks)  # restored if Redis is unreachable
            pipe = self.client.pipeline(transaction=False)
            renewing = self.leadership.renew(pipe, now)
            # request records and publishes decided while handling the last read
            queue_writes(pipe, self.keys, self.cluster.ops)
            planned_before = {wid: len(slot.in_flight) for wid, slot in self.workers.items()}
            self.plan_steps(pipe, now)
            for stream, ids in self.intake.acks:
                pipe.xack(stream, self.keys.scheduler_group, *ids)
                pipe.xdel(stream, *ids)  # acknowledged entries are history nobody reads
            self.intake.acks.clear()
            stats_wait = self.maybe_write_stats(pipe, now)
            view_wait = self.maybe_write_view(pipe, now)
            block_s = self._next_refresh - now
            for wait in (stats_wait, view_wait, next_deadline, self.leadership.renew_at - now):
                if wait is not None:
                    block_s = min(block_s, wait)
            block_ms = max(1, int(block_s * 1000))
            # the blocking read rides in the same pipeline: one round trip per turn
            pipe.xreadgroup(self.keys.scheduler_group, self.consumer, streams, count=READ_COUNT, block=block_ms)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except CONNECTION_ERRORS:
                self.cluster.ops[:0], self.intake.acks[:0] = ops, acks
                self.leadership.renew_at = 0.0  # renew first thing once Redis is back
                self.cluster.void_unsent_plans(planned_before)
                raise
            backoff.reset()
            if renewing and replies[0] != 1:
                raise LeaseLost(await self.client.get(self.keys.scheduler_lease()))
            errors = [r for r in replies if isinstance(r, ResponseError)]
            if any("NOGROUP" in str(r) for r in errors):  # Redis was flushed or restarted: recreate the groups
                log.warning("consumer group missing; recreating", error=str(errors[0]))
                self.redis_trouble = True
                await self.setup()
                continue
            for err in errors:
                log.error("a scheduler write failed", error=str(err))
            if not isinstance(replies[-1], ResponseError):
                self.intake.handle(replies[-1])

    def stop(self) -> None:
        self.stopping.set()


async def serve(args) -> None:
    client = connect_async(args.redis_url, name=f"{args.key_prefix}:scheduler", key_prefix=args.key_prefix)
    limits = PolicyLimits(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                          args.attention_horizon, args.long_prefill_threshold, kv_transport=args.kv_transport,
                          itl_target=args.itl_target, itl_patience_s=args.itl_patience,
                          tenant_wait_s=args.tenant_wait, enable_prefix_caching=args.enable_prefix_caching)
    service = SchedulerService(client, Keys(args.key_prefix), limits, heartbeat_interval=args.heartbeat_interval,
                               plan_ahead_s=args.plan_ahead, step_timeout=args.step_timeout,
                               lease_ttl=args.scheduler_lease_ttl, resume_grace=args.resume_grace,
                               drain_timeout=args.drain_timeout, step_timeout_floor=args.step_timeout_floor,
                               step_timeout_factor=args.step_timeout_factor,
                               quarantine_after=args.quarantine_after)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    try:
        await service.run()
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    from phaseserve import logs, settings

    args = settings.parse("scheduler", argv, prog="phaseserve scheduler")
    logs.configure("scheduler", args.log_level, args.log_json)
    if not args.redis_url:
        raise SystemExit("phaseserve scheduler: --redis-url (or REDIS_URL) is required")
    if args.attention_horizon is not None and args.attention_horizon < 0:
        raise SystemExit(f"phaseserve scheduler: --attention-horizon must be >= 0 (0 = off), "
                         f"got {args.attention_horizon}")
    if args.long_prefill_threshold < 0:
        raise SystemExit(f"phaseserve scheduler: --long-prefill-threshold must be >= 0 (0 = no cap), "
                         f"got {args.long_prefill_threshold}")
    for name in ("step_timeout", "scheduler_lease_ttl", "heartbeat_interval", "step_timeout_floor"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"phaseserve scheduler: --{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.step_timeout_factor >= 0:
        raise SystemExit(f"phaseserve scheduler: --step-timeout-factor must be >= 0 (0 = always --step-timeout), "
                         f"got {args.step_timeout_factor}")
    if not args.drain_timeout >= 0:
        raise SystemExit(f"phaseserve scheduler: --drain-timeout must be >= 0 (0 = hand back at once), "
                         f"got {args.drain_timeout}")
    if args.quarantine_after < 0:
        raise SystemExit(f"phaseserve scheduler: --quarantine-after must be >= 0 (0 = never), "
                         f"got {args.quarantine_after}")
    freeze_startup_heap()
    event_loop.run(serve(args))
    return 0
