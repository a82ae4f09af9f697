"""The fakes bench/scheduler_load.py drives one real scheduler with: workers that answer every plan at once,
and a gateway that keeps every worker busy."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from phaseserve.params import SamplingParams
from phaseserve.wire import (
    FIELD, STREAM_MAXLEN, Keys, StepPlan, StepResult, SubmitRequest, TokenBatch, TokenEvent, WorkerInfo,
    channel_message,
)

GATEWAY_ID = "bench-gw"
TOKEN_ID = 42  # every fake sample


@dataclass
class LoadConfig:
    redis_url: str
    prefix: str
    num_workers: int
    prompt_tokens: int = 32
    output_tokens: int = 16
    seqs_per_worker: int = 16
    heartbeat_interval: float = 0.5
    heartbeat_ttl: float = 3.0
    num_blocks: int = 4096  # per fake worker: never the limit
    block_size: int = 16
    max_model_len: int = 2048


# ---------------------------------------------------------------------------- fake workers


class FakeWorker:
    """One worker's state: the sequences it holds (gateway, known tokens, outputs so far, max_tokens)."""

    def __init__(self, worker_id: str, cfg: LoadConfig):
        self.worker_id = worker_id
        self.info = WorkerInfo(worker_id, "mixed", "fake", cfg.num_blocks, cfg.block_size, cfg.max_model_len,
                               os.getpid(), time.time(), 0)
        self.seqs: dict[str, list] = {}
        self.epoch = 0

    def run(self, plan: StepPlan) -> tuple[StepResult | None, dict[str, list[TokenEvent]]]:
        """The step's result and its events by gateway, at once (None: a stale plan, ack only)."""
        if plan.epoch < self.epoch:
            return None, {}
        self.epoch = plan.epoch
        if plan.reset:
            self.seqs.clear()
        started = {s.seq_id for s in plan.starts}
        for rid in plan.releases:
            if rid not in started:
                self.seqs.pop(rid, None)
        for s in plan.starts:
            self.seqs[s.seq_id] = [s.gateway_id, len(s.prompt_ids) + len(s.output_ids), len(s.output_ids),
                                   s.params.max_tokens]
        events: list[TokenEvent] = []
        by_gateway: dict[str, list[TokenEvent]] = defaultdict(list)
        for c in plan.chunks:
            seq = self.seqs.get(c.seq_id)
            if seq is None or c.start_pos + c.num_tokens < seq[1] or seq[2] >= seq[3]:
                continue  # unknown, mid-prefill (nothing to sample), or finished a step ago
            offset = seq[2]
            seq[1] += 1
            seq[2] += 1
            ev = TokenEvent(c.seq_id, offset, [TOKEN_ID], "length" if seq[2] >= seq[3] else None)
            events.append(ev)
            by_gateway[seq[0]].append(ev)
        result = StepResult(plan.step_id, self.worker_id, events, plan.num_tokens, 1e-4, plan.epoch)
        return result, by_gateway


async def fleet_main(cfg: LoadConfig, worker_ids: list[str], counter, stop) -> None:
    keys = Keys(cfg.prefix)
    client = aioredis.from_url(cfg.redis_url)
    workers = {wid: FakeWorker(wid, cfg) for wid in worker_ids}
    streams = {keys.steps(wid): wid for wid in worker_ids}
    for stream in streams:  # join the steps group before the first heartbeat, as the relay does
        try:
            await client.xgroup_create(stream, keys.worker_group, id="$", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def heartbeat() -> None:
        while True:
            pipe = client.pipeline(transaction=False)
            for w in workers.values():
                pipe.sadd(keys.workers, w.worker_id)
                pipe.set(keys.worker_heartbeat(w.worker_id), w.info.to_wire(), px=int(cfg.heartbeat_ttl * 1000))
            await pipe.execute()
            await asyncio.sleep(cfg.heartbeat_interval)

    beat = asyncio.create_task(heartbeat())
    read_from = {s: ">" for s in streams}
    answered = 0
    try:
        while not stop.is_set():
            resp = await client.xreadgroup(keys.worker_group, "fleet", read_from, count=8, block=200)
            if not resp:
                continue
            pipe = client.pipeline(transaction=False)
            for stream, entries in resp:
                stream = stream.decode()
                w = workers[streams[stream]]
                for entry_id, fields in entries:
                    result, by_gateway = w.run(StepPlan.from_wire(fields[FIELD.encode()]))
                    if result is not None:
                        for gw, evs in by_gateway.items():
                            pipe.publish(keys.gateway_channel(gw), TokenBatch(result.step_id, w.worker_id, evs).to_wire())
                        pipe.xadd(keys.results, {FIELD: result.to_wire()}, maxlen=STREAM_MAXLEN, approximate=True)
                        answered += 1
                    pipe.xack(stream, keys.worker_group, entry_id)
                    pipe.xdel(stream, entry_id)
            await pipe.execute()
            with counter.get_lock():
                counter.value = answered
    finally:
        beat.cancel()
        pipe = client.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.delete(keys.worker_heartbeat(wid))
        await pipe.execute()
        await client.aclose()


def fleet_process(cfg: LoadConfig, worker_ids: list[str], counter, stop) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through `stop`
    asyncio.run(fleet_main(cfg, worker_ids, counter, stop))


# ---------------------------------------------------------------------------- fake gateway


class FakeGateway:
    """Keeps `concurrency` requests in flight (closed loop), or submits `rate` a second whatever finishes
    (open loop); counts the finished ones (finish_reason on its channel)."""

    def __init__(self, cfg: LoadConfig, concurrency: int, rate: float = 0.0):
        self.cfg, self.concurrency, self.rate = cfg, concurrency, rate
        self.keys = Keys(cfg.prefix)
        self.client = aioredis.from_url(cfg.redis_url)
        self.params = SamplingParams(max_tokens=cfg.output_tokens, temperature=0.0, ignore_eos=True).validate()
        self.prompt = [(7 * i + 3) % 1000 for i in range(cfg.prompt_tokens)]
        self.next_id = 0
        self.finished = 0
        self.errors = 0
        self.to_submit = 0 if rate else concurrency

    async def submit_due(self) -> None:
        n, self.to_submit = self.to_submit, 0
        if not n:
            return
        pipe = self.client.pipeline(transaction=False)
        now = time.time()
        for _ in range(n):
            req = SubmitRequest(f"r{self.next_id}", GATEWAY_ID, self.prompt, self.params, arrival_time=now)
            self.next_id += 1
            pipe.xadd(self.keys.requests, {FIELD: req.to_wire()})
        await pipe.execute()

    async def run(self, stop: asyncio.Event, ready: asyncio.Event) -> None:
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.gateway_channel(GATEWAY_ID))
        ready.set()
        await self.submit_due()
        started = time.monotonic()
        while not stop.is_set():
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.01 if self.rate else 0.05)
            while msg is not None:
                batch = channel_message(msg["data"])
                for ev in batch.events if isinstance(batch, TokenBatch) else ():  # not a SequenceProgress
                    if ev.finish_reason is not None:
                        self.finished += 1
                        self.errors += ev.error is not None
                        self.to_submit += not self.rate
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
            if self.rate:
                self.to_submit = int((time.monotonic() - started) * self.rate) - self.next_id
            await self.submit_due()
        await pubsub.aclose()
        await self.client.aclose()
