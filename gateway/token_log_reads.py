"""Reads of the token logs (phaseserve/token_log.py), the durable copy of every token pub/sub may drop.

The sweeper: a gap in offsets, or a running request with no message for `silence_s`, gets its logs read
(one non-blocking multi-key XREAD a round), and a request with no new token for `progress_timeout_s` gets an
error event (ERROR_TIMEOUT), never an endless wait. The follower: a resumed request (SSE Last-Event-ID) is not
on this gateway's channel at all; its logs are read as they are written, with a blocking XREAD.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog

from phaseserve.gateway.redis_connections import REDIS_ERRORS
from phaseserve.gateway.token_delivery import DeliveryConfig, RequestStream, TokenRoutes
from phaseserve import token_log
from phaseserve.wire import Keys, WireError

log = structlog.get_logger("gateway.token_log")

FILL_COUNT = 4096  # entries per sequence per fill read


class TokenLogReads:
    def __init__(self, commands: aioredis.Redis, follower: aioredis.Redis, keys: Keys, routes: TokenRoutes,
                 config: DeliveryConfig):
        self.commands, self.follower, self.keys = commands, follower, keys
        self.routes, self.config = routes, config

    async def read(self, client: aioredis.Redis, streams: list[RequestStream], block_ms: int | None) -> None:
        """One XREAD over the token logs of these requests' open sequences, each from the offset it has."""
        want = {}
        for st in streams:
            for seq_id, offset in st.expected.items():
                want[self.keys.token_log(seq_id)] = token_log.read_from(offset)
        if not want:
            return
        got = await client.xread(want, count=FILL_COUNT, block=block_ms)
        for key, entries in got or ():
            seq_id = (key.decode() if isinstance(key, bytes) else key).split(":out:", 1)[1]
            stream = self.routes.by_seq.get(seq_id)
            if stream is None:
                continue
            for _entry_id, fields in entries:
                try:
                    stream.deliver(token_log.decode_entry(fields), from_log=True)
                except (WireError, TypeError, ValueError, IndexError) as e:
                    log.warning("undecodable token log entry", seq_id=seq_id, error=str(e))

    async def sweep(self) -> None:
        """Fills (gaps, silences) and deadlines: one non-blocking XREAD for every request that needs one."""
        cfg, routes = self.config, self.routes
        tick = max(0.02, min(cfg.silence_s, cfg.progress_timeout_s) / 4)
        while True:
            try:
                await asyncio.wait_for(routes.fill_wake.wait(), tick)
            except asyncio.TimeoutError:
                pass
            routes.fill_wake.clear()
            now = time.monotonic()
            for st in list(routes.streams):
                if st.expected and now - st.last_progress > cfg.progress_timeout_s:
                    log.warning("request stalled: giving up", seq_ids=st.open_seqs,
                                seconds=round(now - st.last_progress, 1))
                    st.fail_stalled(cfg.progress_timeout_s)
            wanted, routes.fill_wanted = routes.fill_wanted, set()
            silent = {st for st in routes.streams
                      if st.expected and not st.follow and now - st.last_message > cfg.silence_s}
            todo = [st for st in wanted | silent if st.expected]
            if not todo:
                for st in wanted:
                    st.release_held()
                continue
            for st in silent:
                st.last_message = now  # the next look after another silence, not on every tick
            try:
                await self.read(self.commands, todo, None)
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                log.warning("reading token logs failed", error=str(e))
            for st in wanted:
                st.release_held()

    async def follow(self) -> None:
        """Resumed requests: their tokens come from their logs only, read as they are written."""
        backoff = 0.1
        while True:
            following = [st for st in self.routes.streams if st.follow and st.expected]
            if not following:
                self.routes.follow_wake.clear()
                await self.routes.follow_wake.wait()
                continue
            try:
                await self.read(self.follower, following, 500)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                log.warning("following token logs failed", error=str(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
