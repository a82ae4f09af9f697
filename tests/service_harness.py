"""The services' test harness over a real Redis: model workers in threads (or processes), a scheduler in
this event loop, and a stand-in gateway that submits requests and collects tokens by offset."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import redis
import redis.asyncio as aioredis

from phaseserve.params import SamplingParams
from phaseserve.procs import stop_process
from phaseserve.redis_client import connect_async
from phaseserve.wire import FIELD, CancelRequest, Keys, SubmitRequest, TokenBatch, channel_message
from phaseserve.scheduler.service import PolicyLimits, SchedulerService
from phaseserve.workers.runner import ModelRunner
from phaseserve.workers.relay_link import RelayError
from phaseserve.workers.service import WorkerService

MAX_TOKENS = 12
ROOT = Path(__file__).resolve().parent.parent


class WorkerThread:
    def __init__(self, model_dir, url: str, keys: Keys, worker_id: str, num_blocks: int = 64, speculative=None,
                 **service_kw):
        runner = ModelRunner(model_dir, num_blocks=num_blocks, speculative=speculative)
        kw = dict(heartbeat_interval=0.1, heartbeat_ttl=0.6, block_ms=20) | service_kw
        self.service = WorkerService(runner, url, keys, worker_id, **kw)
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.service.run()
        except RelayError as e:  # its relay was killed (a worker dying without a word)
            self.error = e

    def stop(self):
        self.service.request_stop()
        self.thread.join(10)


class WorkerProcess:
    """`python -m phaseserve.workers` as a child process (what SIGSTOP and kill -9 need)."""

    def __init__(self, model_dir, url: str, keys: Keys, worker_id: str, log_path: Path, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phaseserve.workers", "--model", str(model_dir), "--redis-url", url,
             "--key-prefix", keys.prefix, "--worker-id", worker_id, "--heartbeat-interval", "0.1",
             "--heartbeat-ttl", "0.6", "--kv-cache-memory", "4MiB", "--num-threads", "1", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        stop_process(self.proc, 15)
        self.log.close()


class SchedulerProcess:
    """`python -m phaseserve.scheduler` as a child process (what kill -9 needs)."""

    def __init__(self, url: str, keys: Keys, log_path: Path, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phaseserve.scheduler", "--redis-url", url, "--key-prefix", keys.prefix,
             "--heartbeat-interval", "0.1", "--max-num-batched-tokens", "64", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def consumer(self) -> str:
        import socket
        return f"scheduler-{socket.gethostname()}-{self.proc.pid}"

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()


class Gateway:
    """The gateway's side of the wire: submit, cancel, collect tokens by offset.

    `allow_gaps`: tokens published while Redis was away are lost to pub/sub (the gateway's durable token
    log fills such gaps; this stand-in does not), so a test of an outage records them instead of failing."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str = "gw", allow_gaps: bool = False):
        self.client, self.keys, self.gateway_id = client, keys, gateway_id
        self.allow_gaps = allow_gaps
        self.tokens: dict[str, list[int]] = {}  # contiguous from offset 0
        self.by_offset: dict[str, dict[int, int]] = {}  # every token seen, first one per offset
        self.finish: dict[str, str] = {}
        self.finished_by: dict[str, str] = {}  # seq id -> the worker whose batch carried its finish
        self.errors: dict[str, tuple[str | None, str]] = {}  # seq id -> (error_kind, message)
        self.duplicates = 0
        self.conflicts = 0  # a token at an offset already seen, with another value: two samples spliced
        self.gaps = 0
        self.last_token_at: dict[str, float] = {}
        self.longest_stall = 0.0

    async def listen(self, ready: asyncio.Event):
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.keys.gateway_channel(self.gateway_id))
                ready.set()
                async for msg in pubsub.listen():
                    if msg["type"] == "message":
                        batch = channel_message(msg["data"])
                        if isinstance(batch, TokenBatch):  # not the scheduler's SequenceProgress
                            self.on_batch(batch)
            except (redis.ConnectionError, ConnectionError, OSError):
                if not self.allow_gaps:
                    raise
                await asyncio.sleep(0.1)  # Redis away: subscribe again once it is back
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 -- the connection may be gone already
                    pass

    def on_batch(self, batch: TokenBatch) -> None:
        now = time.monotonic()
        for ev in batch.events:
            seen = self.by_offset.setdefault(ev.seq_id, {})
            if ev.token_ids and ev.seq_id in self.last_token_at:
                self.longest_stall = max(self.longest_stall, now - self.last_token_at[ev.seq_id])
            if ev.token_ids:
                self.last_token_at[ev.seq_id] = now
            for i, tok in enumerate(ev.token_ids):
                off = ev.offset + i
                if off in seen:
                    self.duplicates += 1
                    self.conflicts += seen[off] != tok
                else:
                    seen[off] = tok
            out = self.tokens.setdefault(ev.seq_id, [])
            if ev.offset > len(out):
                assert self.allow_gaps, f"gap in {ev.seq_id}: offset {ev.offset} after {len(out)}"
                self.gaps += 1
            while len(out) in seen:
                out.append(seen[len(out)])
            if ev.finish_reason:
                self.finish[ev.seq_id] = ev.finish_reason
                self.finished_by.setdefault(ev.seq_id, batch.worker_id)
                self.last_token_at.pop(ev.seq_id, None)
            if ev.error:
                self.errors[ev.seq_id] = (ev.error_kind, ev.error)

    async def submit(self, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
                     params: SamplingParams | None = None):
        params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = SubmitRequest(rid, self.gateway_id, prompt, params, arrival_time=time.time())
        await self.client.xadd(self.keys.requests, {FIELD: req.to_wire()})

    async def cancel(self, rid: str):
        await self.client.xadd(self.keys.requests, {FIELD: CancelRequest(rid).to_wire()})

    async def wait(self, predicate, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; finished: {self.finish}"
            await asyncio.sleep(0.02)


async def stats(client: aioredis.Redis, keys: Keys) -> dict:
    data = await client.get(keys.scheduler_stats())
    return msgpack.unpackb(data) if data else {}


async def start(url: str, keys: Keys, *, gateway: bool = True, allow_gaps: bool = False,
                limits: PolicyLimits | None = None, **service_kw):
    client = connect_async(url)  # as the service's own: commands retried through a Redis restart
    kw = dict(heartbeat_interval=0.1) | service_kw
    limits = limits or PolicyLimits(max_num_batched_tokens=64, long_prefill_threshold=40)
    sched = SchedulerService(client, keys, limits, **kw)
    gw = Gateway(connect_async(url), keys, allow_gaps=allow_gaps)
    ready = asyncio.Event()
    tasks = [asyncio.create_task(sched.run()), asyncio.create_task(gw.listen(ready))]
    await ready.wait()
    return client, sched, gw, tasks


async def stop(client, sched, gw, tasks):
    sched.stop()
    await asyncio.wait_for(tasks[0], 10)
    tasks[1].cancel()
    await asyncio.gather(tasks[1], return_exceptions=True)
    await client.aclose()
    await gw.client.aclose()
