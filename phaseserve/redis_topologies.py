"""Redis as people run it beyond one process, on this machine, for the tests and benchmarks: a primary with a
replica watched by three sentinels (`SentinelSet`), and a Redis Cluster of three primaries (`ClusterSet`).
Every process is an EmbeddedRedis (phaseserve/redis_server.py): the redis-server binary the tests already
use, on free loopback ports, with generated passwords.
"""

from __future__ import annotations

import secrets
import socket
import time
from urllib.parse import quote

import redis

from phaseserve.redis_server import EmbeddedRedis, RedisServerError, free_port

SERVICE = "mymaster"


class SentinelSet:
    """A primary, `replicas` replicas and `sentinels` sentinels (quorum: a majority of them).

    Short `down_after_ms` / `failover_timeout_ms` make a failover take seconds, as the tests want; a
    production set keeps Redis's defaults or its operator's. `kill_primary()` is the fault: kill -9 of the
    primary's process, then wait until the sentinels name another."""

    def __init__(self, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000, cpus: list[int] | None = None):
        self.password = secrets.token_urlsafe(24)  # the data nodes'
        self.sentinel_password = secrets.token_urlsafe(24)
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.cpus = cpus
        self.num_replicas, self.num_sentinels = replicas, sentinels
        self.nodes: list[EmbeddedRedis] = []
        self.sentinels: list[EmbeddedRedis] = []

    def _data_node(self, replica_of: EmbeddedRedis | None) -> EmbeddedRedis:
        extra = [f"masterauth {self.password}"]
        if replica_of is not None:
            extra.append(f"replicaof {replica_of.host} {replica_of.port}")
        return EmbeddedRedis(requirepass=self.password, extra_config=extra, admin_commands=True, cpus=self.cpus)

    def start(self) -> "SentinelSet":
        try:
            primary = self._data_node(None).start()
            self.nodes = [primary]
            for _ in range(self.num_replicas):
                self.nodes.append(self._data_node(primary).start())
            self.wait_replicated(primary, self.num_replicas, 10.0)
            quorum = self.num_sentinels // 2 + 1
            for _ in range(self.num_sentinels):
                self.sentinels.append(EmbeddedRedis(requirepass=self.sentinel_password, sentinel=True, cpus=self.cpus,
                                                    extra_config=[
                    f"sentinel monitor {SERVICE} {primary.host} {primary.port} {quorum}",
                    f"sentinel auth-pass {SERVICE} {self.password}",
                    f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    # sentinels find each other through the primary's hello channel, and must AUTH to each other
                    f"sentinel sentinel-pass {self.sentinel_password}",
                ]).start())
            self.wait_sentinels_agree(10.0)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return (f"redis+sentinel://:{quote(self.password, safe='')}@{hosts}/{SERVICE}/0"
                f"?sentinel_password={quote(self.sentinel_password, safe='')}")

    def sentinel_client(self, sentinel: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host=sentinel.host, port=sentinel.port, password=self.sentinel_password,
                           socket_timeout=1.0, socket_connect_timeout=1.0)

    def primary_address(self) -> tuple[str, int] | None:
        """The primary the first answering sentinel names."""
        for s in self.sentinels:
            client = self.sentinel_client(s)
            try:
                host, port = client.sentinel_get_master_addr_by_name(SERVICE)
                return host.decode() if isinstance(host, bytes) else host, int(port)
            except (redis.RedisError, TypeError):
                continue
            finally:
                client.close()
        return None

    def primary(self) -> EmbeddedRedis:
        address = self.primary_address()
        return next(n for n in self.nodes if (n.host, n.port) == address)

    def node_client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host=node.host, port=node.port, password=self.password, socket_timeout=2.0)

    def wait_replicated(self, primary: EmbeddedRedis, replicas: int, timeout: float) -> None:
        client = self.node_client(primary)
        deadline = time.monotonic() + timeout
        try:
            while client.info("replication").get("connected_slaves", 0) < replicas:
                if time.monotonic() > deadline:
                    raise RedisServerError(f"{replicas} replica(s) did not connect within {timeout} s")
                time.sleep(0.05)
        finally:
            client.close()

    def wait_sentinels_agree(self, timeout: float) -> None:
        """Until every sentinel knows the others and the replicas (a failover needs them)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = 0
            for s in self.sentinels:
                client = self.sentinel_client(s)
                try:
                    info = client.sentinel_master(SERVICE)
                    if info.get("num-other-sentinels", 0) >= self.num_sentinels - 1 \
                            and info.get("num-slaves", 0) >= self.num_replicas:
                        ready += 1
                except redis.RedisError:
                    pass
                finally:
                    client.close()
            if ready == len(self.sentinels):
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the sentinels did not find each other and the replicas within {timeout} s")
            time.sleep(0.1)

    def kill_primary(self, timeout: float = 30.0) -> tuple[EmbeddedRedis, float]:
        """kill -9 the primary; -> the new primary and the seconds until the sentinels named it."""
        old = self.primary()
        t0 = time.monotonic()
        old.proc.kill()
        old.proc.wait(5)
        while True:
            address = self.primary_address()
            if address is not None and address != (old.host, old.port):
                return next(n for n in self.nodes if (n.host, n.port) == address), time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise RedisServerError(f"no failover within {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in [*self.sentinels, *self.nodes]:
            p.stop()
        self.sentinels, self.nodes = [], []

    def __enter__(self) -> "SentinelSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + this, for the other nodes


def cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (+10000, at most 65535) is free too."""
    for _ in range(200):
        port = free_port(host)
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RedisServerError("no free port pair for a cluster node")


class ClusterSet:
    """A Redis Cluster of `primaries` primaries (no replicas), slots split evenly, joined by hand (CLUSTER
    MEET, ADDSLOTS): no redis-cli needed."""

    SLOTS = 16384

    def __init__(self, primaries: int = 3, cpus: list[int] | None = None):
        self.password = secrets.token_urlsafe(24)
        self.num_primaries = primaries
        self.cpus = cpus
        self.nodes: list[EmbeddedRedis] = []

    def start(self, timeout: float = 20.0) -> "ClusterSet":
        try:
            for _ in range(self.num_primaries):
                node = EmbeddedRedis(port=cluster_port(), requirepass=self.password, admin_commands=True,
                                     cpus=self.cpus)
                node.extra_config = ["cluster-enabled yes", "cluster-node-timeout 2000", f"masterauth {self.password}",
                                     "cluster-config-file nodes.conf"]
                self.nodes.append(node.start())
            clients = [self.client(n) for n in self.nodes]
            per = self.SLOTS // len(self.nodes)
            for i, c in enumerate(clients):
                last = self.SLOTS - 1 if i == len(clients) - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, last + 1))  # ADDSLOTSRANGE: Redis 7+
            for n in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", n.host, n.port)
            deadline = time.monotonic() + timeout
            while not all(c.execute_command("CLUSTER", "INFO").decode().startswith("cluster_state:ok")
                          for c in clients):
                if time.monotonic() > deadline:
                    raise RedisServerError(f"the cluster did not reach state ok within {timeout} s")
                time.sleep(0.1)
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host=node.host, port=node.port, password=self.password, socket_timeout=2.0)

    @property
    def url(self) -> str:
        hosts = ",".join(f"{n.host}:{n.port}" for n in self.nodes)
        return f"redis+cluster://:{quote(self.password, safe='')}@{hosts}"

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        self.nodes = []

    def __enter__(self) -> "ClusterSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
