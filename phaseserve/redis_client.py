"""Every Redis client of the stack is made here: one server, a Sentinel-watched primary, or the primary
that owns a stack's slot in a Redis Cluster, all from one --redis-url (phaseserve/redis_url.py; docs/redis.md).

Commands are retried with exponential backoff on connection errors (redis-py's `Retry`), and `Backoff` is
for the service loops that wait for Redis to come back. A command still failing after the retries raises
ConnectionError / TimeoutError; each service's loop catches those, waits and resumes, so an outage of any
length (a restart, a failover) stops work, never a process.

Sentinel: redis-py's Sentinel pool asks the sentinels for the primary's address on every connect, and
after a connection error a retry asks again (`PrimaryConnection`), so commands reach the new primary as
soon as the sentinels name it. Cluster: a stack's keys all hash to one slot (redis_url.key_prefix_for), so a stack
talks to one node, the primary owning that slot. The same pool finds it, with redis-py's RedisCluster
asked for the slot's owner instead of a sentinel for the primary. A reply saying the server is no
longer the primary (READONLY, MOVED, a blocked read cut by a demotion) drops the connection, as a
connection error that every service's loop already rides out. The commands then go over an ordinary
client: RedisCluster's own pipelines refuse PUBLISH, MGET and EVALSHA and split a pipeline per node,
and the services' one-round-trip pipelines rely on those (docs/redis.md, "Redis Cluster").
"""

from __future__ import annotations

import asyncio
import random
import time

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import MovedError
from redis.retry import Retry

from phaseserve.redis_url import RedisTarget, parse, redacted  # noqa: F401 -- redacted: re-exported

# retried inside one command: short outages (a restart of a second or two) pass unnoticed
COMMAND_RETRIES = 3
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
CONNECT_TIMEOUT_S = 2.0
# a sentinel or seed node that does not answer in this long is passed over for the next one
DISCOVERY_TIMEOUT_S = 1.0


def _kwargs(name: str | None, **overrides) -> dict:
    kw = dict(retry_on_error=[redis.ConnectionError, redis.TimeoutError], socket_connect_timeout=CONNECT_TIMEOUT_S,
              health_check_interval=10)
    if name:
        kw["client_name"] = name  # CLIENT LIST shows who is who (and bench.faults finds a consumer by it)
    kw.update(overrides)
    return kw


def _node_auth(target: RedisTarget) -> dict:
    return dict(username=target.username, password=target.password)


def _sentinel_kwargs(target: RedisTarget) -> dict:
    return dict(username=target.sentinel_username, password=target.sentinel_password,
                socket_connect_timeout=DISCOVERY_TIMEOUT_S, socket_timeout=DISCOVERY_TIMEOUT_S)


# ------------------------------------------------------------------ a cluster slot's owner, found like a primary

class SlotOwner:
    """Finds the primary that owns one key's slot, for redis-py's Sentinel pool (which asks its manager
    `discover_master(name)` on every connect): `name` is the key (the stack's hash tag)."""

    def __init__(self, target: RedisTarget):
        self.target = target

    def discover_master(self, key: str) -> tuple[str, int]:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in self.target.nodes]
        cluster = redis.cluster.RedisCluster(startup_nodes=nodes, socket_connect_timeout=DISCOVERY_TIMEOUT_S,
                                             socket_timeout=DISCOVERY_TIMEOUT_S, **_node_auth(self.target))
        try:
            node = cluster.get_node_from_key(key)
            return node.host, node.port
        except redis.RedisError as e:
            raise redis.sentinel.MasterNotFoundError(f"no cluster node owns {key!r}'s slot: {e}") from e
        finally:
            cluster.close()


class AsyncSlotOwner(SlotOwner):
    async def discover_master(self, key: str) -> tuple[str, int]:
        nodes = [aiocluster.ClusterNode(h, p) for h, p in self.target.nodes]
        cluster = aiocluster.RedisCluster(startup_nodes=nodes, socket_connect_timeout=DISCOVERY_TIMEOUT_S,
                                          socket_timeout=DISCOVERY_TIMEOUT_S, **_node_auth(self.target))
        try:
            await cluster.initialize()
            node = cluster.get_node_from_key(key)
            return node.host, node.port
        except redis.RedisError as e:
            raise aiosentinel.MasterNotFoundError(f"no cluster node owns {key!r}'s slot: {e}") from e
        finally:
            await cluster.aclose()


def _primary_moved(e: redis.ResponseError) -> bool:
    """A reply saying this server stopped being the primary under the connection: MOVED (a cluster slot moved,
    or its primary failed over), or a blocked read cut when the server became a replica."""
    return isinstance(e, MovedError) or (str(e).startswith("UNBLOCKED") and "state changed" in str(e))


class PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary the pool's manager names (redis-py's handles READONLY): a reply that says
    the primary moved drops it too, as a connection error every service loop already rides out. After any
    connection error the next connect asks the manager again: redis-py's retries inside one command
    reconnect through connect_check_health, to the address the connection had, not through the Sentinel
    connection's connect(), which asks."""

    stale = False  # the address may be the old primary's: ask again before connecting

    def connect_check_health(self, *args, **kwargs):
        if self._sock is None and self.stale:
            self.stale = False
            self.host, self.port = self.connection_pool.get_master_address()
        try:
            return super().connect_check_health(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError):
            self.stale = True
            raise

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError):
            self.stale = True
            raise
        except redis.ResponseError as e:
            if not _primary_moved(e):
                raise
            self.stale = True
            self.disconnect()
            raise redis.ConnectionError(f"the primary moved: {e}") from e


class AsyncPrimaryConnection(aiosentinel.SentinelManagedConnection):
    stale = False

    async def connect_check_health(self, *args, **kwargs):
        if not self.is_connected and self.stale:
            self.stale = False
            self.host, self.port = await self.connection_pool.get_master_address()
        try:
            return await super().connect_check_health(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError):
            self.stale = True
            raise

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError):
            self.stale = True
            raise
        except redis.ResponseError as e:
            if not _primary_moved(e):
                raise
            self.stale = True
            await self.disconnect()
            raise redis.ConnectionError(f"the primary moved: {e}") from e


class BoundedSentinelPool(aiosentinel.SentinelConnectionPool):
    """redis-py's Sentinel pool, bounded as its BlockingConnectionPool is: a command waits up to `timeout`
    for one of `max_connections` instead of failing with 'Too many connections'."""

    def __init__(self, service_name, sentinel_manager, *, timeout: float, **kwargs):
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.timeout = timeout
        self._slots = asyncio.Semaphore(self.max_connections)

    async def get_connection(self, *_args, **_kwargs):
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise redis.ConnectionError("No connection available.") from None
        try:
            return await super().get_connection()
        except BaseException:
            self._slots.release()
            raise

    async def release(self, connection) -> None:
        try:
            await super().release(connection)
        finally:
            self._slots.release()


# ------------------------------------------------------------------ the clients

def _slot_key(key_prefix: str | None) -> str:
    """A key in the stack's slot: its prefix, which holds the hash tag (redis_url.key_prefix_for)."""
    if key_prefix is None:
        raise ValueError("a cluster client needs the stack's key prefix: it finds the node owning its slot")
    return key_prefix


def connect(url: str, name: str | None = None, key_prefix: str | None = None, **overrides) -> redis.Redis:
    """A blocking client that retries a command on connection errors, to the primary the URL names."""
    target = parse(url)
    kw = _kwargs(name, retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), COMMAND_RETRIES),
                 **overrides)
    if target.kind == "single":
        return redis.Redis.from_url(url, **kw)
    if target.kind == "sentinel":
        sentinel = redis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_kwargs(target))
        return sentinel.master_for(target.service, db=target.db, connection_class=PrimaryConnection,
                                   **_node_auth(target), **kw)
    pool = redis.sentinel.SentinelConnectionPool(_slot_key(key_prefix), SlotOwner(target),
                                                 connection_class=PrimaryConnection, **_node_auth(target), **kw)
    return redis.Redis(connection_pool=pool)


def connect_async(url: str, name: str | None = None, key_prefix: str | None = None, *, max_connections: int | None = None,
                  pool_timeout: float | None = None, retries: int = COMMAND_RETRIES, **overrides) -> aioredis.Redis:
    """An asyncio client that retries a command on connection errors, to the primary the URL names. With
    `max_connections`, its pool is bounded: a command waits up to `pool_timeout` for a free connection.
    After a restart or a failover every pooled connection is dead, and its next command reconnects (to
    the new primary) instead of failing once."""
    target = parse(url)
    kw = _kwargs(name, retry=AsyncRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries),
                 **overrides)
    bounded = max_connections is not None
    if target.kind == "single":
        if bounded:
            return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=pool_timeout, **kw))
        return aioredis.Redis.from_url(url, **kw)
    pool_class = BoundedSentinelPool if bounded else aiosentinel.SentinelConnectionPool
    if bounded:
        kw.update(max_connections=max_connections, timeout=pool_timeout)
    if target.kind == "sentinel":
        sentinel = aiosentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_kwargs(target))
        return sentinel.master_for(target.service, connection_pool_class=pool_class, db=target.db,
                                   connection_class=AsyncPrimaryConnection, **_node_auth(target), **kw)
    pool = pool_class(_slot_key(key_prefix), AsyncSlotOwner(target), connection_class=AsyncPrimaryConnection,
                      **_node_auth(target), **kw)
    return aioredis.Redis(connection_pool=pool)


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

