"""Clients that do not read their stream: a deadline on every SSE write and a cap on what waits for them.

A client that stops reading (or reads slower than tokens come) holds its request, its KV blocks and a
slot of --max-waiting-requests for as long as it stays connected, while its events pile up in memory.
So a write that the client does not take within --client-write-timeout, or a request whose unsent events
exceed --stream-buffer-events, drops the connection; the request is then cancelled at once (no resume
grace: the client did not go away, it stopped reading).
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class SlowClient(Exception):
    """The client did not read its stream in time; its connection is dropped."""


async def write_within(resp: web.StreamResponse, request: web.Request, data: bytes, timeout_s: float,
                       eof: bool = False) -> None:
    """resp.write(data) (or write_eof) that waits for the client at most timeout_s (0: no deadline)."""
    write = resp.write_eof(data) if eof else resp.write(data)
    if timeout_s <= 0:
        await write
        return
    try:
        async with asyncio.timeout(timeout_s):
            await write
    except TimeoutError:
        drop(request)
        raise SlowClient(f"the client read nothing for {timeout_s:g} s") from None


def drop(request: web.Request) -> None:
    """Close the client's connection without flushing what it did not read."""
    if request.transport is not None:
        request.transport.abort()
