"""A gateway served in the test's event loop on a free port, and the SSE reader the gateway tests share."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from phaseserve.gateway.app import create_app
from phaseserve import settings
from phaseserve.redis_server import free_port


async def serve_gateway(argv: list[str]) -> tuple[web.AppRunner, str]:
    """`phaseserve gateway ARGV` as an aiohttp app on 127.0.0.1: (its runner, to clean up; its base URL)."""
    app = create_app(settings.parse("gateway", argv))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def read_sse(resp: aiohttp.ClientResponse, stop_after: int | None = None,
                   counts=lambda data: True) -> tuple[list[str], list[dict]]:
    """-> (event ids, data objects) of an SSE response; stop_after: stop reading once that many data events
    for which `counts(data)` holds have arrived."""
    ids, data = [], []
    async for line in resp.content:
        if line.startswith(b"id: "):
            ids.append(line[4:].strip().decode())
        elif line.startswith(b"data: {"):
            data.append(json.loads(line[6:]))
            if stop_after is not None and sum(1 for d in data if counts(d)) >= stop_after:
                break
    return ids, data


RESUME = {"X-Resume": "1"}  # ask for event ids (and the resume token): the stream can then be resumed


async def post_resume(http: aiohttp.ClientSession, url: str, body: dict, last_event_id: str, headers=None,
                      within_s: float = 30.0) -> aiohttp.ClientResponse:
    """Re-send a request with Last-Event-ID, as a reconnecting client does: a 409 (the gateway has not yet
    seen the old connection end) is retried after its Retry-After."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        resp = await http.post(url, json=body, headers={**(headers or {}), "Last-Event-ID": last_event_id})
        if resp.status != 409 or asyncio.get_running_loop().time() > deadline:
            return resp
        wait = float(resp.headers.get("Retry-After", "1"))
        resp.release()
        await asyncio.sleep(wait)
