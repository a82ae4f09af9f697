"""Clients behind Sentinel, against a real primary, replica and three sentinels (redis-server on free ports):
an accepted submit is on the replica before the gateway answers (WAIT); a primary demoted under a blocked
read (SENTINEL FAILOVER, the old primary kept as a replica) cuts the read as a connection error, which every
service loop rides out, and the next command reaches the new primary."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from phaseserve.gateway.backend import Backend
from phaseserve.gateway.token_delivery import DeliveryConfig
from phaseserve.params import SamplingParams
from phaseserve.redis_client import connect, connect_async
from phaseserve.redis_topologies import SERVICE, SentinelSet
from phaseserve.wire import Keys, SubmitRequest


@pytest.fixture
def sentinels():
    with SentinelSet() as s:
        yield s


def _replica(sentinels: SentinelSet):
    primary = sentinels.primary()
    return next(n for n in sentinels.nodes if n is not primary)


async def test_an_accepted_submit_is_on_the_replica_when_the_gateway_answers(sentinels):
    keys = Keys("wait")
    backend = Backend(sentinels.url, keys, "gw", wait_replicas=1, wait_timeout_s=5.0,
                      delivery=DeliveryConfig(lease_ttl_s=0.3))
    replica = sentinels.node_client(_replica(sentinels))
    try:
        await backend.start()
        for i in range(20):
            await backend.submissions.submit([SubmitRequest(f"r{i}", "gw", [1, 2, 3], SamplingParams())])
            # read at once from the replica: WAIT returned only once it had the entry
            assert replica.xlen(keys.requests) == i + 1
        assert backend.submissions.replicas_to_wait_for() == 1

        _replica(sentinels).proc.kill()  # the replica is gone: no failover could save anything now
        deadline = time.monotonic() + 10
        while backend.submissions.replicas_to_wait_for() != 0:
            assert time.monotonic() < deadline, "the gateway did not notice the replica leave"
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await backend.submissions.submit([SubmitRequest("alone", "gw", [1, 2, 3], SamplingParams())])
        assert time.monotonic() - t0 < 2.5  # no WAIT for a replica that is not there (its timeout: 5 s)
    finally:
        replica.close()
        await backend.close()


def _failover(sentinels: SentinelSet) -> None:
    """SENTINEL FAILOVER, until the old primary is a replica of the new one. Between the promotion and that
    demotion the old primary still takes writes, which its demotion then discards (docs/redis.md)."""
    old = sentinels.primary()
    client = sentinels.sentinel_client(sentinels.sentinels[0])
    try:
        client.execute_command("SENTINEL", "FAILOVER", SERVICE)
    finally:
        client.close()
    old_client = sentinels.node_client(old)
    deadline = time.monotonic() + 30
    try:
        while sentinels.primary_address() in ((old.host, old.port), None) or old_client.role()[0] != b"slave":
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.05)
    finally:
        old_client.close()


def test_a_blocked_read_on_a_demoted_primary_moves_to_the_new_one(sentinels):
    """The demotion cuts the read (UNBLOCKED); the client takes that for a lost connection, asks the sentinels
    again and reads on from the new primary, where the entry written after the failover is."""
    client = connect(sentinels.url, name="test-relay")
    client.xgroup_create("s", "g", id="$", mkstream=True)
    old = sentinels.primary()
    outcome: list = []

    def blocked_read():
        try:
            outcome.append(client.xreadgroup("g", "c", {"s": ">"}, block=30_000))
        except Exception as e:  # noqa: BLE001 -- what it raises is the point
            outcome.append(e)

    reader = threading.Thread(target=blocked_read)
    reader.start()
    time.sleep(0.3)
    _failover(sentinels)
    new = sentinels.primary()
    assert (new.host, new.port) != (old.host, old.port)
    writer = sentinels.node_client(new)
    writer.xadd("s", {"m": b"after"})
    reader.join(25)
    assert not reader.is_alive()
    # the group came over with the data; a read cut as a connection error is also fine (loops retry it)
    if not isinstance(outcome[0], redis.ConnectionError):
        assert outcome[0] and outcome[0][0][1][0][1] == {b"m": b"after"}, outcome
    client.xadd("s", {"m": b"through the same client"})
    assert writer.xlen("s") == 2
    writer.close()
    client.close()


async def test_an_async_client_follows_a_failover_without_a_restart(sentinels):
    client = connect_async(sentinels.url, max_connections=4, pool_timeout=5.0)
    await client.set("k", "before")
    await asyncio.get_running_loop().run_in_executor(None, _failover, sentinels)
    deadline = time.monotonic() + 10
    while True:
        try:
            await client.set("k", "after")
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    assert sentinels.node_client(sentinels.primary()).get("k") == b"after"
    await client.aclose()
