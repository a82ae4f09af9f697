"""The live stack bench/faults.py injects its faults into: each service its own process with its log, Redis
(with AOF, or a primary with a replica and sentinels), and the faults themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from phaseserve.procs import stop_process
from phaseserve.redis_client import connect
from phaseserve.redis_server import find_redis_server, free_port
from phaseserve.redis_topologies import SentinelSet
from phaseserve.wire import Keys

ROOT = Path(__file__).resolve().parent.parent
LEASE_TTL_S = 2.0
FREEZE_S = 30.0  # the default --step-timeout: a frozen model must be found long before it
CLIENT_LEASE_TTL_S = 1.0


class Service:
    """One service process, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name, self.argv = name, argv
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        stop_process(self.proc, 15)


class Stack:
    def __init__(self, model: str, dtype: str, log_dir: Path, standby: bool, second_gateway: bool = False,
                 sentinel: bool = False):
        self.model, self.dtype, self.log_dir = model, dtype, log_dir
        self.redis_port, self.port = free_port(), free_port()
        self.second_port = free_port() if second_gateway else None
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.keys = Keys("ps")
        self.redis_dir = tempfile.mkdtemp(prefix="faults-redis-", dir=log_dir)
        self.services: dict[str, Service] = {}
        self.standby = standby
        # a primary, a replica and three sentinels instead of one redis-server (the redis-failover fault)
        self.sentinels = SentinelSet() if sentinel else None
        self.client: redis.Redis | None = None

    def redis_service(self) -> Service:
        return Service("redis", [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.redis_port),
                                 "--dir", self.redis_dir, "--save", "", "--appendonly", "yes",
                                 "--appendfsync", "always", "--protected-mode", "no"], self.log_dir)

    def scheduler(self, name: str) -> Service:
        return Service(name, [sys.executable, "-m", "phaseserve.scheduler", "--redis-url", self.redis_url,
                              "--heartbeat-interval", "0.2", "--scheduler-lease-ttl", str(LEASE_TTL_S)],
                       self.log_dir)

    def worker(self, name: str) -> Service:
        return Service(name, [sys.executable, "-m", "phaseserve.workers", "--model", self.model, "--redis-url", self.redis_url,
                              "--worker-id", name, "--dtype", self.dtype, "--num-threads", "1",
                              "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0",
                              "--kv-cache-memory", "128MiB"], self.log_dir)

    def start(self) -> None:
        if self.sentinels is not None:
            self.redis_url = self.sentinels.start().url
        else:
            self.services["redis"] = self.redis_service().start()
        self.client = connect(self.redis_url)
        self.wait(lambda: self._ping(), 10, "redis")
        self.services["s1"] = self.scheduler("s1").start()
        if self.standby:
            self.services["s2"] = self.scheduler("s2").start()
        for w in ("w1", "w2"):
            self.services[w] = self.worker(w).start()
        for name, port in (("gw", self.port), ("gw2", self.second_port)):
            if port is not None:
                # a short client lease: a resume after a gateway's kill -9 waits for its leases to lapse
                self.services[name] = Service(name, [sys.executable, "-m", "phaseserve.gateway", "--model", self.model,
                                                     "--redis-url", self.redis_url, "--port", str(port),
                                                     "--client-lease-ttl", str(CLIENT_LEASE_TTL_S)],
                                              self.log_dir).start()
        self.wait(lambda: self._stats().get("num_workers") == 2 and self._health(self.port)
                  and (self.second_port is None or self._health(self.second_port)), 120, "the stack")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def _stats(self) -> dict:
        import msgpack
        try:
            data = self.client.get(self.keys.scheduler_stats())
        except redis.RedisError:
            return {}
        return msgpack.unpackb(data) if data else {}

    def _health(self, port: int) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up in {timeout:.0f} s (logs: {self.log_dir})")
            time.sleep(0.1)

    def stop(self) -> None:
        for s in reversed(list(self.services.values())):
            s.stop()
        if self.sentinels is not None:
            self.sentinels.stop()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------ faults

    def active_scheduler(self) -> Service:
        holder = (self.client.get(self.keys.scheduler_lease()) or b"").decode()
        return next(s for name, s in self.services.items() if name.startswith("s") and s.proc
                    and holder.endswith(f"-{s.proc.pid}"))

    def unread_entry(self, stream: str, group: str) -> bytes | None:
        last = next((g["last-delivered-id"] for g in self.client.xinfo_groups(stream)
                     if g["name"].decode() == group), b"0-0")
        unread = self.client.xrange(stream, min=f"({last.decode()}", count=1)
        return unread[0][0] if unread else None

    def delete_a_plan(self, worker: str) -> bool:
        """Delete a plan before the worker's relay reads it: its blocked read is cut (its connection
        killed), and the next plan the scheduler sends while it reconnects is deleted."""
        stream, name = self.keys.steps(worker), f"{self.keys.prefix}:relay:{worker}"
        for _attempt in range(50):
            for c in self.client.client_list():
                if c.get("name") == name and c.get("cmd") == "xreadgroup":
                    self.client.client_kill_filter(_id=c["id"])
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                entry = self.unread_entry(stream, self.keys.worker_group)
                if entry is not None and self.client.xdel(stream, entry):
                    return True
                time.sleep(0.002)
        return False

    def delete_a_result(self) -> bool:
        """Delete a result before the scheduler reads it: the scheduler is paused (SIGSTOP) while the
        workers finish their plans in flight, one result it has not read is deleted, then it resumes."""
        sched = self.active_scheduler()
        sched.signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                entry = self.unread_entry(self.keys.results, self.keys.scheduler_group)
                if entry is not None and self.client.xdel(self.keys.results, entry):
                    return True
                time.sleep(0.005)
            return False
        finally:
            sched.signal(signal.SIGCONT)

    async def inject(self, fault: str) -> None:
        loop = asyncio.get_running_loop()
        if fault == "worker-kill":
            self.services["w1"].kill9()
        elif fault in ("scheduler-restart", "scheduler-standby"):
            active = self.active_scheduler()
            active.kill9()
            if fault == "scheduler-restart":
                self.services["s3"] = self.scheduler("s3").start()
        elif fault == "redis-restart":
            self.services["redis"].kill9()
            await asyncio.sleep(5.0)
            self.services["redis"] = self.redis_service().start()
        elif fault == "redis-failover":
            await loop.run_in_executor(None, self.sentinels.kill_primary)
        elif fault == "worker-freeze":
            self.services["w1"].signal(signal.SIGSTOP)
            await asyncio.sleep(FREEZE_S)
            self.services["w1"].signal(signal.SIGCONT)
        elif fault == "lost-messages":
            plan = await loop.run_in_executor(None, self.delete_a_plan, "w1")
            # apart: two losses in a row on one worker leave no later result to reveal the first, and only
            # the step deadline finds it (tests/test_reliability.py has that case)
            await asyncio.sleep(0.3)
            result = await loop.run_in_executor(None, self.delete_a_result)
            if not (plan and result):
                raise RuntimeError(f"could not delete a plan ({plan}) and a result ({result})")
        elif fault == "gateway-kill":
            self.services["gw"].kill9()
        elif fault == "worker-drain":
            self.services["w1"].signal(signal.SIGTERM)
        elif fault not in ("none", "poison-request"):  # the poison goes through the API (run_fault)
            raise ValueError(f"unknown fault {fault!r}")
