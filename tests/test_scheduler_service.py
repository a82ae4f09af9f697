"""The scheduler service with real workers over a real Redis (no gateway: the test plays it).

Checks that the streams/pub-sub plumbing delivers exactly what the runner computes, that a
cancel frees KV blocks, and that a worker that dies has its sequences finished elsewhere
with the client-visible token stream continuing without gaps or repeats."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aioredis

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import ERROR_REJECTED, Keys, SubmitRequest, WorkerInfo
from phaseserve.scheduler.service import PolicyLimits, SchedulerService
from service_harness import MAX_TOKENS, WorkerThread, start, stats, stop
from phaseserve.workers.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    runner = ModelRunner(model_dir, num_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [s.outputs for s in runner_driver.run(runner, PROMPTS, params)]


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


LONG_TOKENS = 40


@pytest.fixture(scope="module")
def long_reference(model_dir):
    runner = ModelRunner(model_dir, num_blocks=64)
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    return [s.outputs for s in runner_driver.run(runner, PROMPTS, params)]


async def test_a_dead_workers_sequences_finish_on_another(model_dir, long_reference, redis_server):
    """Deterministic fail-over: both workers run before any request (so the least-loaded placement puts
    half of them on w1), w1 is held mid-generation (its step blocks) and its relay killed; every request
    it held finishes on w2, token for token."""
    keys = Keys("t2")
    w1 = WorkerThread(model_dir, redis_server, keys, "w1")
    w2 = WorkerThread(model_dir, redis_server, keys, "w2")
    client, sched, gw, tasks = await start(redis_server, keys)
    dead = threading.Event()
    try:
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 10)
        runner, inner = w1.service.runner, w1.service.runner.execute
        runner.execute = lambda plan: (time.sleep(0.02), inner(plan))[1]  # w1's streams stay mid-flight
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, max_tokens=LONG_TOKENS)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        # w1 dies without a word: its step never returns, its relay (heartbeat, plans, results) is gone
        runner.execute = lambda plan: (dead.wait(), inner(plan))[1]
        on_w1 = {rid for rid, wid in sched.owner.items() if wid == "w1"}
        w1.service.link.process.kill()
        assert on_w1 and not (on_w1 & set(gw.finish)), "fail-over must be exercised: w1 holds live requests"
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == long_reference
        assert "w1" not in sched.workers and gw.conflicts == 0
    finally:
        await stop(client, sched, gw, tasks)
        w1.service.request_stop()
        dead.set()
        w1.thread.join(10)
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


async def test_a_prompt_outside_the_vocabulary_fails_alone_with_a_clear_error(model_dir, reference, redis_server):
    """A submit straight onto the requests stream (no gateway to check it) with a token id the model cannot
    embed: the scheduler refuses it at admission, from the vocabulary the worker's heartbeat announces, as
    bad input; the requests beside it are served as if it had never come."""
    keys = Keys("vocab")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        await gw.wait(lambda: "w1" in sched.workers, 30)
        vocab = worker.service.runner.vocab_size
        await gw.submit("bad", [1, 2, 10**6])
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p)
        await gw.submit("negative", [3, -1])
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS) + 2)
        for rid, bad_id in (("bad", 10**6), ("negative", -1)):
            assert gw.finish[rid] == "error"
            kind, message = gw.errors[rid]
            assert kind == ERROR_REJECTED
            assert f"outside the vocabulary [0, {vocab})" in message and str(bad_id) in message
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert all(gw.finish[f"r{i}"] == "length" for i in range(len(PROMPTS)))
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_a_slow_prefill_and_a_queue_are_progress_not_a_stall(model_dir, redis_server):
    """A real gateway with a short --request-progress-timeout (1 s) in front of a scheduler and a worker on a
    slow machine (every step computing prompt positions takes 0.2 s): a long prompt prefills in many small
    chunks (--max-num-batched-tokens 16) for several seconds without a token, and a second request waits in
    the queue behind it (--max-num-seqs 1) as long. The scheduler vouches for both (SequenceProgress), so
    both complete instead of failing with "no progress"."""
    import openai

    from gateway_client import serve_gateway

    keys = Keys("slowprefill")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    execute = worker.service.runner.execute

    def slow_execute(plan):
        if any(c.num_tokens > 1 for c in plan.chunks):
            time.sleep(0.2)
        return execute(plan)

    worker.service.runner.execute = slow_execute
    limits = PolicyLimits(max_num_seqs=1, max_num_batched_tokens=16, long_prefill_threshold=0)
    client, sched, gw, tasks = await start(redis_server, keys, limits=limits)
    runner, url = await serve_gateway(["--redis-url", redis_server, "--model", str(model_dir), "--key-prefix",
                                       keys.prefix, "--request-progress-timeout", "1"])
    try:
        await gw.wait(lambda: "w1" in sched.workers, 30)
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        long_prompt = [5 + i % 200 for i in range(300)]  # ~19 prefill steps: ~4 s with no token
        t0 = time.monotonic()
        replies = await asyncio.gather(*(
            oai.completions.create(model=str(model_dir.name), prompt=p, max_tokens=4, temperature=0.0,
                                   extra_body={"ignore_eos": True})
            for p in (long_prompt, [9, 10, 11])))
        assert time.monotonic() - t0 > 3.0  # well past the progress timeout
        assert [r.choices[0].finish_reason for r in replies] == ["length", "length"]
        assert [r.usage.completion_tokens for r in replies] == [4, 4]
        await oai.close()
    finally:
        await runner.cleanup()
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_a_submit_read_again_after_a_failover_writes_its_lost_record_again(redis_server):
    """A Redis failover can lose a request's record together with the ack of its read (the record is
    written first, and the promoted replica holds a prefix of the writes): the submit comes back, and
    the scheduler, which still holds the request, writes the record again as admitted (with its seed)."""
    keys = Keys("t-failover")
    r = aioredis.Redis.from_url(redis_server)
    await r.sadd(keys.workers, "w")  # a heartbeat only: the request stays in flight
    await r.set(keys.worker_heartbeat("w"), WorkerInfo("w", "mixed", "m", 64, 16, 2048, 1, 1.0).to_wire(), px=60_000)
    client, sched, gw, tasks = await start(redis_server, keys)
    record = keys.request_record("s")
    try:
        await gw.submit("s", [5, 6, 7], params=SamplingParams(max_tokens=8, temperature=0.8))  # unseeded
        await gw.wait(lambda: "s" in sched.owner, 10)
        deadline = time.monotonic() + 10
        while not await r.hexists(record, "submit"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        admitted = SubmitRequest.from_wire(await r.hget(record, "submit"))
        assert admitted.params.seed is not None  # drawn at admission
        await r.delete(record)  # lost with the failover
        await gw.submit("s", [5, 6, 7], params=SamplingParams(max_tokens=8, temperature=0.8))  # read again
        while not await r.hexists(record, "submit"):
            assert time.monotonic() < deadline, "the record was not written again"
            await asyncio.sleep(0.02)
        assert SubmitRequest.from_wire(await r.hget(record, "submit")) == admitted
        assert sched.num_duplicates == 1
    finally:
        await stop(client, sched, gw, tasks)
        await r.aclose()
