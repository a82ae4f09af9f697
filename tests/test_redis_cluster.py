"""Clients on a Redis Cluster (three primaries from redis-server, on free ports): a stack's client talks to the
node owning its slot, with the commands redis-py's cluster pipelines refuse (PUBLISH, MGET, a script) in one
pipeline; and when the slot moves to another node (what a resharding or a shard's failover does), a MOVED
reply sends the next command to the new owner, with nothing restarted."""

from __future__ import annotations

import asyncio

import pytest

from phaseserve.redis_client import connect, connect_async
from phaseserve.redis_topologies import ClusterSet

PREFIX = "{ps}"


@pytest.fixture(scope="module")
def cluster():
    with ClusterSet(primaries=3) as c:
        yield c


def _owner(cluster: ClusterSet, key: str) -> int:
    c = cluster.client(cluster.nodes[0])
    try:
        slot = c.execute_command("CLUSTER", "KEYSLOT", key)
        for index, node in enumerate(cluster.nodes):
            for start, end, (host, port, *_rest), *_replicas in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end and port == node.port:
                    return index
    finally:
        c.close()
    raise AssertionError("no owner")


def _move_slot(cluster: ClusterSet, key: str, to: int) -> None:
    """CLUSTER SETSLOT IMPORTING / MIGRATING, MIGRATE of the slot's keys, SETSLOT NODE on every node."""
    source, target = cluster.nodes[_owner(cluster, key)], cluster.nodes[to]
    src, dst = cluster.client(source), cluster.client(target)
    try:
        slot = src.execute_command("CLUSTER", "KEYSLOT", key)
        src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "AUTH", cluster.password,
                                "KEYS", *keys)
        for node in cluster.nodes:
            c = cluster.client(node)
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            c.close()
    finally:
        src.close()
        dst.close()


def test_a_stack_pipeline_runs_on_its_slots_node_and_follows_the_slot_when_it_moves(cluster):
    client = connect(cluster.url, key_prefix=PREFIX)
    pipe = client.pipeline(transaction=False)
    pipe.set(f"{PREFIX}:a", 1)
    pipe.publish(f"{PREFIX}:gw:g", b"tokens")  # refused by RedisCluster's pipelines
    pipe.mget([f"{PREFIX}:a", f"{PREFIX}:b"])
    pipe.eval("return redis.call('GET', KEYS[1])", 1, f"{PREFIX}:a")
    assert pipe.execute() == [True, 0, [b"1", None], b"1"]
    before = _owner(cluster, PREFIX)
    _move_slot(cluster, PREFIX, (before + 1) % len(cluster.nodes))
    assert _owner(cluster, PREFIX) != before
    # the pooled connection still points at the old owner: its MOVED reply sends the retry to the new one
    assert client.get(f"{PREFIX}:a") == b"1"
    client.set(f"{PREFIX}:b", 2)
    new = cluster.client(cluster.nodes[_owner(cluster, PREFIX)])
    assert new.get(f"{PREFIX}:b") == b"2"
    new.close()
    client.close()


async def test_an_async_client_follows_its_slot(cluster):
    prefix = "{other}"
    client = connect_async(cluster.url, key_prefix=prefix, max_connections=2, pool_timeout=5.0)
    await client.set(f"{prefix}:k", "v")
    before = _owner(cluster, prefix)
    await asyncio.get_running_loop().run_in_executor(
        None, _move_slot, cluster, prefix, (before + 1) % len(cluster.nodes))
    assert await client.get(f"{prefix}:k") == b"v"
    await client.aclose()
