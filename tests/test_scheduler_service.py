"""The scheduler service with real workers over a real Redis (no gateway: the test plays it).

Checks that the streams/pub-sub plumbing delivers exactly what the runner computes, that a
cancel frees KV blocks, and that a worker that dies has its sequences finished elsewhere
with the client-visible token stream continuing without gaps or repeats."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import ERROR_REJECTED, FIELD, CancelRequest, Keys, SubmitRequest, TokenBatch, WorkerInfo
from scheduler.service import PolicyLimits, SchedulerService
from workers.runner import ModelRunner
from workers.service import RelayError, WorkerService

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    runner = ModelRunner(model_dir, num_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [s.outputs for s in runner_driver.run(runner, PROMPTS, params)]


class WorkerThread:
    def __init__(self, model_dir, url: str, keys: Keys, worker_id: str, num_blocks: int = 64):
        runner = ModelRunner(model_dir, num_blocks=num_blocks)
        self.service = WorkerService(runner, url, keys, worker_id, heartbeat_interval=0.1,
                                     heartbeat_ttl=0.6, block_ms=20)
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.service.run()
        except RelayError as e:  # its relay was killed (a worker dying without a word)
            self.error = e

    def stop(self):
        self.service.request_stop()
        self.thread.join(10)


class Gateway:
    """The gateway's side of the wire: submit, cancel, collect tokens by offset."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str = "gw"):
        self.client, self.keys, self.gateway_id = client, keys, gateway_id
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.errors: dict[str, tuple[str | None, str]] = {}  # seq id -> (error_kind, message)
        self.duplicates = 0

    async def listen(self, ready: asyncio.Event):
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.gateway_channel(self.gateway_id))
        ready.set()
        async for msg in pubsub.listen():
            if msg["type"] != "message":
                continue
            for ev in TokenBatch.from_wire(msg["data"]).events:
                out = self.tokens.setdefault(ev.seq_id, [])
                assert ev.offset <= len(out), f"gap in {ev.seq_id}: offset {ev.offset} after {len(out)}"
                new = ev.token_ids[len(out) - ev.offset:]
                self.duplicates += len(ev.token_ids) - len(new)
                out.extend(new)
                if ev.finish_reason:
                    self.finish[ev.seq_id] = ev.finish_reason
                if ev.error:
                    self.errors[ev.seq_id] = (ev.error_kind, ev.error)

    async def submit(self, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = SubmitRequest(rid, self.gateway_id, prompt, params, arrival_time=time.time())
        await self.client.xadd(self.keys.requests, {FIELD: req.to_wire()})

    async def cancel(self, rid: str):
        await self.client.xadd(self.keys.requests, {FIELD: CancelRequest(rid).to_wire()})

    async def wait(self, predicate, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; finished: {self.finish}"
            await asyncio.sleep(0.02)


async def stats(client: aioredis.Redis, keys: Keys) -> dict:
    data = await client.get(keys.scheduler_stats())
    return msgpack.unpackb(data) if data else {}


async def start(url: str, keys: Keys):
    client = aioredis.Redis.from_url(url)
    sched = SchedulerService(client, keys, PolicyLimits(max_num_batched_tokens=64, long_prefill_threshold=40),
                             heartbeat_interval=0.1)
    gw = Gateway(aioredis.Redis.from_url(url), keys)
    ready = asyncio.Event()
    tasks = [asyncio.create_task(sched.run()), asyncio.create_task(gw.listen(ready))]
    await ready.wait()
    return client, sched, gw, tasks


async def stop(client, sched, gw, tasks):
    sched.stop()
    await asyncio.wait_for(tasks[0], 10)
    tasks[1].cancel()
    await asyncio.gather(tasks[1], return_exceptions=True)
    await client.aclose()
    await gw.client.aclose()


async def test_requests_flow_to_a_worker_and_tokens_back(model_dir, reference, redis_server):
    keys = Keys("t1")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p)
        await gw.submit("doomed", [30, 31, 32], max_tokens=400)
        await gw.wait(lambda: len(gw.tokens.get("doomed", ())) >= 2)
        await gw.cancel("doomed")
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert all(gw.finish[f"r{i}"] == "length" for i in range(len(PROMPTS)))
        assert "doomed" not in gw.finish and len(gw.tokens["doomed"]) < 400
        assert gw.duplicates == 0

        async def idle():
            s = await stats(client, keys)
            return s.get("kv_blocks_used") == 0 and s.get("num_running") == 0 and s.get("num_waiting") == 0
        deadline = time.monotonic() + 10
        while not await idle():
            assert time.monotonic() < deadline, await stats(client, keys)
            await asyncio.sleep(0.05)
        s = await stats(client, keys)
        assert s["kv_blocks_total"] == 64 and s["num_workers"] == 1
        assert await client.keys(keys.request_record("*")) == []  # records deleted when done
        # the worker's cost-model horizon reaches its policy (PolicyLimits.attention_horizon unset)
        horizon = worker.service.runner.attention_horizon
        assert horizon > 0 and sched.workers["w1"].policy.config.attention_horizon == horizon
        assert sched.workers["w1"].policy.config.long_prefill_threshold == 40
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_a_dead_workers_sequences_finish_on_another(model_dir, reference, redis_server):
    keys = Keys("t2")
    w1 = WorkerThread(model_dir, redis_server, keys, "w1")
    client, sched, gw, tasks = await start(redis_server, keys)
    w2 = None
    dead = threading.Event()
    try:
        await gw.wait(lambda: "w1" in sched.workers, 10)
        # slow w1's steps down so the requests are mid-generation when it dies
        runner, inner = w1.service.runner, w1.service.runner.execute
        runner.execute = lambda plan: (time.sleep(0.05), inner(plan))[1]
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        w2 = WorkerThread(model_dir, redis_server, keys, "w2")
        await gw.wait(lambda: "w2" in sched.workers, 10)
        # w1 dies without a word: no more steps, no more heartbeats (its key expires)
        runner.execute = lambda plan: (dead.wait(), inner(plan))[1]
        w1.service.relay.kill()  # its Redis side: heartbeat, plans and results
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert "w1" not in sched.workers
    finally:
        await stop(client, sched, gw, tasks)
        w1.service.request_stop()
        dead.set()
        w1.thread.join(10)
        if w2:
            w2.stop()


async def test_a_restarted_scheduler_recovers_accepted_requests(model_dir, reference, redis_server):
    keys = Keys("t3")
    w1 = WorkerThread(model_dir, redis_server, keys, "w1")
    runner, inner = w1.service.runner, w1.service.runner.execute
    runner.execute = lambda plan: (time.sleep(0.03), inner(plan))[1]  # keep the requests mid-flight
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        sched.stop()
        await asyncio.wait_for(tasks[0], 10)
        assert len(gw.finish) < len(PROMPTS)
        assert len(await client.keys(keys.request_record("*"))) == len(PROMPTS) - len(gw.finish)

        # a new scheduler process would start from Redis alone: the request records
        sched2 = SchedulerService(client, keys, PolicyLimits(max_num_batched_tokens=64), heartbeat_interval=0.1)
        tasks[0] = asyncio.create_task(sched2.run())
        sched = sched2
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        # greedy recompute from the prompt: the same tokens again, dropped as duplicates by offset
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert await client.keys(keys.request_record("*")) == []
    finally:
        await stop(client, sched, gw, tasks)
        w1.stop()


async def test_requests_go_to_a_worker_that_can_hold_them_and_the_rest_are_rejected_as_bad_input(redis_server):
    keys = Keys("t4")
    r = aioredis.Redis.from_url(redis_server)
    for wid, num_blocks in (("big", 64), ("small", 4)):  # 1024 and 64 tokens of KV; heartbeats only, no model
        await r.sadd(keys.workers, wid)
        await r.set(keys.worker_heartbeat(wid), WorkerInfo(wid, "mixed", "m", num_blocks, 16, 2048, 1, 1.0).to_wire(),
                    px=60_000)
    await r.aclose()
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        await gw.wait(lambda: len(sched.workers) == 2, 10)
        await gw.submit("short", [5, 6, 7], max_tokens=4)  # the emptier cache wins a tie: big
        await gw.wait(lambda: "short" in sched.owner, 10)
        # small is now the less loaded worker, but only big can hold this one
        await gw.submit("long", list(range(1, 300)), max_tokens=8)
        await gw.submit("huge", list(range(1, 1100)), max_tokens=8)  # more than any cache, less than the context
        await gw.wait(lambda: "huge" in gw.finish)
        assert sched.owner == {"short": "big", "long": "big"}
        assert gw.finish["huge"] == "error" and gw.errors["huge"][0] == ERROR_REJECTED
        # the largest cache is the one named: 1099 + 8 - 1 positions of KV need 70 blocks
        assert "needs up to 70 KV blocks of 16 tokens; the worker has 64" in gw.errors["huge"][1]
        # a sequence moved off a dead worker that no survivor can hold: the cluster failed it, not the client
        sched.admit(SubmitRequest("resumed", gw.gateway_id, list(range(1, 1100)),
                                  SamplingParams(max_tokens=8, temperature=0.0)), output_ids=[3])
        await gw.wait(lambda: "resumed" in gw.finish)
        assert gw.finish["resumed"] == "error" and gw.errors["resumed"][0] is None
        assert "long" not in gw.finish
    finally:
        await stop(client, sched, gw, tasks)
