"""Several hosts, for real, on one machine: network namespaces joined by a bridge (tests/netns_hosts.py).
Host 1 runs Redis, the scheduler and a gateway; host 2 a prefill worker; host 3 a decode worker; a fourth
host joins later. Each worker reports the host identity of its namespace, so every KV handoff goes over
the network (Redis), never shared memory, and /metrics counts those bytes by transport.

Shown here: greedy streams over the three hosts equal the in-process engine (as a one-host stack's do,
tests/test_e2e_disaggregated.py); host 3 cut off mid-run (its link down) loses no accepted request, and
when it comes back it is fenced (retired, adopted again with a reset plan, its late step results refused);
a new host's worker joins and takes work."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request

import openai
import pytest
import redis

from e2e_reference import engine_texts, metric, prompts
from e2e_stack import wait_for
from netns_hosts import Hosts, unavailable
from phaseserve.redis_server import find_redis_server
from phaseserve.wire import Keys, WorkerInfo

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PREFIX = "mh"
PORT = 8000
MAX_TOKENS = 12
WORKER_ARGS = ["--heartbeat-interval", "0.3", "--heartbeat-ttl", "1.5", "--kv-cache-memory", "64MiB",
               "--num-threads", "1", "--drain-timeout", "2", "--key-prefix", PREFIX]


class Cluster:
    def __init__(self, hosts: Hosts, model_dir):
        self.hosts, self.model_dir = hosts, model_dir
        self.redis_url = f"redis://{hosts.address(1)}:6379/0"
        self.base_url = f"http://{hosts.address(1)}:{PORT}"
        self.keys = Keys(PREFIX)

    def start_worker(self, host: int, role: str) -> str:
        worker_id = f"host{host}-{role}"
        self.hosts.run(host, [sys.executable, "-m", "phaseserve.workers", "--model", str(self.model_dir), "--redis-url",
                              self.redis_url, "--role", role, "--worker-id", worker_id, *WORKER_ARGS],
                       f"worker-{host}.log")
        return worker_id

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def workers(self) -> dict[str, WorkerInfo]:
        client = self.redis()
        try:
            ids = sorted(m.decode() for m in client.smembers(self.keys.workers))
            beats = client.mget([self.keys.worker_heartbeat(w) for w in ids]) if ids else []
        finally:
            client.close()
        return {w: WorkerInfo.from_wire(b) for w, b in zip(ids, beats) if b is not None}

    def stats(self) -> dict:
        import msgpack

        client = self.redis()
        try:
            data = client.get(self.keys.scheduler_stats())
        except redis.ConnectionError:  # Redis not up yet
            return {}
        finally:
            client.close()
        return msgpack.unpackb(data) if data else {}


@pytest.fixture(scope="module")
def cluster(e2e_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multihost")
    with Hosts(3, log_dir) as hosts:
        c = Cluster(hosts, e2e_model)
        a1 = hosts.address(1)
        hosts.run(1, [find_redis_server(), "--bind", a1, "--port", "6379", "--save", "", "--appendonly", "no",
                      "--protected-mode", "no"], "redis.log")
        hosts.run(1, [sys.executable, "-m", "phaseserve.scheduler", "--redis-url", c.redis_url, "--key-prefix", PREFIX,
                      "--heartbeat-interval", "0.3"], "scheduler.log")
        hosts.run(1, [sys.executable, "-m", "phaseserve.gateway", "--model", str(e2e_model), "--redis-url", c.redis_url,
                      "--key-prefix", PREFIX, "--host", a1, "--port", str(PORT)], "gateway.log")
        c.start_worker(2, "prefill")
        c.start_worker(3, "decode")
        ok = wait_for(lambda: c.stats().get("num_workers") == 2 and _health(c.base_url) == 200, 240, 0.5)
        assert ok, {name: hosts.log(name)[-2000:] for name in ("scheduler.log", "gateway.log", "worker-2.log",
                                                                "worker-3.log")}
        yield c


def _health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
            return r.status
    except OSError:
        return 0


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, on_token=None) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    parts = []
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            if on_token is not None:
                on_token()
    return "".join(parts)


def _client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _model(c: Cluster) -> str:
    import json

    with urllib.request.urlopen(c.base_url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


async def test_three_hosts_hand_kv_over_the_network_and_equal_the_engine(cluster):
    c = cluster
    hosts = {w: info.host for w, info in c.workers().items()}
    # each namespace is a host of its own: same hostname, another network namespace
    assert len(set(hosts.values())) == 2, hosts
    ps = prompts(8) + [" ".join(["Paged attention keeps every block"] * 20)]
    async with _client(c) as client:
        texts = await asyncio.gather(*(_stream(client, _model(c), p, MAX_TOKENS) for p in ps))
    assert texts == engine_texts(c.model_dir, ps, MAX_TOKENS)
    assert wait_for(lambda: metric(c.base_url, "kv_handoff_received") >= len(ps), 20)
    assert metric(c.base_url, "kv_handoff_failed") == 0
    over_network = metric(c.base_url, 'kv_handoff_transport_bytes{transport="redis"}')
    assert over_network > 0 and over_network == metric(c.base_url, "kv_handoff_bytes")
    assert metric(c.base_url, 'kv_handoff_transport_bytes{transport="shm"}') == 0
    log = c.hosts.log("scheduler.log")
    assert "transport=redis" in log and "transport=shm" not in log


async def test_a_host_cut_off_mid_run_loses_nothing_and_is_fenced_when_it_comes_back(cluster):
    c = cluster
    joined_before = c.hosts.log("scheduler.log").count("worker joined")
    stale_before = c.stats().get("num_stale_results", 0)
    ps = [f"{p} on a long road" for p in prompts(8)]
    max_tokens = 160
    seen = [0]

    def on_token():
        seen[0] += 1

    async def cut_when_running():
        # host 3 (the decode worker) decodes these once the prefill worker hands them over
        deadline = time.monotonic() + 120
        while seen[0] < len(ps) * 8:
            assert time.monotonic() < deadline, "the streams never got going"
            await asyncio.sleep(0.02)
        c.hosts.cut(3)
        cut_at = seen[0]
        await asyncio.sleep(4.0)  # > the heartbeat TTL: the scheduler retires it
        c.hosts.reconnect(3)
        return cut_at

    async with _client(c) as client:
        model = _model(c)
        texts, cut_at = await asyncio.gather(
            asyncio.gather(*(_stream(client, model, p, max_tokens, on_token) for p in ps)), cut_when_running())
    log = c.hosts.log("scheduler.log")
    assert cut_at < len(ps) * max_tokens, "the streams ended before the cut"
    assert re.search(r"worker lost.*host3-decode|host3-decode.*worker lost", log), log[-3000:]
    # every accepted request completed, with the tokens the engine computes (recomputed on host 2)
    assert texts == engine_texts(c.model_dir, ps, max_tokens)
    # back on the network: adopted afresh (a reset plan fences its old life) ...
    assert wait_for(lambda: c.hosts.log("scheduler.log").count("worker joined") > joined_before, 30), log[-3000:]
    assert wait_for(lambda: c.stats().get("num_workers") == 2, 30)
    # ... and what it wrote for its old life was refused: by the scheduler (a retired life's step ids) or,
    # once its relay saw the model's writes overdue, by the relay itself (a void life)
    worker_log = c.hosts.log("worker-3.log")
    refused = wait_for(lambda: c.stats().get("num_stale_results", 0) > stale_before
                       or "writes are void" in c.hosts.log("worker-3.log"), 20)
    assert refused, (c.stats(), worker_log[-3000:])
    print(f"cut after {cut_at} of {len(ps) * max_tokens} tokens; results refused by the scheduler: "
          f"{c.stats().get('num_stale_results', 0) - stale_before}; by the relay (void life): "
          f"{'writes are void' in c.hosts.log('worker-3.log')}")


async def test_a_new_hosts_worker_joins_and_takes_work(cluster):
    c = cluster
    c.hosts.add_host(4)
    new = c.start_worker(4, "decode")
    assert wait_for(lambda: c.stats().get("num_workers") == 3, 240), c.hosts.log("worker-4.log")[-3000:]
    assert c.workers()[new].host not in {w.host for wid, w in c.workers().items() if wid != new}
    ps = [f"Host four, {p}" for p in prompts(12)]
    async with _client(c) as client:
        model = _model(c)
        texts = await asyncio.gather(*(_stream(client, model, p, MAX_TOKENS) for p in ps))
    assert texts == engine_texts(c.model_dir, ps, MAX_TOKENS)
    # the scheduler hands prefills to the decode worker with the most free blocks: the new one takes some
    assert re.search(rf"handed to a decode worker.*worker_id={new}", c.hosts.log("scheduler.log"))
