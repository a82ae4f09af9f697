"""The worker service: the ModelRunner connected to Redis.

The model runs in this process, with nothing else competing for its GIL; all Redis traffic runs in a
child process, the relay (workers/relay.py): it reads step plans ahead into a pipe, sends each step's
writes (one TokenBatch per gateway, the StepResult, the XACK of the plan) in one pipeline, in step
order, and keeps the heartbeat alive (with a TTL) while the model makes progress: a step overrunning
`step_timeout` counts as a hung model and the worker as dead (workers/model_liveness.py). The model
loop only moves bytes through two pipes: it never waits on a Redis round trip.

Plans carry the scheduler's epoch: a plan of an older epoch than one already seen (left in the stream by
a scheduler that lost its lease) is dropped. A `reset` plan (the first of a scheduler's adoption of this
worker) makes the runner forget every sequence it holds.

SIGTERM drains (docs/architecture.md, "Workers joining and leaving"): the heartbeat announces it
(WorkerInfo.draining), the worker keeps running the plans it gets, and exits after the scheduler's
`drained` plan; or, if none comes, `drain_timeout` + DRAIN_MARGIN_S after the signal, or at once when no
scheduler holds the lease (its relay looks). SIGINT, or a second SIGTERM, stops it at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import defaultdict

import structlog

from phaseserve.kernels import cpu_isa
from phaseserve.cpus import thread_choice, usable_cores
from phaseserve.host_identity import default_host_id
from phaseserve.procs import freeze_startup_heap, parse_cpus
from phaseserve.wire import (GatewayBatch, Keys, RelayConfig, RelayNotice, StepPlan, StepResult, StepWrites, TokenBatch,
                             TokenEvent, WireError, WorkerInfo)
from phaseserve.workers.kv_handoff import KVHandoffs
from phaseserve.workers.relay_link import RelayError, RelayLink

log = structlog.get_logger("phaseserve.workers.service")

# a draining worker no scheduler answers waits this much longer than the drain timeout before leaving: the
# scheduler notices the drain a heartbeat late and sends its answer behind the plans already in flight
DRAIN_MARGIN_S = 5.0


class WorkerService:
    def __init__(self, runner, redis_url: str, keys: Keys, worker_id: str, *, role: str = "mixed",
                 heartbeat_interval: float = 1.0, heartbeat_ttl: float = 5.0, block_ms: int = 500,
                 relay_cpus: list[int] | None = None, log_level: str = "info", log_json: bool = False,
                 step_timeout: float = 30.0, drain_timeout: float = 30.0, host_id: str | None = None):
        self.runner = runner
        self.keys = keys
        self.worker_id = worker_id
        self.stopping = False
        self.draining = False  # SIGTERM came: leave once the scheduler has moved our sequences away
        self.drain_announced = False  # the relay was told (its heartbeat carries WorkerInfo.draining)
        self.drain_wait_s = drain_timeout + max(DRAIN_MARGIN_S, 3 * heartbeat_interval)
        self.drain_deadline = float("inf")  # time.monotonic() past which we leave unanswered
        self.gateway_of: dict[str, str] = {}  # seq id -> gateway id (from SeqStart), to route tokens
        # before the heartbeat exists: every kernel is compiled or loaded now, never inside a planned step
        # (a compile there overran the step deadline and retired the worker)
        import torch

        t0 = time.perf_counter()
        implementations = runner.warm_up()
        cpu_level = "" if runner.device.type == "cuda" else cpu_isa.level()
        dtype = str(runner.dtype).removeprefix("torch.")
        log.info("worker kernels", dtype=dtype, cpu_level=cpu_level or None, kernels=implementations,
                 warm_up_s=round(time.perf_counter() - t0, 2))
        self.info = WorkerInfo(
            worker_id=worker_id, role=role, model=runner.model_name, num_blocks=runner.num_blocks,
            block_size=runner.block_size, max_model_len=runner.max_model_len, pid=os.getpid(),
            started_at=time.time(), attention_horizon=runner.attention_horizon, host=host_id or default_host_id(),
            dtype=dtype, cpu_level=cpu_level, kernels=implementations,
            vocab_size=runner.vocab_size,
            speculative_tokens=runner.speculative.num_speculative_tokens if runner.speculative else 0,
            speculative_fixed=bool(runner.speculative and not runner.speculative.adaptive),
            threads=0 if runner.device.type == "cuda" else torch.get_num_threads(),
            max_loras=runner.loras.max_loras,
        )
        self.handoffs = KVHandoffs(runner, redis_url, keys.prefix)  # KV to decode workers, or from prefill ones
        # the Redis side, in a child process: plans in, step writes and heartbeats out
        self.link = RelayLink(RelayConfig(redis_url, keys.prefix, self.info.to_wire(), heartbeat_interval,
                                          heartbeat_ttl, block_ms, log_level, log_json, relay_cpus, step_timeout))
        self.epoch = 0  # the newest scheduler epoch seen in a plan
        self.last_step_id = -1  # of the newest plan run (step ids grow within an adoption)
        self.steps_run = 0
        self.busy_s = 0.0  # time in steps (model + handing off the writes): up_s - busy_s is waiting for plans
        # one line a step at debug level (what `python -m bench.step_trace` reads); none of its work otherwise
        self.log_steps = logging.getLogger().isEnabledFor(logging.DEBUG)

    def next_plan(self, timeout: float):
        """(entry id, plan bytes), or None if none came within `timeout`. Raises RelayError if the relay failed."""
        message = self.link.receive(timeout)
        if isinstance(message, RelayNotice):
            if message.no_scheduler and self.draining:
                log.info("draining with no scheduler to answer; stopping", worker_id=self.worker_id)
                self.stopping = True
            return None
        if message is None:
            return None
        return message.entry_id, message.data

    def run(self) -> None:
        self.link.start()
        log.info("worker ready", worker_id=self.worker_id, model=self.info.model, num_blocks=self.info.num_blocks,
                 block_size=self.info.block_size, max_model_len=self.info.max_model_len)
        started = time.perf_counter()
        try:
            while not self.stopping:
                if self.draining and self._drain_over():
                    break
                item = self.next_plan(0.1)
                if item is not None:
                    self.run_step(*item)
        finally:
            self.link.stop()
            log.info("worker stopped", worker_id=self.worker_id, steps=self.steps_run,
                     busy_s=round(self.busy_s, 3), up_s=round(time.perf_counter() - started, 3))

    def run_step(self, entry_id: bytes, data: bytes) -> None:
        try:
            plan = StepPlan.from_wire(data)
        except WireError as e:
            log.error("dropping unreadable step plan", entry_id=entry_id, error=str(e))
            self.link.send(StepWrites(entry_id).to_pipe())  # acked, nothing to publish
            return
        if plan.epoch < self.epoch:  # left in the stream by a scheduler that has lost its lease
            log.warning("dropping a plan of an older scheduler", step_id=plan.step_id, epoch=plan.epoch,
                        current_epoch=self.epoch)
            self.link.send(StepWrites(entry_id).to_pipe())
            return
        if plan.step_id >= 0 and (plan.epoch, plan.step_id) <= (self.epoch, self.last_step_id):
            # delivered again: a Redis failover rolled the stream back to before our read of it (the
            # promoted replica had not seen it). It ran already; its writes went out then.
            log.warning("dropping a plan delivered twice", step_id=plan.step_id, epoch=plan.epoch)
            self.link.send(StepWrites(entry_id).to_pipe())
            return
        if plan.epoch != self.epoch or plan.reset:  # a new scheduler, or a new adoption: its step ids start over
            self.last_step_id = -1
        self.epoch = plan.epoch
        if plan.step_id >= 0:
            self.last_step_id = plan.step_id
        if plan.drained:  # the scheduler holds nothing on us and sends nothing more: leave
            self.link.send(StepWrites(entry_id).to_pipe())
            if self.draining:
                log.info("drained; stopping", worker_id=self.worker_id, steps=self.steps_run)
                self.stopping = True
            else:
                log.warning("a drained plan, but this worker is not draining; ignoring it")
            return
        if plan.reset:  # a new adoption: the sequences held so far belong to nobody (the runner forgets them)
            self.gateway_of.clear()
        for seq in plan.starts:
            self.gateway_of[seq.seq_id] = seq.gateway_id
        t0 = time.perf_counter()
        try:
            received = self.handoffs.before_step(plan)
            result = self.runner.execute(plan)
            # before the result goes out: a finished prefill's transfer is whole when its first token is seen
            self.handoffs.after_step(plan)
            result.handoffs = received
        except Exception as e:  # a failed step fails its sequences, not the worker
            log.exception("step failed", step_id=plan.step_id)
            seq_ids = list(dict.fromkeys(c.seq_id for c in plan.chunks))
            result = StepResult(plan.step_id, self.worker_id,
                                [TokenEvent(s, -1, [], "error", None, f"worker step failed: {e}") for s in seq_ids])
        result.step_time_s = result.step_time_s or (time.perf_counter() - t0)
        result.step_id, result.worker_id, result.epoch = plan.step_id, self.worker_id, plan.epoch
        self.publish(plan, result, entry_id)
        self.steps_run += 1
        self.busy_s += time.perf_counter() - t0
        if self.log_steps:
            prefills = [c for c in plan.chunks if c.num_tokens > 1]
            log.debug("step", step_id=plan.step_id, decodes=len(plan.chunks) - len(prefills),
                      prefill_tokens=sum(c.num_tokens for c in prefills),
                      context=max((c.start_pos + c.num_tokens for c in prefills), default=0),
                      step_ms=round(result.step_time_s * 1e3, 3), **draft_fields(plan, result))

    def publish(self, plan: StepPlan, result: StepResult, entry_id: bytes) -> None:
        """Hand the step's writes to the relay: one TokenBatch per gateway, the StepResult, the plan's ack."""
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
        batches = [GatewayBatch(gw, TokenBatch(plan.step_id, self.worker_id, events).to_wire())
                   for gw, events in by_gateway.items()]
        self.link.send(StepWrites(entry_id, result.to_wire(), batches, plan.reset).to_pipe())

    def request_stop(self, *_args) -> None:
        self.stopping = True

    def request_drain(self, *_args) -> None:
        """SIGTERM: drain, then leave (the run loop tells the relay); a second one stops at once.
        A signal handler: it only sets flags."""
        if self.draining:
            self.stopping = True
            return
        self.draining = True
        self.drain_deadline = time.monotonic() + self.drain_wait_s

    def _drain_over(self) -> bool:
        """Announce the drain once; True when it has waited for the scheduler's answer long enough."""
        if not self.drain_announced:
            self.drain_announced = True
            log.info("draining: the scheduler moves this worker's sequences away, then lets it go",
                     worker_id=self.worker_id, wait_s=round(self.drain_wait_s, 1))
            self.link.send(RelayNotice(draining=True).to_pipe())
        if time.monotonic() < self.drain_deadline:
            return False
        log.warning("no scheduler answered the drain in time; stopping (its sequences are recomputed "
                    "elsewhere once the heartbeat is gone)", worker_id=self.worker_id,
                    waited_s=round(self.drain_wait_s, 1))
        return True


def draft_fields(plan: StepPlan, result: StepResult) -> dict:
    """The step line's speculation: draft slots the plan allowed, drafts the worker verified and kept, and per
    sequence [verified, kept] (what `bench.speculative --per-request` sums per request); none without drafts."""
    slots = sum(c.num_draft for c in plan.chunks)
    if not slots:
        return {}
    kept = {ev.seq_id: max(len(ev.token_ids) - 1, 0) for ev in result.events if ev.seq_id in result.drafted}
    per_seq = {s: [n, kept.get(s, 0)] for s, n in result.drafted.items()}
    return {"draft_slots": slots, "drafted": sum(result.drafted.values()), "kept": sum(kept.values()),
            "spec": per_seq}


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def set_threads(num_threads: int, model_dir: str) -> int:
    """torch's thread count for this worker: the setting, else measured for this model and machine
    (phaseserve/cpus.py; within the CPUs the launcher left us). One log line says which and why."""
    import torch

    choice = thread_choice(num_threads, model_dir)
    torch.set_num_threads(choice.threads)
    log.info("worker threads", threads=choice.threads, usable_cpus=len(usable_cores()), reason=choice.reason)
    return choice.threads


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from phaseserve import logs, settings

    args = settings.parse("worker", argv, prog="phaseserve worker")
    logs.configure("worker", args.log_level, args.log_json)
    if not args.redis_url:
        raise SystemExit("phaseserve worker: --redis-url (or REDIS_URL) is required")
    for name in ("step_timeout", "heartbeat_interval", "heartbeat_ttl", "grammar_prepare_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"phaseserve worker: --{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.drain_timeout >= 0:
        raise SystemExit(f"phaseserve worker: --drain-timeout must be >= 0 (0 = hand back at once), "
                         f"got {args.drain_timeout}")
    try:
        relay_cpus = parse_cpus(args.relay_cpus)
    except ValueError as e:
        raise SystemExit(f"phaseserve worker: --relay-cpus: {e}") from None
    model_dir = settings.resolve_model(args.model, "phaseserve worker", args.cache_dir).path
    threads = set_threads(args.num_threads, model_dir)
    worker_id = args.worker_id or default_worker_id()
    structlog.contextvars.bind_contextvars(worker_id=worker_id)

    # SIGTERM during the (long) model load must still stop us: raise out of the load
    signal.signal(signal.SIGTERM, _interrupt)
    from phaseserve.workers.runner import ModelRunner

    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("loading model", model=model_dir, device=device, dtype=args.dtype, quantization=args.quantization,
             activation_quant=args.activation_quant, threads=threads)
    t0 = time.perf_counter()
    try:
        runner = ModelRunner(model_dir, dtype=args.dtype, device=device, block_size=args.block_size,
                             kv_cache_memory_bytes=args.kv_cache_memory, max_model_len=args.max_model_len or None,
                             quantization=args.quantization, activation_quant=args.activation_quant,
                             speculative=args.speculative_config, max_loras=args.max_loras,
                             max_lora_rank=args.max_lora_rank, grammar_prepare_timeout=args.grammar_prepare_timeout)
    except KeyboardInterrupt:
        log.info("stopped during model load")
        return 0
    log.info("model loaded", seconds=round(time.perf_counter() - t0, 2), num_blocks=runner.num_blocks)
    freeze_startup_heap()

    service = WorkerService(runner, args.redis_url, Keys(args.key_prefix), worker_id, role=args.role,
                            heartbeat_interval=args.heartbeat_interval, heartbeat_ttl=args.heartbeat_ttl,
                            relay_cpus=relay_cpus, log_level=args.log_level,
                            log_json=args.log_json, step_timeout=args.step_timeout,
                            drain_timeout=args.drain_timeout, host_id=args.host_id)
    signal.signal(signal.SIGTERM, service.request_drain)  # leave gracefully (module docstring)
    signal.signal(signal.SIGINT, service.request_stop)
    try:
        service.run()
    except RelayError as e:  # without Redis the worker can do nothing: stop, and let the launcher see it
        log.error("worker stopping", error=str(e))
        return 1
    return 0
