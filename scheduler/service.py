"""The scheduler service: the pure policy (scheduler/policy.py) connected to Redis.

One loop, one Redis round trip per turn: a single non-transactional pipeline
carries everything decided since the last turn (step plans XADDed to each
worker, XACKs, request records, the stats key) and ends with ONE XREADGROUP
that blocks on both the `requests` and the `results` stream.

Pipelining: each worker may have two plans in flight. While a worker runs
step N, plan N+1 already waits in its stream, so the worker never idles on
the scheduler's round trip (the policy supports scheduling one step ahead;
decode chunks need no token ids from the scheduler because the worker owns
the tokens).

Workers are discovered from the `workers` set plus their expiring heartbeat
keys; one policy instance per live worker holds that worker's KV block
accounting. A worker whose heartbeat lapses has its sequences taken back and
re-planned elsewhere by recompute (prompt + tokens already generated).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from phaseserve import event_loop
from phaseserve.wire import (
    ERROR_REJECTED, FIELD, FIELD_BYTES, STREAM_MAXLEN, CancelRequest, Keys, StepResult, SubmitRequest, TokenBatch,
    TokenEvent, WireError, WorkerInfo, peek_kind,
)
from scheduler.policy import AdmissionError, Scheduler, SchedulerConfig

log = structlog.get_logger("scheduler.service")

STATS_INTERVAL_S = 0.1  # the stats key is written at most ~10 times a second
READ_COUNT = 512


@dataclass
class WorkerSlot:
    info: WorkerInfo
    policy: Scheduler
    in_flight: deque = field(default_factory=deque)  # step ids sent, result not seen yet, oldest first
    needs_plan: bool = False  # something (a cancel) the worker must hear about even with no work left


@dataclass
class PolicyLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    attention_horizon: int | None = None  # None: each worker's own (WorkerInfo); 0: cost model off
    long_prefill_threshold: int = 256  # see SchedulerConfig; 0: no cap


class SchedulerService:
    def __init__(self, client: aioredis.Redis, keys: Keys, limits: PolicyLimits, *, consumer: str | None = None,
                 heartbeat_interval: float = 1.0, plans_in_flight: int = 2):
        self.client = client
        self.keys = keys
        self.limits = limits
        self.consumer = consumer or f"scheduler-{socket.gethostname()}"
        self.refresh_interval = max(0.05, heartbeat_interval)
        self.plans_in_flight = max(1, plans_in_flight)
        self.workers: dict[str, WorkerSlot] = {}
        self.owner: dict[str, str] = {}  # request id -> worker id
        self.parked: list[tuple[SubmitRequest, list[int] | None]] = []  # no live worker to run them yet
        self.retired_preemptions = 0  # preemptions counted by policies of workers that went away
        self.stopping = asyncio.Event()
        self._next_refresh = 0.0
        self._stats_dirty = True
        self._stats_written_at = 0.0
        self._last_stats: dict | None = None
        self._pending_ops: list[tuple] = []  # Redis writes decided while handling messages, sent next turn
        self._acks: list[tuple[str, list]] = []

    # ------------------------------------------------------------------ setup

    async def setup(self) -> None:
        for stream in (self.keys.requests, self.keys.results):
            try:
                # id 0: requests a gateway queued before the scheduler started are served too
                await self.client.xgroup_create(stream, self.keys.scheduler_group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        await self.refresh_workers(time.monotonic())
        await self.recover_records()

    async def recover_records(self) -> None:
        """Requests a previous scheduler accepted but did not finish: re-admit them (recompute)."""
        found = 0
        async for key in self.client.scan_iter(match=self.keys.request_record("*"), count=500):
            data = await self.client.hget(key, "submit")
            if data is None:
                continue
            try:
                req = SubmitRequest.from_wire(data)
            except WireError as e:
                log.warning("dropping unreadable request record", key=key, error=str(e))
                await self.client.delete(key)
                continue
            if req.request_id not in self.owner:
                self.parked.append((req, None))
                found += 1
        if found:
            log.info("recovered requests", count=found)
            self.place_parked()

    # ------------------------------------------------------------------ workers

    async def refresh_workers(self, now: float) -> None:
        self._next_refresh = now + self.refresh_interval
        await self.client.set(self.keys.scheduler_alive(), self.consumer,
                              px=max(3000, int(3000 * self.refresh_interval)))
        members = sorted(m.decode() for m in await self.client.smembers(self.keys.workers))
        beats = await self.client.mget([self.keys.worker_heartbeat(m) for m in members]) if members else []
        live: dict[str, WorkerInfo] = {}
        for wid, data in zip(members, beats):
            if data is None:
                continue
            try:
                live[wid] = WorkerInfo.from_wire(data)
            except (WireError, TypeError) as e:
                log.warning("unreadable heartbeat", worker_id=wid, error=str(e))
        for wid in list(self.workers):
            info = live.get(wid)
            if info is None or info.started_at != self.workers[wid].info.started_at:
                self.retire_worker(wid, "heartbeat expired" if info is None else "restarted")
        for wid, info in live.items():
            if wid not in self.workers:
                await self.adopt_worker(info)
        if self.parked and self.workers:
            self.place_parked()

    async def adopt_worker(self, info: WorkerInfo) -> None:
        cfg = SchedulerConfig(
            num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            max_num_seqs=self.limits.max_num_seqs, max_num_batched_tokens=self.limits.max_num_batched_tokens,
            enable_chunked_prefill=self.limits.enable_chunked_prefill,
            attention_horizon=info.attention_horizon if self.limits.attention_horizon is None
            else self.limits.attention_horizon,
            long_prefill_threshold=self.limits.long_prefill_threshold,
        )
        # plans left in its stream by an earlier scheduler would write into blocks this one hands out
        await self.client.xtrim(self.keys.steps(info.worker_id), maxlen=0)
        self.workers[info.worker_id] = WorkerSlot(info, Scheduler(cfg, info.worker_id))
        self._stats_dirty = True
        log.info("worker joined", worker_id=info.worker_id, model=info.model, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len,
                 attention_horizon=cfg.attention_horizon)

    def retire_worker(self, wid: str, why: str) -> None:
        slot = self.workers.pop(wid)
        self.retired_preemptions += slot.policy.num_preemptions
        moved = slot.policy.take_all()
        log.warning("worker lost", worker_id=wid, reason=why, sequences_moved=len(moved))
        for req, output_ids in moved:
            self.owner.pop(req.request_id, None)
            self.parked.append((req, output_ids))
        self._stats_dirty = True
        if self.workers:
            self.place_parked()

    def pick_worker(self, req: SubmitRequest, output_ids: list[int] | None = None) -> WorkerSlot | None:
        """Least loaded (fewest unfinished sequences, then most free blocks) of the workers that can hold it.
        If none can, the largest, whose policy then rejects it with the nearest miss in its message."""
        if not self.workers:
            return None
        fits = [s for s in self.workers.values() if s.policy.capacity.rejection(
            len(req.prompt_ids), req.params.max_tokens, len(output_ids or ())) is None]
        if not fits:
            return max(self.workers.values(), key=lambda s: (s.info.max_model_len, s.info.num_blocks))
        return min(fits, key=lambda s: (s.policy.num_waiting + s.policy.num_running, -s.policy.num_free_blocks,
                                        s.info.worker_id))

    def place_parked(self) -> None:
        parked, self.parked = self.parked, []
        for req, output_ids in parked:
            self.admit(req, output_ids)

    # ------------------------------------------------------------------ requests

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        slot = self.pick_worker(req, output_ids)
        if slot is None:
            self.parked.append((req, output_ids))
            return True
        try:
            slot.policy.add_request(req, output_ids=output_ids or None)
        except ValueError as e:  # e.g. a prompt no worker can hold: fail this request, not the scheduler
            # a new request too big for every worker is the client's error; a resumed one whose surviving
            # workers are smaller than the one it started on is the cluster's
            rejected = isinstance(e, AdmissionError) and not output_ids
            log.warning("request rejected", request_id=req.request_id, error=str(e), bad_input=rejected)
            self._fail_request(req, str(e), ERROR_REJECTED if rejected else None)
            return False
        self.owner[req.request_id] = slot.info.worker_id
        self._pending_ops.append(("hset", self.keys.request_record(req.request_id), slot.info.worker_id))
        log.info("request admitted", request_id=req.request_id, worker_id=slot.info.worker_id,
                 prompt_tokens=len(req.prompt_ids), max_tokens=req.params.max_tokens,
                 resumed_from=len(output_ids or ()))
        self._stats_dirty = True
        return True

    def _fail_request(self, req: SubmitRequest, message: str, error_kind: str | None = None) -> None:
        event = TokenEvent(req.request_id, 0, [], "error", None, message, error_kind)
        self._pending_ops.append(("publish", self.keys.gateway_channel(req.gateway_id),
                                  TokenBatch(-1, "scheduler", [event]).to_wire()))
        self._pending_ops.append(("delete", self.keys.request_record(req.request_id)))

    def on_submit(self, data: bytes) -> None:
        req = SubmitRequest.from_wire(data)
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        try:
            # the record first (same pipeline, earlier): a restarted scheduler finds every admitted request
            self._pending_ops.append(("record", self.keys.request_record(req.request_id), data))
            self.admit(req)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def on_cancel(self, data: bytes) -> None:
        msg = CancelRequest.from_wire(data)
        rid = msg.request_id
        wid = self.owner.pop(rid, None)
        cancelled = False
        if wid is not None and wid in self.workers:
            slot = self.workers[wid]
            cancelled = slot.policy.cancel(rid)
            slot.needs_plan = True  # the worker must be told to release the sequence
        else:
            before = len(self.parked)
            self.parked = [(r, o) for r, o in self.parked if r.request_id != rid]
            cancelled = len(self.parked) < before
        self._pending_ops.append(("delete", self.keys.request_record(rid)))
        self._stats_dirty = True
        log.info("request cancelled", request_id=rid, reason=msg.reason, found=cancelled)

    def on_result(self, data: bytes) -> None:
        result = StepResult.from_wire(data)
        slot = self.workers.get(result.worker_id)
        if slot is None or not slot.in_flight or slot.in_flight[0] != result.step_id:
            # from a worker we gave up on, or a plan of an earlier scheduler: its sequences live elsewhere now
            log.debug("ignoring stale step result", worker_id=result.worker_id, step_id=result.step_id)
            return
        slot.in_flight.popleft()
        for rid in slot.policy.update(result):
            self.owner.pop(rid, None)
            self._pending_ops.append(("delete", self.keys.request_record(rid)))
            reason = next((e.finish_reason for e in result.events if e.seq_id == rid and e.finish_reason), None)
            log.info("request finished", request_id=rid, finish_reason=reason, worker_id=result.worker_id)
        self._stats_dirty = True

    # ------------------------------------------------------------------ the loop

    def plan_steps(self, pipe) -> int:
        """Fill every worker's pipeline of plans; returns how many plans were queued."""
        sent = 0
        for wid, slot in self.workers.items():
            while len(slot.in_flight) < self.plans_in_flight and (slot.policy.has_unfinished() or slot.needs_plan):
                plan = slot.policy.schedule()
                slot.needs_plan = False
                if plan is None or not (plan.chunks or plan.starts or plan.releases):
                    break
                pipe.xadd(self.keys.steps(wid), {FIELD: plan.to_wire()}, maxlen=STREAM_MAXLEN, approximate=True)
                slot.in_flight.append(plan.step_id)
                sent += 1
        if sent:
            self._stats_dirty = True
        return sent

    def stats(self) -> dict:
        policies = [s.policy for s in self.workers.values()]
        return {
            "num_waiting": sum(p.num_waiting for p in policies) + len(self.parked),
            "num_running": sum(p.num_running for p in policies),
            "kv_blocks_used": sum(p.num_used_blocks for p in policies),
            "kv_blocks_total": sum(s.info.num_blocks for s in self.workers.values()),
            "num_preemptions": sum(p.num_preemptions for p in policies) + self.retired_preemptions,
            "num_workers": len(policies),
        }

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
            self._last_stats = dict(stats)
            stats["updated_at"] = time.time()
            pipe.set(self.keys.scheduler_stats(), msgpack.packb(stats))
            self._stats_written_at = now
        return None

    def _flush_ops(self, pipe) -> None:
        for op in self._pending_ops:
            kind, key = op[0], op[1]
            if kind == "record":
                pipe.hset(key, "submit", op[2])
            elif kind == "hset":
                pipe.hset(key, "worker", op[2])
            elif kind == "delete":
                pipe.delete(key)
            elif kind == "publish":
                pipe.publish(key, op[2])
        self._pending_ops.clear()

    def handle(self, resp) -> None:
        if isinstance(resp, dict):  # RESP3 replies map stream -> entries
            resp = list(resp.items())
        for stream, entries in resp or ():
            stream = stream.decode() if isinstance(stream, bytes) else stream
            ids = []
            for entry_id, fields in entries:
                ids.append(entry_id)
                data = fields.get(FIELD_BYTES) if fields else None
                if data is None:
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
                            log.warning("unknown message on requests stream", kind=kind)
                except (WireError, KeyError, TypeError, ValueError) as e:
                    log.error("dropping unreadable message", stream=stream, entry_id=entry_id, error=str(e))
            if ids:
                self._acks.append((stream, ids))

    async def run(self) -> None:
        await self.setup()
        log.info("scheduler ready", consumer=self.consumer, workers=len(self.workers))
        streams = {self.keys.requests: ">", self.keys.results: ">"}
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= self._next_refresh:
                await self.refresh_workers(now)
            pipe = self.client.pipeline(transaction=False)
            self._flush_ops(pipe)  # request records and publishes decided while handling the last read
            self.plan_steps(pipe)
            for stream, ids in self._acks:
                pipe.xack(stream, self.keys.scheduler_group, *ids)
                pipe.xdel(stream, *ids)  # acknowledged entries are history nobody reads
            self._acks.clear()
            stats_wait = self.maybe_write_stats(pipe, now)
            block_s = self._next_refresh - now
            if stats_wait is not None:
                block_s = min(block_s, stats_wait)
            block_ms = max(1, int(block_s * 1000))
            # the blocking read rides in the same pipeline: one round trip per turn
            pipe.xreadgroup(self.keys.scheduler_group, self.consumer, streams, count=READ_COUNT, block=block_ms)
            try:
                replies = await pipe.execute()
            except ResponseError as e:
                if "NOGROUP" in str(e):  # Redis was flushed or restarted: recreate the groups
                    log.warning("consumer group missing; recreating", error=str(e))
                    await self.setup()
                    continue
                raise
            self.handle(replies[-1])
        log.info("scheduler stopped")

    def stop(self) -> None:
        self.stopping.set()


async def serve(args) -> None:
    client = aioredis.Redis.from_url(args.redis_url)
    limits = PolicyLimits(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                          args.attention_horizon, args.long_prefill_threshold)
    service = SchedulerService(client, Keys(args.key_prefix), limits, heartbeat_interval=args.heartbeat_interval)
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
    event_loop.run(serve(args))
    return 0
