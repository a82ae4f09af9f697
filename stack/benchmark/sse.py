"""Server-sent events as the benchmark clients read them: one parser for every client in bench/."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp


async def sse_messages(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, dict | None]]:
    """(event id, JSON data) for each `data:` line of a streamed response, in order; the data is None for
    `[DONE]`. Events end with a blank line, and a partial one waits for the next read; comments (pings),
    event names and blank lines are skipped. The id is the event's `id:` field (None without one)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            event_id, payloads = None, []
            for line in event.split(b"\n"):
                line = line.strip()
                if line.startswith(b"id:"):
                    event_id = line[3:].strip().decode()
                elif line.startswith(b"data:"):
                    payloads.append(line[5:].strip())
            for payload in payloads:
                yield event_id, None if payload == b"[DONE]" else json.loads(payload)
