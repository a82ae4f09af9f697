"""The scheduler service: the loop that moves messages between Redis and the scheduler's decisions, which
live elsewhere and are pure: each worker's steps in scheduler/policy.py, the choices between workers in
scheduler/cluster.py; the lease, epoch and takeover recovery are scheduler/leadership.py.

One loop, one Redis round trip per turn: a single non-transactional pipeline carries everything decided
since the last turn (step plans XADDed to each worker, XACKs, request records, the stats key) and ends with
ONE XREADGROUP that blocks on both the `requests` and the `results` stream. Each worker may have two plans
in flight, so it never idles on the scheduler's round trip (decode chunks need no token ids from the
scheduler: the worker owns the tokens).

Workers are discovered from the `workers` set plus their expiring heartbeat keys. A plan in flight has a
deadline (`step_timeout` from when it is due, plus a margin); a lost plan or result never strands a worker.
A message nobody can read goes to `Keys.dead_letters` with the reason, and a submit whose request id and
gateway can be read gets an error event. An unseeded sampled request is given a seed at admission (kept in
its record), so a recompute samples the tokens the client already has (exactly in float32; see
docs/architecture.md for bf16). Redis outages: commands retry with backoff, the loop waits and resumes,
consumer groups are recreated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import socket
import time

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from phaseserve import event_loop, token_log
from phaseserve.procs import freeze_startup_heap
from phaseserve.redis_client import CONNECTION_ERRORS, Backoff, connect_async
from phaseserve.scheduler_stats import SchedulerStats
from phaseserve.stack_view import STACK_VIEW_IDLE_INTERVAL_S, STACK_VIEW_INTERVAL_S, STACK_VIEW_TTL_S
from phaseserve.wire import (
    FIELD, FIELD_BYTES, OUTPUT_FIELD_PREFIX, STREAM_MAXLEN, CancelRequest, Keys, StepPlan, StepResult,
    SubmitRequest, WireError, WorkerInfo, peek_kind,
)
from scheduler.client_lease import OrphanTracker
from scheduler.cluster import Cluster, PolicyLimits, live_workers
from scheduler.leadership import READ_COUNT, Leadership, LeaseLost, claim_pending, create_groups, recover_records
from scheduler.step_cost import step_deadline

log = structlog.get_logger("scheduler.service")

STATS_INTERVAL_S = 0.1  # the stats key is written at most ~10 times a second
DEAD_LETTER_MAXLEN = 10_000


class SchedulerService:
    def __init__(self, client: aioredis.Redis, keys: Keys, limits: PolicyLimits, *, consumer: str | None = None,
                 heartbeat_interval: float = 1.0, plans_in_flight: int = 2, step_timeout: float = 30.0,
                 lease_ttl: float = 5.0, resume_grace: float = 10.0, drain_timeout: float = 30.0,
                 step_timeout_floor: float = 3.0, step_timeout_factor: float = 10.0, quarantine_after: int = 2):
        self.client = client
        self.keys = keys
        self.limits = limits
        # unique per process: pending entries of a dead scheduler are another consumer's, claimed at takeover
        self.consumer = consumer or f"scheduler-{socket.gethostname()}-{os.getpid()}"
        self.refresh_interval = max(0.05, heartbeat_interval)
        self.plans_in_flight = max(1, plans_in_flight)
        # the worker's relay gives up on a step after its timeout; we wait a refresh longer, so its
        # heartbeat is withdrawn (a hung model: retire) before we give up on the step (a lost message)
        self.base_step_timeout = step_timeout
        # once a worker's step costs are learned, a step's deadline is this factor times its predicted time,
        # never below the floor: a frozen model is found in seconds, not after --step-timeout
        self.step_timeout_floor = step_timeout_floor
        self.step_timeout_factor = step_timeout_factor
        self.deadline_margin = max(1.0, self.refresh_interval)
        self.leadership = Leadership(client, keys, self.consumer, lease_ttl)
        self.lease_ttl_ms = self.leadership.lease_ttl_ms
        self.resume_grace = resume_grace
        self.drain_timeout = drain_timeout  # how long a draining worker's running sequences may finish there
        self.quarantine_after = quarantine_after  # worker failures a sequence may be present at (cluster.py)
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
        self._stats_written_at = 0.0
        self.view_wanted = False  # a gateway's live view is open (Keys.stack_view_wanted, read each refresh)
        self._view_written_at = 0.0
        self._last_stats: SchedulerStats | None = None
        self._acks: list[tuple[str, list]] = []
        self._next_claim = 0.0
        self.num_dead_letters = 0
        self.num_duplicates = 0
        self.orphans = OrphanTracker(self.resume_grace)  # sequences whose gateway and client are gone

    # the cluster's state and queries, as callers (and tests) read them
    workers = property(lambda self: self.cluster.workers)
    owner = property(lambda self: self.cluster.owner)
    parked = property(lambda self: self.cluster.parked)
    handoffs = property(lambda self: self.cluster.handoffs)
    num_steps_given_up = property(lambda self: self.cluster.num_steps_given_up)
    is_known = property(lambda self: self.cluster.is_known)
    stats = property(lambda self: self.cluster.stats)
    epoch = property(lambda self: self.leadership.epoch)
    _stats_dirty = property(lambda self: self.cluster.stats_dirty,
                            lambda self, dirty: setattr(self.cluster, "stats_dirty", dirty))

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
        await claim_pending(self.client, self.keys, self.consumer, self.handle, min_idle_ms)
        self._next_claim = time.monotonic() + self.lease_ttl_ms / 1000

    # ------------------------------------------------------------------ workers

    async def refresh_workers(self, now: float) -> None:
        self._next_refresh = now + self.refresh_interval
        alive_ms = max(3000, int(3000 * self.refresh_interval))
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.scheduler_alive(), self.consumer, px=alive_ms)
        pipe.set(self.keys.scheduler_seen(self.consumer), self.leadership.epoch, px=alive_ms)
        await pipe.execute()
        members = sorted(m.decode() for m in await self.client.smembers(self.keys.workers))
        # the live view's flag rides with the heartbeats: no round trip of its own
        *beats, wanted = await self.client.mget([self.keys.worker_heartbeat(m) for m in members]
                                                + [self.keys.stack_view_wanted()])
        self.view_wanted = self.cluster.watched = wanted is not None
        live = live_workers(members, beats)
        self.cluster.gone_workers(live, blameless=self.redis_trouble)
        self.redis_trouble = False
        for wid, info in live.items():
            if wid not in self.workers:
                await self.adopt_worker(info)
            self.cluster.worker_seen(info, now)
        self.cluster.workers_refreshed()
        await self.cancel_orphans(now)
        self.cluster.vouch_for_quiet_sequences()

    async def cancel_orphans(self, now: float) -> None:
        """Cancel the sequences nobody serves any more: a gateway refreshes a client lease for every sequence
        it streams (scheduler/client_lease.py); one that died leaves leases that expire, and after the resume
        grace its sequences stop generating instead of running to the end of their context."""
        seq_ids = self.cluster.sequence_ids()
        leases = await self.client.mget([self.keys.client_lease(s) for s in seq_ids]) if seq_ids else []
        for rid in self.orphans.update(seq_ids, [v is not None for v in leases], now):
            self.cluster.cancel(rid, "no client or gateway left")
            self.cluster.ops.append(("abort", rid))

    async def adopt_worker(self, info: WorkerInfo) -> None:
        # plans left in its stream by an earlier scheduler would write into blocks this one hands out
        # then a fence: the worker forgets every sequence it holds (another scheduler's, or a life we retired),
        # and from here on drops plans of an older epoch (a deposed scheduler's late ones). Its result
        # (step -1) matches no open step.
        steps = self.keys.steps(info.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xtrim(steps, maxlen=0)
        pipe.xadd(steps, {FIELD: StepPlan(-1, info.worker_id, epoch=self.epoch, reset=True).to_wire()},
                  maxlen=STREAM_MAXLEN, approximate=True)
        await pipe.execute()
        self.cluster.add_worker(info, self.epoch)

    # ------------------------------------------------------------------ requests and results

    def on_submit(self, data: bytes) -> None:
        req = SubmitRequest.from_wire(data)
        if self.is_known(req.request_id):  # a claimed pending entry of a request recovered from its record
            self.num_duplicates += 1
            log.info("dropping a duplicate submit", request_id=req.request_id)
            # or the entry came back because a Redis failover lost our ack of it, and with it (written
            # before it, so lost too) the request's record: written again, with its outputs at the next write
            admitted = self.cluster.request_of(req.request_id)
            if admitted is not None:
                self.cluster.ops.append(("record", self.keys.request_record(req.request_id), admitted.to_wire()))
                if req.request_id in self.cluster.outputs_written:
                    self.cluster.outputs_written[req.request_id] = 0
            return
        if req.params.seed is None and not req.params.greedy:
            # a seed of its own, kept in the record: a recompute (worker lost, scheduler fail-over) then
            # samples again the tokens its client already has, so the stream stays one sample
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=random.getrandbits(63)))
            data = req.to_wire()
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        try:
            # the record first (same pipeline, earlier): a restarted scheduler finds every admitted request
            self.cluster.ops.append(("record", self.keys.request_record(req.request_id), data))
            self.admit(req)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def on_cancel(self, data: bytes) -> None:
        msg = CancelRequest.from_wire(data)
        self.cluster.cancel(msg.request_id, msg.reason)

    def on_result(self, data: bytes) -> None:
        self.cluster.apply_result(StepResult.from_wire(data), self.epoch, time.monotonic())

    @property
    def step_timeout(self) -> float:
        """How long a step of at most the budget may go without a result before it is given up."""
        return self.base_step_timeout + self.deadline_margin

    def plan_timeout(self, plan: StepPlan, expected_s: float | None = None) -> float:
        """A step's deadline (the relay withdraws the heartbeat of a model that overruns it): from what the
        worker's learned step costs expect of it when there are some (step_deadline), else --step-timeout,
        scaled for a step larger than the token budget (chunked prefill off)."""
        fallback = self.base_step_timeout * max(1.0, plan.num_tokens / self.limits.max_num_batched_tokens)
        return step_deadline(expected_s, floor_s=self.step_timeout_floor, factor=self.step_timeout_factor,
                             fallback_s=fallback)

    # ------------------------------------------------------------------ the loop

    def plan_steps(self, pipe, now: float | None = None) -> int:
        """Fill every worker's pipeline of plans; returns how many plans were queued."""
        now = time.monotonic() if now is None else now
        plans = self.cluster.plan_steps(now, self.epoch, self.plans_in_flight, self.plan_timeout,
                                        self.deadline_margin)
        for wid, plan in plans:
            pipe.xadd(self.keys.steps(wid), {FIELD: plan.to_wire()}, maxlen=STREAM_MAXLEN, approximate=True)
        return len(plans)

    def maybe_write_stats(self, pipe, now: float) -> float | None:
        """Queue the stats write if due; returns seconds until a deferred write is due (or None)."""
        if not self._stats_dirty:
            return None
        wait = self._stats_written_at + STATS_INTERVAL_S - now
        if wait > 0:
            return wait
        stats = self.stats()
        self._stats_dirty = False
        if stats != self._last_stats:
            self._last_stats = stats
            published = dataclasses.replace(stats, updated_at=time.time())
            pipe.set(self.keys.scheduler_stats(), msgpack.packb(published.to_wire()))
            self._stats_written_at = now
        return None

    def maybe_write_view(self, pipe, now: float) -> float | None:
        """Queue the live view's snapshot (phaseserve/stack_view.py) if someone watches and it is due;
        returns seconds until the next is due (None: nobody watches)."""
        if not self.view_wanted:
            return None
        busy = bool(self.cluster.owner or self.cluster.parked)
        wait = self._view_written_at + (STACK_VIEW_INTERVAL_S if busy else STACK_VIEW_IDLE_INTERVAL_S) - now
        if wait > 0:
            return wait
        pipe.set(self.keys.stack_view(), self.cluster.view(time.time(), now).to_wire(), px=int(STACK_VIEW_TTL_S * 1000))
        self._view_written_at = now
        return STACK_VIEW_INTERVAL_S if busy else STACK_VIEW_IDLE_INTERVAL_S

    def _flush_ops(self, pipe) -> None:
        for op in self.cluster.ops:
            kind, key = op[0], op[1]
            if kind == "record":
                pipe.hset(key, "submit", op[2])
            elif kind == "hset":
                pipe.hset(key, op[2], op[3])
            elif kind == "outputs":  # one field per offset: a retried pipeline cannot duplicate a token
                pipe.hset(key, mapping={f"{OUTPUT_FIELD_PREFIX}{op[2] + i}": t for i, t in enumerate(op[3])})
            elif kind == "delete":
                pipe.delete(key)
            elif kind == "plan":  # a plan outside a policy's steps (a drained worker's last)
                pipe.xadd(key, {FIELD: op[2]}, maxlen=STREAM_MAXLEN, approximate=True)
            elif kind == "publish":
                pipe.publish(key, op[2])
            elif kind == "error":  # the durable copy first, as the relay does for tokens
                token_log.append_event(pipe, self.keys, op[3])
                pipe.publish(key, op[2])
            elif kind == "abort":
                token_log.append_abort(pipe, self.keys, key, 0)
            elif kind == "dead":
                pipe.xadd(self.keys.dead_letters, {FIELD: op[2], "stream": key, "entry_id": op[3], "reason": op[4]},
                          maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        self.cluster.ops.clear()

    def dead_letter(self, stream: str, entry_id, data: bytes, reason: str) -> None:
        """An entry nobody can read: kept in the dead-letter stream with the reason, and when it is a submit
        whose request id and gateway can still be read, its client gets an error instead of silence."""
        self.num_dead_letters += 1
        log.error("unreadable message; dead-lettered", stream=stream, entry_id=entry_id, reason=reason)
        self.cluster.ops.append(("dead", stream, data, entry_id, reason))
        if stream != self.keys.requests:
            return
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:  # not even msgpack: nobody to tell
            return
        if not isinstance(body, dict) or body.get("k") == CancelRequest.KIND:
            return
        rid, gateway = body.get("request_id"), body.get("gateway_id")
        if isinstance(rid, str) and isinstance(gateway, str) and not self.is_known(rid):
            self.cluster.tell_error(rid, gateway, f"the scheduler could not read this request: {reason}")

    def handle(self, resp) -> None:
        if isinstance(resp, dict):  # RESP3 replies map stream -> entries
            resp = list(resp.items())
        for stream, entries in resp or ():
            stream = stream.decode() if isinstance(stream, bytes) else stream
            ids = []
            for entry_id, fields in entries:
                ids.append(entry_id)
                if not fields:  # deleted from the stream while pending (XAUTOCLAIM reports it so): nothing to do
                    continue
                data = fields.get(FIELD_BYTES)
                if data is None:
                    self.dead_letter(stream, entry_id, b"", f"no {FIELD!r} field")
                    continue
                try:
                    if stream == self.keys.results:
                        self.on_result(data)
                    else:
                        kind = peek_kind(data)
                        if kind == SubmitRequest.KIND:
                            self.on_submit(data)
                        elif kind == CancelRequest.KIND:
                            self.on_cancel(data)
                        else:
                            raise WireError(f"unknown message kind {kind!r}")
                except Exception as e:  # noqa: BLE001 -- one bad message must not stop the scheduler
                    self.dead_letter(stream, entry_id, data, f"{type(e).__name__}: {e}")
            if ids:
                self._acks.append((stream, ids))

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
            ops, acks = list(self.cluster.ops), list(self._acks)  # restored if Redis is unreachable
            pipe = self.client.pipeline(transaction=False)
            renewing = self.leadership.renew(pipe, now)
            self._flush_ops(pipe)  # request records and publishes decided while handling the last read
            planned_before = {wid: len(slot.in_flight) for wid, slot in self.workers.items()}
            self.plan_steps(pipe, now)
            for stream, ids in self._acks:
                pipe.xack(stream, self.keys.scheduler_group, *ids)
                pipe.xdel(stream, *ids)  # acknowledged entries are history nobody reads
            self._acks.clear()
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
                self.cluster.ops[:0], self._acks[:0] = ops, acks
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
                self.handle(replies[-1])

    def stop(self) -> None:
        self.stopping.set()


async def serve(args) -> None:
    client = connect_async(args.redis_url, name=f"{args.key_prefix}:scheduler", key_prefix=args.key_prefix)
    limits = PolicyLimits(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                          args.attention_horizon, args.long_prefill_threshold, kv_transport=args.kv_transport,
                          itl_target=args.itl_target, itl_patience_s=args.itl_patience,
                          enable_prefix_caching=args.enable_prefix_caching)
    service = SchedulerService(client, Keys(args.key_prefix), limits, heartbeat_interval=args.heartbeat_interval,
                               step_timeout=args.step_timeout, lease_ttl=args.scheduler_lease_ttl,
                               resume_grace=args.resume_grace, drain_timeout=args.drain_timeout,
                               step_timeout_floor=args.step_timeout_floor,
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
