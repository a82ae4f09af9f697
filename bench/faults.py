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
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench.fault_stack import Stack
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.models.model_source import bundled_model_path
from phaseserve.settings import SETTINGS

FAULTS = ("worker-kill", "scheduler-restart", "scheduler-standby", "redis-restart", "redis-failover",
          "worker-freeze", "lost-messages", "gateway-kill", "worker-drain", "poison-request")
SUBJECTS = ["The quick brown fox", "Hello world!", "Once upon a time", "Paged attention keeps",
            "A small language model", "The lazy dog", "Numbers like 0123", "There was a CPU"]
WARM_UP_REQUESTS, WARM_UP_TOKENS = 4, 80  # enough steps on each worker for the scheduler to learn its costs
# the choice of issue #32 (seconds for the engine to build before budgets), and the largest the gateway accepts
POISON_OPTIONS = (60_000, next(s.default for s in SETTINGS if s.name == "max_grammar_choices"))


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
