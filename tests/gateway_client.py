"""A gateway served in the test's event loop on a free port, and the SSE reader the gateway tests share."""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from gateway.app import create_app
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
