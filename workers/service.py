"""The worker service: the ModelRunner connected to Redis.

Three threads, so the model never waits on a Redis round trip it does not need:
- the model thread (the caller of `run`) takes plans from a local queue, runs them,
  and hands each step's writes to the publisher;
- a plan reader blocks on `steps:<worker>` (consumer group) and queues plans as
  they come; with two plans in flight the next one is usually already here;
- a result publisher sends, in ONE pipeline, one TokenBatch per gateway, the
  StepResult to `results` and the XACK of the plan, in step order. Steps that
  finish while a round trip is in flight go out together in the next one.
A heartbeat thread keeps `worker:<id>` alive (with a TTL) so a long step never
makes the scheduler think the worker died.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import redis
import structlog

from phaseserve.wire import FIELD, Keys, StepPlan, StepResult, TokenBatch, TokenEvent, WireError, WorkerInfo

log = structlog.get_logger("workers.service")

STREAM_MAXLEN = 10_000  # approximate cap on the steps/results streams: acked entries are history only
GIL_SWITCH_INTERVAL_S = 0.0002
READ_AHEAD = 8  # plans taken per XREADGROUP (the scheduler keeps two in flight)


class Heartbeat(threading.Thread):
    """Refreshes the heartbeat key every `interval` seconds, independent of the model step."""

    def __init__(self, client: redis.Redis, keys: Keys, info: WorkerInfo, interval: float, ttl: float):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.keys, self.info = client, keys, info
        self.interval, self.ttl_ms = interval, max(1, int(ttl * 1000))
        self.stopped = threading.Event()

    def beat(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.keys.workers, self.info.worker_id)
        pipe.set(self.keys.worker_heartbeat(self.info.worker_id), self.info.to_wire(), px=self.ttl_ms)
        pipe.execute()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except redis.RedisError as e:  # keep trying: Redis may come back before the TTL runs out
                log.warning("heartbeat failed", error=str(e))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=self.interval + 1)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.worker_heartbeat(self.info.worker_id))
        pipe.srem(self.keys.workers, self.info.worker_id)
        pipe.execute()


class PlanReader(threading.Thread):
    """Reads step plans ahead into `plans` (entry id, fields); a Redis failure is queued as the exception."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, block_ms: int, stopping: threading.Event):
        super().__init__(name="plan-reader", daemon=True)
        self.client, self.keys, self.worker_id, self.block_ms = client, keys, worker_id, block_ms
        self.stopping = stopping
        self.plans: queue.Queue = queue.Queue()

    def run(self) -> None:
        streams = {self.keys.steps(self.worker_id): ">"}
        try:
            while not self.stopping.is_set():
                resp = self.client.xreadgroup(self.keys.worker_group, self.worker_id, streams,
                                              count=READ_AHEAD, block=self.block_ms)
                for _stream, entries in resp or ():
                    for entry in entries:
                        self.plans.put(entry)
        except Exception as e:  # the model thread re-raises it: a worker that cannot read plans must stop
            self.plans.put(e)


class ResultPublisher(threading.Thread):
    """Sends each step's writes in step order, batching the steps that queued up during a round trip.

    `send(ops)` takes a list of (redis pipeline method name, args, kwargs). A failed write is kept in
    `error` for the model thread to raise; later writes are dropped (the worker is going down)."""

    def __init__(self, client: redis.Redis):
        super().__init__(name="result-publisher", daemon=True)
        self.client = client
        self.outbox: queue.Queue = queue.Queue()
        self.error: Exception | None = None

    def send(self, ops: list[tuple]) -> None:
        self.outbox.put(ops)

    def run(self) -> None:
        done = False
        while not done:
            batch = [self.outbox.get()]
            while True:  # everything already waiting goes in the same round trip
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:
                done = True
                batch.pop()
            if not batch or self.error is not None:
                continue
            pipe = self.client.pipeline(transaction=False)
            for ops in batch:
                for name, args, kwargs in ops:
                    getattr(pipe, name)(*args, **kwargs)
            try:
                pipe.execute()
            except Exception as e:
                log.error("publishing step results failed", error=str(e))
                self.error = e

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self.outbox.put(None)
        self.join(timeout)


class WorkerService:
    def __init__(self, runner, client: redis.Redis, keys: Keys, worker_id: str, *, role: str = "mixed",
                 heartbeat_interval: float = 1.0, heartbeat_ttl: float = 5.0, block_ms: int = 500):
        self.runner = runner
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.steps_key = keys.steps(worker_id)
        self.block_ms = block_ms
        self.stopping = threading.Event()
        self.gateway_of: dict[str, str] = {}  # seq id -> gateway id (from SeqStart), to route tokens
        self.info = WorkerInfo(
            worker_id=worker_id, role=role, model=runner.model_name, num_blocks=runner.num_blocks,
            block_size=runner.block_size, max_model_len=runner.max_model_len, pid=os.getpid(),
            started_at=time.time(), attention_horizon=runner.attention_horizon,
        )
        self.heartbeat = Heartbeat(client, keys, self.info, heartbeat_interval, heartbeat_ttl)
        self.reader = PlanReader(client, keys, worker_id, block_ms, self.stopping)
        self.publisher = ResultPublisher(client)
        self.steps_run = 0
        self.busy_s = 0.0  # time in steps (model + handing off the writes): up_s - busy_s is waiting for plans
        # one line a step at debug level (what `python -m bench.step_trace` reads); none of its work otherwise
        self.log_steps = logging.getLogger().isEnabledFor(logging.DEBUG)

    def _join_group(self) -> None:
        try:
            self.client.xgroup_create(self.steps_key, self.keys.worker_group, id="$", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
            # a restarted worker with the same id: plans meant for its previous life are stale
            self.client.xgroup_setid(self.steps_key, self.keys.worker_group, id="$")

    def announce(self) -> None:
        """Join the steps group first, then heartbeat: the scheduler sends plans only to live workers."""
        self._join_group()
        self.heartbeat.beat()
        self.heartbeat.start()
        log.info("worker ready", worker_id=self.worker_id, model=self.info.model, num_blocks=self.info.num_blocks,
                 block_size=self.info.block_size, max_model_len=self.info.max_model_len)

    def run(self) -> None:
        self.announce()
        self.publisher.start()
        self.reader.start()
        started = time.perf_counter()
        try:
            while not self.stopping.is_set():
                if self.publisher.error is not None:
                    raise self.publisher.error
                try:
                    item = self.reader.plans.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(item, Exception):
                    raise item
                self.run_step(*item)
        finally:
            self.stopping.set()
            self.publisher.close()
            self.reader.join(self.block_ms / 1000 + 1)
            self.heartbeat.stop()
            log.info("worker stopped", worker_id=self.worker_id, steps=self.steps_run,
                     busy_s=round(self.busy_s, 3), up_s=round(time.perf_counter() - started, 3))

    def run_step(self, entry_id: bytes, fields: dict) -> None:
        try:
            plan = StepPlan.from_wire(fields[FIELD.encode()])
        except (WireError, KeyError) as e:
            log.error("dropping unreadable step plan", entry_id=entry_id, error=str(e))
            self.publisher.send([("xack", (self.steps_key, self.keys.worker_group, entry_id), {})])
            return
        for seq in plan.starts:
            self.gateway_of[seq.seq_id] = seq.gateway_id
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(plan)
        except Exception as e:  # a failed step fails its sequences, not the worker
            log.exception("step failed", step_id=plan.step_id)
            seq_ids = list(dict.fromkeys(c.seq_id for c in plan.chunks))
            result = StepResult(plan.step_id, self.worker_id,
                                [TokenEvent(s, -1, [], "error", None, f"worker step failed: {e}") for s in seq_ids])
        result.step_time_s = result.step_time_s or (time.perf_counter() - t0)
        result.step_id, result.worker_id = plan.step_id, self.worker_id
        self.publish(plan, result, entry_id)
        if self.log_steps:
            prefills = [c for c in plan.chunks if c.num_tokens > 1]
            log.debug("step", step_id=plan.step_id, decodes=len(plan.chunks) - len(prefills),
                      prefill_tokens=sum(c.num_tokens for c in prefills),
                      context=max((c.start_pos + c.num_tokens for c in prefills), default=0),
                      step_ms=round(result.step_time_s * 1e3, 3))
        self.steps_run += 1
        self.busy_s += time.perf_counter() - t0

    def publish(self, plan: StepPlan, result: StepResult, entry_id: bytes) -> None:
        by_gateway: dict[str, list[TokenEvent]] = defaultdict(list)
        for ev in result.events:
            gw = self.gateway_of.get(ev.seq_id)
            if gw is not None:
                by_gateway[gw].append(ev)
            if ev.finish_reason is not None:
                self.gateway_of.pop(ev.seq_id, None)
        started = {s.seq_id for s in plan.starts}
        for seq_id in plan.releases:
            if seq_id not in started:
                self.gateway_of.pop(seq_id, None)
        ops = [("publish", (self.keys.gateway_channel(gw), TokenBatch(plan.step_id, self.worker_id, events).to_wire()),
                {}) for gw, events in by_gateway.items()]
        ops.append(("xadd", (self.keys.results, {FIELD: result.to_wire()}),
                    {"maxlen": STREAM_MAXLEN, "approximate": True}))
        ops.append(("xack", (self.steps_key, self.keys.worker_group, entry_id), {}))
        ops.append(("xdel", (self.steps_key, entry_id), {}))
        self.publisher.send(ops)

    def request_stop(self, *_args) -> None:
        self.stopping.set()


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# Above this much weight a step is bound by compute and memory bandwidth, and every core pays;
# below it a step is a few milliseconds of small ops, and a core left to the gateway, scheduler and
# Redis pays more (workload A, one run each: bundled 11 MB model 2283 tok/s on 1 thread vs 1881 on 2;
# 400 MB model 299 tok/s on 2 threads vs 200 on 1 -- README, "Benchmarks").
LARGE_MODEL_BYTES = 100 << 20


def auto_threads(num_threads: int, cores: int, weight_bytes: int) -> int:
    """The worker's torch thread count: the setting if > 0, else chosen by model size."""
    if num_threads > 0:
        return num_threads
    return cores if weight_bytes >= LARGE_MODEL_BYTES else max(1, cores - 1)


def usable_cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def worker_threads(num_threads: int, model_dir: str, cores: int | None = None) -> int:
    """What auto_threads gives for this model folder's weights on `cores` CPUs (default: ours)."""
    weight_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return auto_threads(num_threads, len(usable_cores()) if cores is None else cores, weight_bytes)


def set_threads(num_threads: int, model_dir: str) -> int:
    import torch

    n = worker_threads(num_threads, model_dir)
    torch.set_num_threads(n)
    return n


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from phaseserve import logs, settings

    args = settings.parse("worker", argv, prog="phaseserve worker")
    logs.configure("worker", args.log_level, args.log_json)
    if not args.redis_url:
        raise SystemExit("phaseserve worker: --redis-url (or REDIS_URL) is required")
    model_dir = settings.resolve_model(args.model)
    threads = set_threads(args.num_threads, model_dir)
    # the plan reader and result publisher need the GIL for a few microseconds per step; the model thread
    # gives it up only in torch ops or when asked, and CPython asks after the switch interval (5 ms default)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    worker_id = args.worker_id or default_worker_id()
    structlog.contextvars.bind_contextvars(worker_id=worker_id)

    # SIGTERM during the (long) model load must still stop us: raise out of the load
    signal.signal(signal.SIGTERM, _interrupt)
    from workers.runner import ModelRunner

    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("loading model", model=model_dir, device=device, dtype=args.dtype, threads=threads,
)
    t0 = time.perf_counter()
    try:
        runner = ModelRunner(model_dir, dtype=args.dtype, device=device, block_size=args.block_size,
                             kv_cache_memory_bytes=args.kv_cache_memory, max_model_len=args.max_model_len or None)
    except KeyboardInterrupt:
        log.info("stopped during model load")
        return 0
    log.info("model loaded", seconds=round(time.perf_counter() - t0, 2), num_blocks=runner.num_blocks)

    client = redis.Redis.from_url(args.redis_url)
    service = WorkerService(runner, client, Keys(args.key_prefix), worker_id, role=args.role,
                            heartbeat_interval=args.heartbeat_interval, heartbeat_ttl=args.heartbeat_ttl)
    signal.signal(signal.SIGTERM, service.request_stop)
    signal.signal(signal.SIGINT, service.request_stop)
    service.run()
    return 0
