"""Delivery end to end: a whole stack (see the `stack` fixture) plus a second gateway on the same
Redis, in this process.

- SSE resume: a client reads part of a greedy stream from the first gateway, its connection breaks, and it
  re-sends the request to the second gateway with Last-Event-ID: it gets exactly the remaining tokens (the
  texts and token counts equal an uninterrupted greedy run), and no second generation is started.
- Lost pub/sub: the second gateway's subscriber is stopped (every message the worker publishes to it is
  lost), and its requests still complete, equal to the first gateway's, from the token log."""

from __future__ import annotations

import asyncio

import aiohttp

from phaseserve.gateway.state import GATEWAY
from gateway_client import RESUME, post_resume, read_sse, serve_gateway

MAX_TOKENS = 24


def text_of(data):
    return "".join(d["choices"][0]["text"] for d in data if d.get("choices"))


async def second_gateway(stack, *flags: str):
    return await serve_gateway(["--redis-url", stack.redis_url, "--model", str(stack.model_dir),
                                "--key-prefix", stack.key_prefix, "--gateway-id", "gw-second",
                                "--served-model-name", stack.model, *flags])


async def test_a_stream_resumed_on_a_second_gateway_equals_an_uninterrupted_greedy_run(stack):
    body = {"model": stack.model, "prompt": "The history of the city begins", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    runner, second_url = await second_gateway(stack)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(stack.api_url + "/completions", json=body) as resp:
                _, whole = await read_sse(resp)
            expected = text_of(whole)
            assert whole[-1]["usage"]["completion_tokens"] == MAX_TOKENS

            resp = await http.post(stack.api_url + "/completions", json=body, headers=RESUME)
            ids, head = await read_sse(resp, stop_after=4, counts=lambda d: bool(d.get("choices")))
            resp.close()  # the connection breaks after 4 chunks
            rid = resp.headers["X-Request-Id"]
            assert ids[-1].startswith(f"{rid}:{resp.headers['X-Resume-Token']}:")
            async with await post_resume(http, second_url + "/v1/completions", body, ids[-1]) as res:
                assert res.status == 200
                _, tail = await asyncio.wait_for(read_sse(res), 120)
        assert text_of(head) + text_of(tail) == expected
        assert tail[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert [d["choices"][0]["finish_reason"] for d in tail if d.get("choices")][-1] == "length"
        # the scheduler admitted the request once: the resume started no generation
        admitted = [line for line in stack.logs().splitlines() if "request admitted" in line and rid in line]
        assert len(admitted) == 1, admitted
    finally:
        await runner.cleanup()


async def test_streams_complete_from_the_token_log_when_pubsub_loses_every_message(stack):
    body = {"model": stack.model, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    prompts = ["A story about the sea", "The rules of chess are"]
    runner, second_url = await second_gateway(stack, "--token-silence-timeout", "0.2")
    try:
        async with aiohttp.ClientSession() as http:
            expected = []
            for p in prompts:
                async with http.post(stack.api_url + "/completions", json={**body, "prompt": p}) as resp:
                    expected.append(text_of((await read_sse(resp))[1]))
            # stop the second gateway's subscriber: the channel is gone, its messages are dropped by Redis
            backend = runner.app[GATEWAY].backend
            reader = backend.tasks[0]
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            assert await backend.connections.subscriber.pubsub_numsub(
                f"{stack.key_prefix}:gw:gw-second") == [(f"{stack.key_prefix}:gw:gw-second".encode(), 0)]

            async def one(p):
                async with http.post(second_url + "/v1/completions", json={**body, "prompt": p}) as resp:
                    return text_of((await read_sse(resp))[1])

            got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)
        assert got == expected
    finally:
        await runner.cleanup()
