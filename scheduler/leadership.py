"""Leadership of the scheduler: one active scheduler at a time, and what it recovers when it takes over.

- One active scheduler: it holds a lease (`Keys.scheduler_lease`, SET NX PX, renewed by a check-and-renew
  script in every turn's pipeline). A second scheduler waits as a standby and takes over when the lease
  lapses, with a new epoch (`Keys.scheduler_epoch`) that goes into every StepPlan; workers drop plans of
  an older epoch, and the first plan to each adopted worker resets it.
- Nothing submitted vanishes: at takeover the scheduler re-admits every request record (prompt + the
  confirmed outputs stored in the record), then claims the pending entries of every earlier consumer
  (XAUTOCLAIM) and its own (XREADGROUP 0); duplicates are dropped by request id (submits) and by epoch,
  step id and offset (results).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from phaseserve import token_log
from phaseserve.wire import OUTPUT_FIELD_PREFIX, Keys, SubmitRequest, WireError
from phaseserve.scheduler.cluster import Cluster
from phaseserve.scheduler.quarantine import STRIKES_FIELD
from phaseserve.scheduler.redis_writes import DeadLetter

log = structlog.get_logger("scheduler.leadership")

READ_COUNT = 512  # stream entries per read

# Renew the lease only if we hold it, or take it back if it vanished (a Redis restart without persistence)
# and nobody else took it meanwhile; the epoch key comes back with it. 1: ours, 0: someone else's.
RENEW_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'NX')
  return 1
end
return 0
"""
# A new epoch: one more than the last, and at least the wall clock in ms, so it still grows if Redis
# lost the key (workers remember the newest epoch they saw and drop older plans).
NEXT_EPOCH = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = math.max(last + 1, tonumber(ARGV[1]))
redis.call('SET', KEYS[1], epoch)
return epoch
"""
RELEASE_LEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class LeaseLost(Exception):
    """Another scheduler holds the lease now: this one stops planning and waits as a standby."""


class Leadership:
    """The lease and the epoch of one scheduler (`consumer`)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, lease_ttl: float):
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.lease_ttl_ms = max(100, int(lease_ttl * 1000))
        self.epoch = 0  # ours, from the epoch key when we took the lease
        self.is_leader = False
        self.renew_at = 0.0

    async def acquire(self, stopping: asyncio.Event) -> None:
        """Wait (a standby) until the lease is ours, then take a new epoch."""
        waiting_logged = False
        while not stopping.is_set():
            if await self.client.set(self.keys.scheduler_lease(), self.consumer, nx=True, px=self.lease_ttl_ms):
                break
            # a standby is alive too (its probe reads this): it looks a few times per lease
            await self.client.set(self.keys.scheduler_seen(self.consumer), 0, px=max(3000, self.lease_ttl_ms))
            if not waiting_logged:
                holder = await self.client.get(self.keys.scheduler_lease())
                log.info("standby: another scheduler holds the lease", holder=holder.decode() if holder else None)
                waiting_logged = True
            try:  # poll a few times per lease: a takeover comes within about one lease time
                await asyncio.wait_for(stopping.wait(), self.lease_ttl_ms / 4000)
            except asyncio.TimeoutError:
                pass
        if stopping.is_set():
            return
        self.epoch = int(await self.client.eval(NEXT_EPOCH, 1, self.keys.scheduler_epoch(), int(time.time() * 1000)))
        self.is_leader = True
        log.info("lease taken: this scheduler is the active one", consumer=self.consumer, epoch=self.epoch)

    def renew(self, pipe, now: float) -> bool:
        """Queue the check-and-renew when a quarter of the lease has passed since the last (not every
        turn: a turn can be a few milliseconds); True if queued (its reply comes first)."""
        if now < self.renew_at:
            return False
        self.renew_at = now + self.lease_ttl_ms / 4000
        pipe.eval(RENEW_LEASE, 2, self.keys.scheduler_lease(), self.keys.scheduler_epoch(), self.consumer,
                  self.lease_ttl_ms, self.epoch)
        return True

    async def release(self) -> None:
        """On a clean stop: a standby need not wait for the lease to lapse."""
        if self.is_leader:
            self.is_leader = False
            await self.client.eval(RELEASE_LEASE, 1, self.keys.scheduler_lease(), self.consumer)


async def create_groups(client: aioredis.Redis, keys: Keys) -> None:
    for stream in (keys.requests, keys.results):
        try:
            # id 0: requests a gateway queued before the scheduler started are served too
            await client.xgroup_create(stream, keys.scheduler_group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


async def recover_records(client: aioredis.Redis, keys: Keys, cluster: Cluster) -> None:
    """Requests a previous scheduler accepted but did not finish: re-admit them with their confirmed
    outputs (recompute), so each continues where its client is."""
    found = 0
    async for key in client.scan_iter(match=keys.request_record("*"), count=500):
        try:
            record = await client.hgetall(key)
        except ResponseError:  # not a record (WRONGTYPE): another key under the same pattern
            continue
        data = record.get(b"submit")
        if data is None:
            continue
        try:
            req = SubmitRequest.from_wire(data)
        except (WireError, KeyError, TypeError, ValueError) as e:
            log.warning("dropping unreadable request record", key=key, error=str(e))
            cluster.ops.append(DeadLetter("record", data, key, f"unreadable record: {e}"))
            await client.delete(key)
            continue
        if cluster.is_known(req.request_id):
            continue
        outputs = recorded = confirmed_outputs(record)
        tokens, finished = await logged_outputs(client, keys, req.request_id)
        if finished:  # its client saw the end: nothing left to do
            await client.delete(key)
            continue
        if len(tokens) > len(outputs) or tokens != outputs[:len(tokens)]:
            outputs = tokens  # what its client has (the log's first writer wins, as the client's does)
        if len(outputs) >= req.params.max_tokens:  # its last token was confirmed: nothing left to do
            await client.delete(key)
            continue
        cluster.parked.append((req, outputs))
        strikes = record.get(STRIKES_FIELD.encode(), b"0")
        cluster.quarantine.restore(req.request_id, int(strikes) if strikes.isdigit() else 0)
        # what the record holds of them (none, if the log disagreed: the next write rewrites from 0)
        cluster.outputs_written[req.request_id] = len(recorded) if outputs[:len(recorded)] == recorded else 0
        found += 1
    if found:
        log.info("recovered requests", count=found)
        cluster.place_parked()


async def logged_outputs(client: aioredis.Redis, keys: Keys, request_id: str) -> tuple[list[int], bool]:
    """A sequence's tokens in the relay's durable token log, contiguous from offset 0, and whether it
    ended. It can be ahead of the record's confirmed outputs (a result the scheduler had not handled
    yet), and it is what the client has."""
    return token_log.replay(await client.xrange(keys.token_log(request_id)))


async def claim_pending(client: aioredis.Redis, keys: Keys, consumer: str, handle: Callable,
                        min_idle_ms: int = 0) -> None:
    """Entries read but never acknowledged: at takeover (min idle 0) every earlier consumer's, such as a
    submit a dead scheduler read but had not recorded, and our own earlier life's; then now and again
    those idle longer than two leases (a deposed scheduler's last read, made in the same round trip as
    the renewal that told it it was deposed). Handled (`handle`) like new ones: a submit already known is
    dropped by request id, an old result by epoch and step id."""
    claimed = 0
    for stream in (keys.requests, keys.results):
        if min_idle_ms == 0:  # our own consumer's pending entries (a restart under the same name)
            resp = await client.xreadgroup(keys.scheduler_group, consumer, {stream: "0"}, count=READ_COUNT)
            handle(resp)
            claimed += sum(len(e) for _s, e in (resp.items() if isinstance(resp, dict) else resp or ()))
        start = "0-0"
        while True:
            reply = await client.xautoclaim(stream, keys.scheduler_group, consumer, min_idle_ms,
                                            start_id=start, count=READ_COUNT)
            start, entries = reply[0], reply[1]
            if entries:
                handle([(stream, entries)])
                claimed += len(entries)
            if not entries or start in (b"0-0", "0-0"):
                break
    if claimed:
        log.info("claimed pending entries", count=claimed, min_idle_ms=min_idle_ms)


def confirmed_outputs(record: dict) -> list[int]:
    """A request record's confirmed output tokens, in offset order, up to the first gap."""
    by_offset = {}
    for name, value in record.items():
        name = name.decode() if isinstance(name, bytes) else name
        if name.startswith(OUTPUT_FIELD_PREFIX) and name[len(OUTPUT_FIELD_PREFIX):].isdigit():
            by_offset[int(name[len(OUTPUT_FIELD_PREFIX):])] = int(value)
    outputs = []
    while len(outputs) in by_offset:
        outputs.append(by_offset[len(outputs)])
    return outputs
