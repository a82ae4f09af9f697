"""The gateway's token channel: one pub/sub subscription on `gw:<gateway>`, as long as the gateway lives.

Its reader decodes each message (a worker's TokenBatch, or the scheduler's SequenceProgress) and hands
every event to the routes. A lost connection is resubscribed with a backoff; until then `subscribed` is
clear and requests are answered 503.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import structlog

from phaseserve.gateway.redis_connections import REDIS_ERRORS
from phaseserve.gateway.token_delivery import TokenRoutes
from phaseserve.wire import SequenceProgress, WireError, channel_message

log = structlog.get_logger("gateway.channel")


class TokenChannel:
    def __init__(self, connection: aioredis.Redis, channel: str, routes: TokenRoutes):
        self.connection, self.channel, self.routes = connection, channel, routes
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self.connection.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while (msg := await pubsub.get_message(timeout=1.0)) is None or msg["type"] != "subscribe":
                    pass
                self.subscribed.set()
                log.info("subscribed", channel=self.channel)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg["type"] == "message":
                        self.on_message(msg["data"])
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                if self.subscribed.is_set():
                    log.warning("token channel lost; resubscribing", error=str(e))
                self.subscribed.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # the connection may already be gone
                    pass

    def on_message(self, data: bytes) -> None:
        try:
            batch = channel_message(data)
        except (WireError, KeyError, TypeError, ValueError) as e:
            log.warning("undecodable message on token channel", error=str(e))
            return
        if isinstance(batch, SequenceProgress):
            self.routes.vouch(batch.seq_ids)
            return
        for ev in batch.events:
            if not self.routes.deliver(ev):
                log.debug("tokens for unknown sequence", seq_id=ev.seq_id)  # finished or cancelled
