"""`python -m phaseserve.gateway [flags]` (also `phaseserve gateway`): serve the OpenAI API."""

from __future__ import annotations

import errno
import sys

from aiohttp import web

from phaseserve.gateway.app import create_app
from phaseserve import logs, settings
from phaseserve.event_loop import new_event_loop
from phaseserve.procs import freeze_startup_heap


def main(argv: list[str] | None = None) -> None:
    ns = settings.parse("gateway", argv)
    log = logs.configure("gateway", ns.log_level, ns.log_json)
    app = create_app(ns)

    async def freeze(_app) -> None:  # after the app's own start-up (the Redis side, the tokenizer)
        freeze_startup_heap()

    app.on_startup.append(freeze)
    log.info("listening", host=ns.host, port=ns.port)
    # run_app turns SIGINT/SIGTERM into a graceful shutdown: stop accepting, let handlers finish
    # (their finally blocks cancel unfinished sequences), then close the Redis side.
    # handler_cancellation: a client that disconnects cancels its handler, even a non-streaming one.
    # keepalive_timeout: aiohttp closes a connection still waiting for a whole request's headers then (idle, or
    # sending them slowly); a body's own deadline is read_body's.
    try:
        web.run_app(app, host=ns.host, port=ns.port, handler_cancellation=True, shutdown_timeout=10.0,
                    keepalive_timeout=ns.keepalive_timeout,
                    access_log=None, print=None, loop=new_event_loop())
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        sys.exit(f"phaseserve gateway: port {ns.port} on {ns.host} is already in use; "
                 "stop what holds it or choose another with --port")


if __name__ == "__main__":
    main()
