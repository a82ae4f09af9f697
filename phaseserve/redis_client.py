"""Redis clients that ride out a Redis restart: commands retried with exponential backoff on connection
errors (redis-py's `Retry`), and one `backoff` for service loops that wait for Redis to come back.

A command still failing after the retries raises ConnectionError / TimeoutError; each service's loop
catches those, waits (`Backoff`) and resumes, so an outage of any length stops work, never a process.
"""

from __future__ import annotations

import random
import time
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# retried inside one command: short outages (a failover, a restart of a second or two) pass unnoticed
COMMAND_RETRIES = 3
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)


def redacted(url: str | None) -> str | None:
    """A Redis URL fit for a log line or a banner: its password replaced by ***."""
    parts = urlsplit(url) if url else None
    if parts is None or parts.password is None:
        return url
    host = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=host))


def _kwargs(retry, name: str | None) -> dict:
    kw = dict(retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError],
              socket_connect_timeout=2.0, health_check_interval=10)
    if name:
        kw["client_name"] = name  # CLIENT LIST shows who is who (and bench.faults finds a consumer by it)
    return kw


def connect(url: str, name: str | None = None) -> redis.Redis:
    """A blocking client that retries a command on connection errors."""
    retry = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), COMMAND_RETRIES)
    return redis.Redis.from_url(url, **_kwargs(retry, name))


def connect_async(url: str, name: str | None = None) -> aioredis.Redis:
    """An asyncio client that retries a command on connection errors."""
    retry = AsyncRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), COMMAND_RETRIES)
    return aioredis.Redis.from_url(url, **_kwargs(retry, name))


def blocking_pool_async(url: str, max_connections: int, timeout: float, **connection_kwargs) -> aioredis.BlockingConnectionPool:
    """A bounded asyncio pool whose connections retry a command on connection errors: after a Redis restart
    every pooled connection is dead, and its next command reconnects instead of failing once."""
    retry = AsyncRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), COMMAND_RETRIES)
    return aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError], **connection_kwargs)


class Backoff:
    """Waits that double from `base` to `cap` (with jitter) while Redis stays away; `reset()` once it is back."""

    def __init__(self, base: float = 0.1, cap: float = 2.0):
        self.base, self.cap = base, cap
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** (self.failures - 1))
        return delay * (0.5 + random.random() / 2)

    def reset(self) -> None:
        self.failures = 0


def execute_through_outages(pipe: redis.client.Pipeline, on_retry=None) -> list:
    """Send a (blocking) pipeline, waiting out a Redis outage of any length, and return its replies (errors
    as values). execute() empties the pipeline even when it fails, so the commands are kept and queued again
    before each retry: the caller's writes must be safe to apply twice (the first attempt may have reached
    Redis before the connection broke)."""
    commands = list(pipe.command_stack)
    backoff = Backoff()
    while True:
        try:
            return pipe.execute(raise_on_error=False)
        except CONNECTION_ERRORS as e:
            if on_retry is not None:
                on_retry(e)
            time.sleep(backoff.next_delay())
            pipe.command_stack = list(commands)

