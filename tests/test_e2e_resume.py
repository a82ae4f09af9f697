"""SSE resume end to end (issue #11): a whole stack (see the `stack` fixture) plus a second gateway on the same
Redis. A client reads part of a greedy stream from the first gateway, its connection breaks, and it re-sends
the request to the second gateway with Last-Event-ID: it gets exactly the remaining tokens (the texts and
token counts equal an uninterrupted greedy run), and no second generation is started."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from gateway.app import create_app
from phaseserve import settings
from phaseserve.redis_server import free_port

MAX_TOKENS = 24


async def read_sse(resp, stop_after=None):
    ids, data = [], []
    async for line in resp.content:
        if line.startswith(b"id: "):
            ids.append(line[4:].strip().decode())
        elif line.startswith(b"data: {"):
            data.append(json.loads(line[6:]))
            if stop_after is not None and sum(1 for d in data if d.get("choices")) >= stop_after:
                break
    return ids, data


def text_of(data):
    return "".join(d["choices"][0]["text"] for d in data if d.get("choices"))


async def second_gateway(stack):
    ns = settings.parse("gateway", ["--redis-url", stack.redis_url, "--model", str(stack.model_dir),
                                    "--key-prefix", stack.key_prefix, "--gateway-id", "gw-second",
                                    "--served-model-name", stack.model])
    runner = web.AppRunner(create_app(ns), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


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

            resp = await http.post(stack.api_url + "/completions", json=body)
            ids, head = await read_sse(resp, stop_after=4)
            resp.close()  # the connection breaks after 4 chunks
            rid = resp.headers["X-Request-Id"]
            assert ids[-1].startswith(rid + ":")
            async with http.post(second_url + "/v1/completions", json=body, headers={"Last-Event-ID": ids[-1]}) as res:
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
