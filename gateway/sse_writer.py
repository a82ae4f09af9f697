"""Server-sent events of a streamed response: compact JSON data lines, event ids for a client that resumes,
each write within the client write timeout (a client that does not read is dropped, gateway/slow_client.py)."""

from __future__ import annotations

import json
from typing import Callable

from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.errors import APIError
from phaseserve.gateway.slow_client import SlowClient, write_within

# SSE data lines: compact, UTF-8 as is; one encoder for every event (json.dumps with options builds one a call)
SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
DONE = b"data: [DONE]\n\n"


class SSEWriter:
    def __init__(self, resp: web.StreamResponse, request: web.Request, write_timeout: float,
                 event_id: Callable[[], str] | None = None):
        self.resp, self.request, self.write_timeout = resp, request, write_timeout
        self.event_id = event_id  # the id of the next event, for a client that may resume (None: no ids)

    def event(self, obj: dict, with_id: bool = False, name: str | None = None) -> bytes:
        """One event's bytes; `name`: its `event:` line (the Responses API names every event by its type)."""
        head = f"id: {self.event_id()}\n".encode() if with_id and self.event_id is not None else b""
        if name is not None:
            head += f"event: {name}\n".encode()
        return head + b"data: " + SSE_JSON.encode(obj).encode() + b"\n\n"

    async def write(self, data: bytes, eof: bool = False) -> None:
        await write_within(self.resp, self.request, data, self.write_timeout, eof)

    async def send(self, obj: dict, with_id: bool = False) -> None:
        await self.write(self.event(obj, with_id))

    async def try_send_error(self, err: APIError) -> None:
        """An error after the headers went out: it goes in the stream, if the client still reads."""
        try:
            await self.send(P.error_chunk(err))
        except (ConnectionError, SlowClient):
            pass
