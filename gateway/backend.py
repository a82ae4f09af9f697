"""The gateway's Redis side, composed of one part a job:

- `connections` (gateway/redis_connections.py): the command pool and the blocking readers' connections;
- `routes` (gateway/token_delivery.py): each open request's stream of token events, deduplicated by offset;
- `channel` (gateway/token_channel.py): the pub/sub subscription that feeds the routes;
- `token_logs` (gateway/token_log_reads.py): fills from the durable token logs, deadlines, resumed requests;
- `leases` (gateway/client_leases.py): who serves a client of each sequence, resume graces;
- `submissions` (gateway/submissions.py): submit and cancel;
- `workers` (phaseserve/live_workers.py), `scheduler` (gateway/scheduler_state.py), `resumes`
  (gateway/resumes.py), `usage` (gateway/key_usage.py): what handlers read and record.

This class only builds them, runs their loops, and ends them.
"""

from __future__ import annotations

import asyncio
import os
import time

import structlog

from phaseserve.gateway.client_leases import ClientLeases
from phaseserve.gateway.key_usage import KeyUsage
from phaseserve.gateway.redis_connections import REDIS_ERRORS, BackgroundTasks, RedisConnections
from phaseserve.gateway.resumes import Resumes
from phaseserve.gateway.scheduler_state import SchedulerState
from phaseserve.gateway.submissions import Submissions
from phaseserve.gateway.token_channel import TokenChannel
from phaseserve.gateway.token_delivery import ERROR_SHUTDOWN, DeliveryConfig, TokenRoutes
from phaseserve.gateway.token_log_reads import TokenLogReads
from phaseserve.live_workers import LiveWorkers
from phaseserve.redis_client import redacted
from phaseserve.wire import GatewayInfo, Keys

log = structlog.get_logger("gateway.backend")


class Backend:
    def __init__(self, redis_url: str, keys: Keys, gateway_id: str, worker_cache_s: float = 0.5,
                 max_connections: int = 64, pool_timeout: float = 30.0, delivery: DeliveryConfig | None = None,
                 wait_replicas: int = 0, wait_timeout_s: float = 0.5):
        self.keys, self.gateway_id = keys, gateway_id
        self.delivery = delivery or DeliveryConfig()
        self.connections = RedisConnections(redis_url, keys.prefix, max_connections, pool_timeout)
        self.redis = self.connections.commands
        self.background = BackgroundTasks()
        self.info = GatewayInfo(gateway_id, os.getpid(), time.time(), self.delivery.lease_ttl_s,
                                self.delivery.resume_grace_s)
        self.routes = TokenRoutes()
        self.channel = TokenChannel(self.connections.subscriber, keys.gateway_channel(gateway_id), self.routes)
        self.token_logs = TokenLogReads(self.redis, self.connections.follower, keys, self.routes, self.delivery)
        self.leases = ClientLeases(self.redis, keys, self.info, self.delivery, self.background,
                                   lambda seq_ids: self.submissions.cancel_logged(seq_ids, "abort"),
                                   watch_replicas=bool(wait_replicas))
        self.submissions = Submissions(self.redis, keys, self.leases, self.background, wait_replicas, wait_timeout_s)
        self.workers = LiveWorkers(self.redis, keys, worker_cache_s)
        self.scheduler = SchedulerState(self.redis, keys)
        self.resumes = Resumes(self.redis, keys)
        self.usage = KeyUsage(self.redis, keys, self.background)
        self.tasks: list[asyncio.Task] = []

    @property
    def subscribed(self) -> asyncio.Event:
        """Set while the token channel is subscribed: without it, requests are answered 503."""
        return self.channel.subscribed

    async def start(self, wait_s: float = 5.0) -> None:
        """Start the loops; waits a little for the subscription, but a Redis that is down only means 503s until
        it is up."""
        self.tasks = [asyncio.create_task(self.channel.run(), name="token-reader"),
                      asyncio.create_task(self.token_logs.sweep(), name="token-sweeper"),
                      asyncio.create_task(self.token_logs.follow(), name="token-follower"),
                      asyncio.create_task(self.leases.refresh(), name="client-leases")]
        try:
            await asyncio.wait_for(self.subscribed.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("not subscribed yet; serving 503 until Redis answers",
                        redis_url=redacted(self.connections.url))

    async def attach(self, seq_ids: list[str]) -> str | None:
        """A resumed client is served here now: its sequences' lease token, or None when a serving still holds
        them (its client is connected: it keeps the stream)."""
        if self.routes.serves_any(seq_ids):
            return None
        return await self.leases.attach(seq_ids)

    def fail_open_requests(self) -> None:
        """The gateway is shutting down: every open request ends now with an error (ERROR_SHUTDOWN) instead
        of being cut off when the server stops waiting for its handler."""
        self.routes.fail_open("the gateway is shutting down; retry the request", ERROR_SHUTDOWN)

    async def close(self) -> None:
        self.leases.end_graces()
        await self.background.wait(timeout=2.0)
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.redis.delete(self.keys.gateway_heartbeat(self.gateway_id))
        except REDIS_ERRORS:
            pass
        await self.connections.close()
