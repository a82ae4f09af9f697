"""Many concurrent streams over real sockets: the service equals the in-process engine token for
token, and clients that go away free their KV blocks without disturbing the others."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai

from e2e_reference import engine_texts, metric, prompts

MAX_TOKENS = 10


async def _stream_text(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    parts = []
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
    return "".join(parts)


async def test_32_concurrent_greedy_streams_equal_the_engine(stack):
    ps = prompts(32)
    async with openai.AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        texts = await asyncio.gather(*(_stream_text(client, stack.model, p, MAX_TOKENS) for p in ps))
    expected = engine_texts(stack.model_dir, ps, MAX_TOKENS)
    mismatches = [(p, t, e) for p, t, e in zip(ps, texts, expected) if t != e]
    assert not mismatches, f"{len(mismatches)} of 32 differ, e.g. {mismatches[0]}"


async def _open_and_abandon(http: aiohttp.ClientSession, model: str, prompt: str, events_before_close: int) -> int:
    """Start a long stream, read a few SSE events, then drop the connection mid-generation."""
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    seen = 0
    resp = await http.post("/v1/completions", json=body)
    assert resp.status == 200
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            json.loads(line[6:])
            seen += 1
            if seen >= events_before_close:
                break
    resp.close()  # closes the socket: the gateway must notice and cancel the request
    return seen


async def test_closing_streams_frees_kv_blocks_and_spares_the_others(stack):
    survivors = prompts(4)
    async with openai.AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client, \
            aiohttp.ClientSession(base_url=stack.base_url) as http:
        kept = [asyncio.create_task(_stream_text(client, stack.model, p, MAX_TOKENS)) for p in survivors]
        seen = await asyncio.gather(*(_open_and_abandon(http, stack.model, f"Abandoned stream {i}:", 3)
                                      for i in range(10)))
        texts = await asyncio.gather(*kept)
    assert seen == [3] * 10
    assert texts == engine_texts(stack.model_dir, survivors, MAX_TOKENS)

    # the 10 abandoned requests (400 tokens each) would still be running if nobody cancelled them
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(stack.base_url, "kv_blocks_used") == 0 and metric(stack.base_url, "num_requests_running") == 0:
            break
        await asyncio.sleep(0.2)
    assert metric(stack.base_url, "kv_blocks_used") == 0
    assert metric(stack.base_url, "num_requests_running") == 0
    assert stack.scheduler_stats()["kv_blocks_used"] == 0
    assert stack.logs().count("request cancelled") >= 10
