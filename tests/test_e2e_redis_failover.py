"""A Redis that fails over under a live stack: a primary, a replica and three sentinels (redis-server, on
free ports); the stack is given the redis+sentinel:// URL. In the middle of 16 greedy float32 streams the
primary is killed (kill -9): the sentinels promote the replica, every service finds it, and every stream
completes with the text it has unfaulted (docs/redis.md, "What survives a failover")."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import openai
import pytest

from e2e_stack import running_stack
from phaseserve.redis_topologies import SentinelSet

STREAMS = 16
MAX_TOKENS = 160  # long enough that no stream ends before the slowest has its first chunks (the fault is mid-run)
CHUNKS_BEFORE_FAULT = 8


def _prompt(i: int) -> str:
    return f"Story number {i}: once upon a time"


async def _stream(client: openai.AsyncOpenAI, model: str, i: int, progress: list[int], stalls: list[float]) -> str:
    stream = await client.completions.create(model=model, prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    parts, last = [], None
    async for chunk in stream:
        now = time.monotonic()
        if last is not None:
            stalls[i] = max(stalls[i], now - last)
        last = now
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            progress[i] += 1
    return "".join(parts)


async def _run(base_url: str, model: str, fault=None) -> tuple[list[str], list[float], float | None]:
    progress, stalls = [0] * STREAMS, [0.0] * STREAMS
    failover_s = None
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, model, i, progress, stalls)) for i in range(STREAMS)]
        if fault is not None:
            while min(progress) < CHUNKS_BEFORE_FAULT and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            assert not any(t.done() for t in tasks), "a stream ended before the fault"
            failover_s = await asyncio.get_running_loop().run_in_executor(None, fault)
        texts = await asyncio.gather(*tasks)
    return texts, stalls, failover_s


def _ready_within(base_url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/health/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


@pytest.mark.timeout(900)
def test_a_sentinel_failover_mid_stream_loses_no_stream(e2e_model, tmp_path):
    with SentinelSet() as sentinels, running_stack(e2e_model, tmp_path, redis_url=sentinels.url, dtype="float32",
                                                   heartbeat_ttl=5.0) as stack:
        old = sentinels.primary()
        reference, _, _ = asyncio.run(_run(stack.api_url, stack.model))
        assert all(reference), "the unfaulted run produced an empty text"

        def kill_primary() -> float:
            _new, seconds = sentinels.kill_primary()
            return seconds

        texts, stalls, failover_s = asyncio.run(_run(stack.api_url, stack.model, kill_primary))
        new = sentinels.primary()
        print(f"\nfailover (kill -9 until the sentinels named the replica): {failover_s:.2f} s; "
              f"longest stall a stream saw: {max(stalls):.2f} s")
        assert (new.host, new.port) != (old.host, old.port)
        differ = [(i, t, r) for i, (t, r) in enumerate(zip(texts, reference)) if t != r]
        assert not differ, f"{len(differ)} of {STREAMS} streams differ from the unfaulted run, e.g. {differ[0]}"
        assert stack.alive(), "a service exited over the failover"
        # and the stack keeps serving on the new primary, once the gateway says it is ready again (its token
        # channel may still be resubscribing: until then it answers 503 "retry later", as a balancer expects)
        assert _ready_within(stack.base_url, 30.0), "the gateway never became ready on the new primary"
        again, _, _ = asyncio.run(_run(stack.api_url, stack.model))
        assert again == reference
