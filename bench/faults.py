"""Faults against a live stack: does every stream complete, token for token?

`python -m bench.faults [--model DIR] [--dtype float32] [--faults ...] [--max-tokens 96]`

For each fault, a fresh stack (redis-server with AOF, two workers, a scheduler (two for the standby
fault), a gateway: each a process of its own, as `docker compose` runs them, at default settings but a
short heartbeat and lease) serves a warm-up (a few requests, so the scheduler has learned each worker's
step costs, as on a server that has been serving), then 16 greedy and 4 seeded sampled streams through the
OpenAI API. Once every stream has streamed a few tokens the fault is injected; the table gives, per
fault, the streams completed, the texts equal to the unfaulted run, and the longest stall a client saw
(the longest wait for its next chunk).

Faults: worker-kill (kill -9 of a worker), scheduler-restart (kill -9, a new one started),
scheduler-standby (kill -9 with a standby running), redis-restart (Redis stopped 5 s, restarted on
its port from its AOF), redis-failover (the stack on a primary, a replica and three sentinels through a
redis+sentinel:// URL; kill -9 of the primary: the sentinels promote the replica), worker-freeze (SIGSTOP of a worker's model process for 30 s, the default
--step-timeout: its learned step deadline, seconds, finds it first),
lost-messages (one plan and one result deleted from their streams before their consumer reads them:
the relay's blocked read is cut and the next plan deleted while it reconnects; the scheduler is paused
while a result is deleted), gateway-kill (kill -9 of the gateway the clients stream from: each client
re-sends its request with the `Last-Event-ID` of the last event it got to a second gateway, as an SSE
client reconnecting through a load balancer does, and reads the rest of its stream there), worker-drain
(SIGTERM to a worker: it drains, its streams finish on it, and it exits), poison-request (`guided_choice`
requests of each of --poison-options sizes sent at once through the API beside the streams: by default the
issue's 60,000 options, which the gateway's budget refuses, and the largest choice the budget accepts, which
a worker prepares while the streams go on; their answers are printed under the table).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis
from tqdm import tqdm

from phaseserve.benchmark.sse import sse_messages
from phaseserve.models.model_source import bundled_model_path
from phaseserve.procs import stop_process
from phaseserve.redis_client import connect
from phaseserve.redis_server import find_redis_server, free_port
from phaseserve.redis_topologies import SentinelSet
from phaseserve.settings import SETTINGS
from phaseserve.wire import Keys

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("worker-kill", "scheduler-restart", "scheduler-standby", "redis-restart", "redis-failover",
          "worker-freeze", "lost-messages", "gateway-kill", "worker-drain", "poison-request")
SUBJECTS = ["The quick brown fox", "Hello world!", "Once upon a time", "Paged attention keeps",
            "A small language model", "The lazy dog", "Numbers like 0123", "There was a CPU"]
LEASE_TTL_S = 2.0
FREEZE_S = 30.0  # the default --step-timeout: a frozen model must be found long before it
WARM_UP_REQUESTS, WARM_UP_TOKENS = 4, 80  # enough steps on each worker for the scheduler to learn its costs
CLIENT_LEASE_TTL_S = 1.0
# the choice of issue #32 (seconds for the engine to build before budgets), and the largest the gateway accepts
POISON_OPTIONS = (60_000, next(s.default for s in SETTINGS if s.name == "max_grammar_choices"))


class Service:
    """One service process, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name, self.argv = name, argv
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        stop_process(self.proc, 15)


class Stack:
    def __init__(self, model: str, dtype: str, log_dir: Path, standby: bool, second_gateway: bool = False,
                 sentinel: bool = False):
        self.model, self.dtype, self.log_dir = model, dtype, log_dir
        self.redis_port, self.port = free_port(), free_port()
        self.second_port = free_port() if second_gateway else None
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.keys = Keys("ps")
        self.redis_dir = tempfile.mkdtemp(prefix="faults-redis-", dir=log_dir)
        self.services: dict[str, Service] = {}
        self.standby = standby
        # a primary, a replica and three sentinels instead of one redis-server (the redis-failover fault)
        self.sentinels = SentinelSet() if sentinel else None
        self.client: redis.Redis | None = None

    def redis_service(self) -> Service:
        return Service("redis", [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.redis_port),
                                 "--dir", self.redis_dir, "--save", "", "--appendonly", "yes",
                                 "--appendfsync", "always", "--protected-mode", "no"], self.log_dir)

    def scheduler(self, name: str) -> Service:
        return Service(name, [sys.executable, "-m", "scheduler", "--redis-url", self.redis_url,
                              "--heartbeat-interval", "0.2", "--scheduler-lease-ttl", str(LEASE_TTL_S)],
                       self.log_dir)

    def worker(self, name: str) -> Service:
        return Service(name, [sys.executable, "-m", "workers", "--model", self.model, "--redis-url", self.redis_url,
                              "--worker-id", name, "--dtype", self.dtype, "--num-threads", "1",
                              "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0",
                              "--kv-cache-memory", "128MiB"], self.log_dir)

    def start(self) -> None:
        if self.sentinels is not None:
            self.redis_url = self.sentinels.start().url
        else:
            self.services["redis"] = self.redis_service().start()
        self.client = connect(self.redis_url)
        self.wait(lambda: self._ping(), 10, "redis")
        self.services["s1"] = self.scheduler("s1").start()
        if self.standby:
            self.services["s2"] = self.scheduler("s2").start()
        for w in ("w1", "w2"):
            self.services[w] = self.worker(w).start()
        for name, port in (("gw", self.port), ("gw2", self.second_port)):
            if port is not None:
                # a short client lease: a resume after a gateway's kill -9 waits for its leases to lapse
                self.services[name] = Service(name, [sys.executable, "-m", "gateway", "--model", self.model,
                                                     "--redis-url", self.redis_url, "--port", str(port),
                                                     "--client-lease-ttl", str(CLIENT_LEASE_TTL_S)],
                                              self.log_dir).start()
        self.wait(lambda: self._stats().get("num_workers") == 2 and self._health(self.port)
                  and (self.second_port is None or self._health(self.second_port)), 120, "the stack")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def _stats(self) -> dict:
        import msgpack
        try:
            data = self.client.get(self.keys.scheduler_stats())
        except redis.RedisError:
            return {}
        return msgpack.unpackb(data) if data else {}

    def _health(self, port: int) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up in {timeout:.0f} s (logs: {self.log_dir})")
            time.sleep(0.1)

    def stop(self) -> None:
        for s in reversed(list(self.services.values())):
            s.stop()
        if self.sentinels is not None:
            self.sentinels.stop()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------ faults

    def active_scheduler(self) -> Service:
        holder = (self.client.get(self.keys.scheduler_lease()) or b"").decode()
        return next(s for name, s in self.services.items() if name.startswith("s") and s.proc
                    and holder.endswith(f"-{s.proc.pid}"))

    def unread_entry(self, stream: str, group: str) -> bytes | None:
        last = next((g["last-delivered-id"] for g in self.client.xinfo_groups(stream)
                     if g["name"].decode() == group), b"0-0")
        unread = self.client.xrange(stream, min=f"({last.decode()}", count=1)
        return unread[0][0] if unread else None

    def delete_a_plan(self, worker: str) -> bool:
        """Delete a plan before the worker's relay reads it: its blocked read is cut (its connection
        killed), and the next plan the scheduler sends while it reconnects is deleted."""
        stream, name = self.keys.steps(worker), f"{self.keys.prefix}:relay:{worker}"
        for _attempt in range(50):
            for c in self.client.client_list():
                if c.get("name") == name and c.get("cmd") == "xreadgroup":
                    self.client.client_kill_filter(_id=c["id"])
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                entry = self.unread_entry(stream, self.keys.worker_group)
                if entry is not None and self.client.xdel(stream, entry):
                    return True
                time.sleep(0.002)
        return False

    def delete_a_result(self) -> bool:
        """Delete a result before the scheduler reads it: the scheduler is paused (SIGSTOP) while the
        workers finish their plans in flight, one result it has not read is deleted, then it resumes."""
        sched = self.active_scheduler()
        sched.signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                entry = self.unread_entry(self.keys.results, self.keys.scheduler_group)
                if entry is not None and self.client.xdel(self.keys.results, entry):
                    return True
                time.sleep(0.005)
            return False
        finally:
            sched.signal(signal.SIGCONT)

    async def inject(self, fault: str) -> None:
        loop = asyncio.get_running_loop()
        if fault == "worker-kill":
            self.services["w1"].kill9()
        elif fault in ("scheduler-restart", "scheduler-standby"):
            active = self.active_scheduler()
            active.kill9()
            if fault == "scheduler-restart":
                self.services["s3"] = self.scheduler("s3").start()
        elif fault == "redis-restart":
            self.services["redis"].kill9()
            await asyncio.sleep(5.0)
            self.services["redis"] = self.redis_service().start()
        elif fault == "redis-failover":
            await loop.run_in_executor(None, self.sentinels.kill_primary)
        elif fault == "worker-freeze":
            self.services["w1"].signal(signal.SIGSTOP)
            await asyncio.sleep(FREEZE_S)
            self.services["w1"].signal(signal.SIGCONT)
        elif fault == "lost-messages":
            plan = await loop.run_in_executor(None, self.delete_a_plan, "w1")
            # apart: two losses in a row on one worker leave no later result to reveal the first, and only
            # the step deadline finds it (tests/test_reliability.py has that case)
            await asyncio.sleep(0.3)
            result = await loop.run_in_executor(None, self.delete_a_result)
            if not (plan and result):
                raise RuntimeError(f"could not delete a plan ({plan}) and a result ({result})")
        elif fault == "gateway-kill":
            self.services["gw"].kill9()
        elif fault == "worker-drain":
            self.services["w1"].signal(signal.SIGTERM)
        elif fault not in ("none", "poison-request"):  # the poison goes through the API (run_fault)
            raise ValueError(f"unknown fault {fault!r}")


@dataclass
class Stream:
    index: int
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    longest_stall: float = 0.0
    last_at: float = field(default_factory=time.monotonic)
    last_event_id: str | None = None
    resumes: int = 0


async def run_stream(session: aiohttp.ClientSession, urls: list[str], model: str, s: Stream, max_tokens: int,
                     timeout_s: float) -> None:
    """One client: streams from urls[0]; when that connection breaks before the end, it re-sends the same
    request with `Last-Event-ID` to the next url (a client reconnecting through a load balancer)."""
    body = {"model": model, "prompt": f"{SUBJECTS[s.index % 8]}{' and more' * (s.index // 8)}",
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0}
    if s.index >= 16:  # 4 seeded sampled streams
        body.update(temperature=0.8, seed=1000 + s.index)
    s.last_at = time.monotonic()
    for attempt, url in enumerate(urls):
        # event ids only on request (X-Resume); a resume is refused (409) until the gateway has seen the old
        # connection end, which for a killed gateway is when its client leases expire: retry after Retry-After
        headers = {"Last-Event-ID": s.last_event_id} if attempt and s.last_event_id else {"X-Resume": "1"}
        s.resumes = attempt
        deadline = time.monotonic() + timeout_s
        while (retry_after := await _read_stream(session, url, body, headers, s, timeout_s)) is not None \
                and time.monotonic() + retry_after < deadline:
            await asyncio.sleep(retry_after)
        if s.finish_reason is not None:
            return


async def _read_stream(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, s: Stream,
                       timeout_s: float) -> float | None:
    """Read one response into s; -> seconds to wait before sending it again (a 409), else None."""
    s.error = None  # only the last attempt's error counts: a 409 retried into a whole stream is no failure
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}"
                return float(resp.headers.get("Retry-After", 1)) if resp.status == 409 else None
            async for event_id, msg in sse_messages(resp):
                if event_id is not None:
                    s.last_event_id = event_id
                if msg is None:  # [DONE]
                    continue
                if msg.get("error"):
                    s.error = str(msg["error"])[:200]
                for c in msg.get("choices") or ():
                    now = time.monotonic()
                    s.longest_stall = max(s.longest_stall, now - s.last_at)
                    s.last_at = now
                    s.text += c.get("text") or ""
                    s.chunks += 1
                    s.finish_reason = c.get("finish_reason") or s.finish_reason
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        s.error = f"{type(e).__name__}: {e}"
    return None


async def warm_up(session: aiohttp.ClientSession, url: str, model: str, i: int) -> None:
    body = {"model": model, "prompt": SUBJECTS[i % 8], "max_tokens": WARM_UP_TOKENS, "ignore_eos": True,
            "temperature": 0.0}
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"warm-up request failed: HTTP {resp.status} {await resp.text()}")


async def send_poison(session: aiohttp.ClientSession, url: str, model: str, options: int, timeout_s: float) -> str:
    """A `guided_choice` of `options` options through the API; -> its outcome: the status and the error's
    code and message (or the text), and how long it took."""
    body = {"model": model, "prompt": "Pick one:", "max_tokens": 8, "temperature": 0.0,
            "guided_choice": [str(i) for i in range(options)]}  # 60,000: ~530 KB, the issue's
    t = time.monotonic()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            answer = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return f"{type(e).__name__}: {e} after {time.monotonic() - t:.1f} s"
    error = answer.get("error") if isinstance(answer, dict) else None
    what = (f"{error.get('code') or error.get('type')}: {str(error.get('message'))[:160]}" if isinstance(error, dict)
            else repr(answer["choices"][0]["text"]))
    return f"HTTP {status} {what} after {time.monotonic() - t:.1f} s"


async def run_fault(stack: Stack, fault: str, max_tokens: int, timeout_s: float,
                    poison_options: tuple[int, ...] = POISON_OPTIONS) -> tuple[list[Stream], list[str]]:
    """The streams of one fault, and the poison requests' outcomes (poison-request only)."""
    streams = [Stream(i) for i in range(20)]
    urls = [f"http://127.0.0.1:{port}/v1/completions" for port in (stack.port, stack.second_port) if port]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{stack.port}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        await asyncio.gather(*(warm_up(session, urls[0], model, i) for i in range(WARM_UP_REQUESTS)))
        tasks = [asyncio.create_task(run_stream(session, urls, model, s, max_tokens, timeout_s)) for s in streams]
        deadline = time.monotonic() + timeout_s
        while not all(s.chunks >= 8 or s.finish_reason or s.error for s in streams):  # mid-run
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        poisons = [asyncio.create_task(send_poison(session, urls[0], model, n, timeout_s))
                   for n in (poison_options if fault == "poison-request" else ())]
        await stack.inject(fault)
        await asyncio.gather(*tasks)
        outcomes = [f"{n} options: {await p}" for n, p in zip(poison_options, poisons)]
    return streams, outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path(), help="model folder (default: the bundled model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a stream may take in all")
    p.add_argument("--poison-options", type=int, nargs="+", default=list(POISON_OPTIONS),
                   help="options of each of the poison-request fault's guided_choice requests")
    p.add_argument("--log-dir", default=None, help="where the services' logs go (default: a temporary folder)")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="phaseserve-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    reference: list[str] | None = None
    poison_outcomes: list[str] = []
    for fault in tqdm(["none", *args.faults], desc="faults", file=sys.stderr):
        fault_dir = log_dir / fault
        fault_dir.mkdir(exist_ok=True)
        stack = Stack(args.model, args.dtype, fault_dir, standby=fault == "scheduler-standby",
                      second_gateway=fault == "gateway-kill", sentinel=fault == "redis-failover")
        try:
            stack.start()
            t0 = time.monotonic()
            streams, outcome = asyncio.run(run_fault(stack, fault, args.max_tokens, args.timeout,
                                                     args.poison_options))
            poison_outcomes += outcome
            elapsed = time.monotonic() - t0
        finally:
            stack.stop()
        completed = [s for s in streams if s.finish_reason == "length" and not s.error]
        if fault == "none":
            if len(completed) != len(streams):
                raise SystemExit(f"the unfaulted run did not complete ({len(completed)}/20); logs: {fault_dir}")
            reference = [s.text for s in streams]
        equal = sum(s.text == r for s, r in zip(streams, reference))
        rows.append((fault, len(completed), equal, max(s.longest_stall for s in streams), elapsed,
                     sum(s.resumes > 0 for s in streams)))
    print(f"\n{args.dtype}, {args.max_tokens} tokens a stream, 16 greedy + 4 seeded sampled, 2 workers "
          f"(logs: {log_dir})")
    print("| fault | completed | texts equal to the unfaulted run | longest client stall (s) | run (s) "
          "| clients that resumed elsewhere |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fault, done, equal, stall, elapsed, resumed in rows:
        print(f"| {fault} | {done} / 20 | {equal} / 20 | {stall:.2f} | {elapsed:.1f} | {resumed} |")
    for outcome in poison_outcomes:
        print(f"\nthe poison request of {outcome}")
    return 0 if all(done == 20 and equal == 20 for _f, done, equal, *_rest in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
