"""The event loop of every asyncio process here (gateway, scheduler, bench client): uvloop when it is
installed, whose I/O callbacks cost less CPU than asyncio's own loop, else asyncio's."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run on new_event_loop()."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
