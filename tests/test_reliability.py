"""Faults the queue must survive, each driven deterministically over a real Redis with real
model workers: a plan or a result lost (or unreadable) between the scheduler and a worker, unreadable
messages on the requests stream, a worker whose model is frozen (SIGSTOP), Redis restarted, and the
active scheduler killed with a standby running. Every request completes, token for token what an
unfaulted run produces; an unseeded sampled request stays one sample through a scheduler fail-over."""

from __future__ import annotations

import dataclasses

import asyncio
import re
import signal
import time

import msgpack
import pytest
import redis.asyncio as aioredis

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import (
    FIELD, CancelRequest, Keys, ScheduledChunk, SeqStart, StepPlan, StepResult, SubmitRequest, TokenBatch,
    TokenEvent, WorkerInfo,
)
from phaseserve.scheduler.request_book import OUTPUTS_PER_WRITE
from phaseserve.scheduler.service import PolicyLimits, SchedulerService
from service_harness import Gateway, SchedulerProcess, WorkerProcess, WorkerThread, start, stop
from phaseserve.workers.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21]]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    runner = ModelRunner(model_dir, num_blocks=64)
    return [s.outputs for s in runner_driver.run(runner, PROMPTS, GREEDY)]


def reference_for(model_dir, prompts, params, max_tokens):
    runner = ModelRunner(model_dir, num_blocks=128)
    return [s.outputs for s in runner_driver.run(runner, prompts, params)]


def lose_steps(worker: WorkerThread, *, lose_plan=lambda plan: False, corrupt_plan=lambda plan: False,
               lose_result=lambda plan, result: False) -> list[str]:
    """Make the worker lose chosen messages, each once, exactly where the faults happen in production:
    a plan that never reaches the model (deleted from its stream: only acked), a plan the worker cannot
    read, a result that never reaches the scheduler (its tokens still reach the client)."""
    service = worker.service
    run_step, publish = service.run_step, service.publish
    lost: list[str] = []

    def faulty_run_step(entry_id, data):
        plan = StepPlan.from_wire(data)
        if lose_plan(plan):
            lost.append(f"plan {plan.step_id}")
            return service.link.send(msgpack.packb([entry_id, None, []]))
        if corrupt_plan(plan):
            lost.append(f"unreadable plan {plan.step_id}")
            return run_step(entry_id, data[:-3] + b"\xc1\xc1\xc1")
        return run_step(entry_id, data)

    def faulty_publish(plan, result, entry_id):
        if lose_result(plan, result):
            lost.append(f"result {plan.step_id}")  # its tokens still go out: only the scheduler's copy is lost
            return _publish_tokens_only(service, plan, result, entry_id)
        return publish(plan, result, entry_id)

    service.run_step, service.publish = faulty_run_step, faulty_publish
    return lost


def _publish_tokens_only(service, plan, result, entry_id):
    from collections import defaultdict
    by_gateway = defaultdict(list)
    for ev in result.events:
        gw = service.gateway_of.get(ev.seq_id)
        if gw is not None:
            by_gateway[gw].append(ev)
    batches = [[gw, TokenBatch(plan.step_id, service.worker_id, evs).to_wire()] for gw, evs in by_gateway.items()]
    service.link.writes.send_bytes(msgpack.packb([entry_id, None, batches, plan.reset]))


def once(predicate):
    fired = []

    def check(*args):
        if not fired and predicate(*args):
            fired.append(True)
            return True
        return False
    return check


def decodes(plan: StepPlan, seq_id: str, offset: int) -> bool:
    """The plan samples output `offset` of `seq_id` with a decode (prompt length of PROMPTS)."""
    i = int(seq_id[1:])
    return any(c.seq_id == seq_id and c.num_tokens == 1 and c.start_pos == len(PROMPTS[i]) + offset - 1
               for c in plan.chunks)


async def test_lost_and_unreadable_plans_and_results_are_replanned(model_dir, reference, redis_server):
    """Found out of order: the worker runs plans in order, so a result that overtakes an open step means
    that step's plan or result was lost. Its sequences are recomputed; the worker is never stranded."""
    keys = Keys("lost")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    lost = lose_steps(
        worker,
        lose_plan=once(lambda plan: decodes(plan, "r0", 4) or any(s.seq_id == "r2" for s in plan.starts)),
        corrupt_plan=once(lambda plan: decodes(plan, "r3", 13)),
        lose_result=once(lambda plan, result: any(e.seq_id == "r1" and e.offset == 8 for e in result.events)),
    )
    # faults in adjacent steps leave no later result to reveal them: then the deadline does
    client, sched, gw, tasks = await start(redis_server, keys, step_timeout=2.0)
    try:
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, MAX_TOKENS)
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        assert len(lost) == 3, lost
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert all(gw.finish[f"r{i}"] == "length" for i in range(len(PROMPTS))) and gw.conflicts == 0
        assert sched.num_steps_given_up >= 3
        assert list(sched.workers) == ["w1"]
        # not stranded: its plans in flight drain (the last requests' final steps may still be answering)
        await gw.wait(lambda: not sched.workers["w1"].in_flight, 10)
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_a_lost_result_with_nothing_after_it_is_given_up_at_its_deadline(model_dir, reference, redis_server):
    """One plan in flight: no later result can reveal the loss, only the step deadline."""
    keys = Keys("deadline")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    lost = lose_steps(worker, lose_result=once(lambda plan, result: any(e.offset == 7 for e in result.events)))
    client, sched, gw, tasks = await start(redis_server, keys, plans_in_flight=1, step_timeout=0.2)
    try:
        await gw.submit("r0", PROMPTS[0], MAX_TOKENS)
        t0 = time.monotonic()
        await gw.wait(lambda: "r0" in gw.finish, 30)
        assert lost == [lost[0]] and lost[0].startswith("result")
        assert gw.tokens["r0"] == reference[0] and gw.conflicts == 0
        assert sched.num_steps_given_up == 1
        assert time.monotonic() - t0 >= sched.step_timeout  # it waited for the deadline, no longer
        # a step larger than the budget (a whole long prompt, chunked prefill off) gets a longer deadline
        budget = sched.limits.max_num_batched_tokens
        assert sched.plan_timeout(StepPlan(0, "w1", chunks=[ScheduledChunk("x", 0, budget, [])])) == 0.2
        assert sched.plan_timeout(StepPlan(0, "w1", chunks=[ScheduledChunk("x", 0, 3 * budget, [])])) == \
            pytest.approx(0.6)
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_unreadable_messages_are_dead_lettered_and_their_clients_told(model_dir, reference, redis_server):
    keys = Keys("dead")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        # a newer gateway: a message kind this scheduler does not know, for a client waiting on "gw"
        newer = msgpack.packb({"v": 1, "k": "submit_v2", "request_id": "future", "gateway_id": "gw", "x": [1]})
        await client.xadd(keys.requests, {FIELD: newer})
        await client.xadd(keys.requests, {FIELD: b"\xc1 not msgpack"})  # corrupt
        await client.xadd(keys.requests, {"other": b"1"})  # no message field at all
        # a submit whose request id and gateway are readable but whose body is not a valid submit
        broken = msgpack.packb({"v": 1, "k": "submit", "request_id": "broken", "gateway_id": "gw"})
        await client.xadd(keys.requests, {FIELD: broken})
        await client.xadd(keys.results, {FIELD: b"garbage"})
        # a newer gateway's submit with extra fields (top level and in the sampling params): served
        req = SubmitRequest("extra", "gw", PROMPTS[0], GREEDY).to_dict()
        req.update(v=1, k="submit", tenant="t1")
        req["params"]["speculative"] = True
        await client.xadd(keys.requests, {FIELD: msgpack.packb(req)})
        await gw.wait(lambda: {"future", "broken", "extra"} <= set(gw.finish))
        assert gw.finish["future"] == "error" and "unknown message kind 'submit_v2'" in gw.errors["future"][1]
        assert gw.finish["broken"] == "error" and gw.errors["broken"][1].startswith(
            "the scheduler could not read this request")
        assert gw.finish["extra"] == "length" and gw.tokens["extra"] == reference[0]
        # the errors are in the requests' token logs too: a gateway that missed the message still reads them
        for rid in ("future", "broken"):
            (_, fields), = await client.xrange(keys.token_log(rid))
            assert msgpack.unpackb(fields[FIELD.encode()])[3] == "error"
        deadline = time.monotonic() + 5
        while await client.xlen(keys.dead_letters) < 5:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        dead = {e[1][b"stream"].decode(): e[1] for e in await client.xrange(keys.dead_letters)}
        entries = await client.xrange(keys.dead_letters)
        assert len(entries) == 5 and sched.num_dead_letters == 5
        assert dead[keys.results][FIELD.encode()] == b"garbage" and b"WireError" in dead[keys.results][b"reason"]
        reasons = sorted(e[1][b"reason"].decode() for e in entries)
        assert any("not msgpack" in r for r in reasons) and any("no 'm' field" in r for r in reasons)
        # the scheduler still serves: nothing pending, and a new request runs
        await gw.submit("after", PROMPTS[1], MAX_TOKENS)
        await gw.wait(lambda: "after" in gw.finish)
        assert gw.tokens["after"] == reference[1]
        assert (await client.xpending(keys.requests, keys.scheduler_group))["pending"] == 0
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


async def test_sequences_a_dead_gateway_left_are_cancelled_after_the_resume_grace(model_dir, redis_server):
    """A gateway keeps a client lease on every sequence it streams; when it dies the leases expire, and the
    scheduler cancels those sequences after the grace (instead of generating to the end of the context).
    A sequence whose gateway keeps no leases at all is left alone."""
    keys = Keys("orphan")
    worker = WorkerThread(model_dir, redis_server, keys, "w1", num_blocks=128)
    client, sched, gw, tasks = await start(redis_server, keys, resume_grace=0.3)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    run_step = worker.service.run_step

    def slow_step(entry_id, data):  # 400 steps take 8 s: far longer than the grace the test waits for
        time.sleep(0.02)
        return run_step(entry_id, data)

    worker.service.run_step = slow_step
    try:
        await client.set(keys.client_lease("leased"), "gw:1")
        await gw.submit("leased", PROMPTS[0], params=long)
        await gw.submit("unleased", PROMPTS[1], MAX_TOKENS)
        await gw.wait(lambda: "unleased" in gw.finish)
        assert gw.finish["unleased"] == "length"
        assert "leased" in sched.orphans.leased and "leased" in sched.owner
        await client.delete(keys.client_lease("leased"))  # its gateway dies: the lease is gone
        deadline = time.monotonic() + 10
        while "leased" in sched.owner:
            assert time.monotonic() < deadline, "the orphaned sequence was never cancelled"
            await asyncio.sleep(0.05)
        assert len(gw.tokens.get("leased", [])) < 400
        last = (await client.xrevrange(keys.token_log("leased"), count=1))[0][1]
        assert msgpack.unpackb(last[FIELD.encode()])[3] == "abort"  # a late resume reads the end
        assert not await client.exists(keys.request_record("leased"))
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


def test_the_wire_contract_ignores_fields_a_newer_peer_adds():
    def with_extra(message, **extra):
        body = msgpack.unpackb(message.to_wire(), raw=False)
        body.update(extra)
        return msgpack.packb(body)

    params = SamplingParams(max_tokens=3, temperature=0.5, seed=7)
    sub = SubmitRequest("r", "g", [1, 2], params, priority=2)
    body = msgpack.unpackb(sub.to_wire(), raw=False)
    body["params"]["new_knob"] = 1
    body["new_field"] = "x"
    assert SubmitRequest.from_wire(msgpack.packb(body)) == sub
    assert CancelRequest.from_wire(with_extra(CancelRequest("r"), why="x")) == CancelRequest("r")
    plan = StepPlan(3, "w", [SeqStart("r", "g", [1], params, [4])], [ScheduledChunk("r", 0, 1, [0])], ["q"], 9, True)
    assert StepPlan.from_wire(with_extra(plan, priority_hint=1)) == plan
    result = StepResult(3, "w", [TokenEvent("r", 0, [5], "stop", None, None, None)], 1, 0.5, 9)
    extra_event = msgpack.unpackb(result.to_wire(), raw=False)
    event = extra_event["events"][0]  # positional: the fields left unset, then the new one
    event += [f.default for f in dataclasses.fields(TokenEvent)[len(event):]] + ["a newer event field"]
    extra_event["trace"] = {}
    assert StepResult.from_wire(msgpack.packb(extra_event)) == result
    info = WorkerInfo("w", "mixed", "m", 8, 16, 128, 1, 2.0, 5)
    assert WorkerInfo.from_wire(with_extra(info, gpu="none")) == info
    # an older peer's message (no epoch, no reset) reads with the defaults
    old = msgpack.unpackb(plan.to_wire(), raw=False)
    del old["epoch"], old["reset"]
    assert StepPlan.from_wire(msgpack.packb(old)).epoch == 0 and not StepPlan.from_wire(msgpack.packb(old)).reset


LONG = 200  # tokens: a stream lasts well past the moment a fault is injected


@pytest.fixture(scope="module")
def long_reference(model_dir):
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    return reference_for(model_dir, PROMPTS, params, LONG)


def assert_matches(gw: Gateway, reference: list[list[int]]) -> None:
    """Every token a client got is the unfaulted run's at its offset (gaps allowed only if the stand-in
    gateway allows them: pub/sub drops what is published while Redis is away)."""
    for i, ref in enumerate(reference):
        seen = gw.by_offset[f"r{i}"]
        assert all(ref[off] == tok for off, tok in seen.items()), f"r{i} differs from the unfaulted run"
        assert gw.finish[f"r{i}"] == "length"
    assert gw.conflicts == 0


async def test_a_frozen_worker_is_treated_as_dead_and_rejoins_when_it_thaws(model_dir, long_reference,
                                                                           redis_server, tmp_path):
    """SIGSTOP the model process of a worker (its relay keeps running): past the step deadline the relay
    withdraws the heartbeat, the scheduler moves its sequences to the other worker, and no stream stalls
    for much longer than the deadline. SIGCONT: its late writes are void, and it rejoins as a new life."""
    keys = Keys("frozen")
    workers = [WorkerProcess(model_dir, redis_server, keys, w, tmp_path / f"{w}.log", "--step-timeout", "1")
               for w in ("w1", "w2")]
    client, sched, gw, tasks = await start(redis_server, keys, step_timeout=1.0)
    try:
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 60)
        started_at = {w: s.info.started_at for w, s in sched.workers.items()}
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, LONG)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        workers[0].signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        on_w1 = {rid for rid, wid in sched.owner.items() if wid == "w1"} - set(gw.finish)
        assert on_w1, "the frozen worker must hold live streams"
        await gw.wait(lambda: "w1" not in sched.workers, 10)
        retired_after = time.monotonic() - frozen_at
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS), 120)
        assert_matches(gw, long_reference)
        assert 1.0 <= retired_after < 4.0, retired_after  # the deadline, plus a heartbeat refresh or two
        assert gw.longest_stall < 6.0, gw.longest_stall

        first_life = started_at["w1"]
        workers[0].signal(signal.SIGCONT)  # thawed: a new life (a new started_at), adopted afresh
        await gw.wait(lambda: "w1" in sched.workers and sched.workers["w1"].info.started_at > first_life, 30)
        await gw.submit("after", PROMPTS[1], 8)
        await gw.wait(lambda: "after" in gw.finish, 30)
        assert gw.tokens["after"] == long_reference[1][:8] and gw.conflicts == 0
        log_text = (tmp_path / "w1.log").read_text()
        assert "withdrawing the heartbeat" in log_text and "rejoining as a new life" in log_text
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_a_frozen_worker_is_found_from_its_learned_step_costs_not_the_step_timeout(
        model_dir, long_reference, redis_server, tmp_path):
    """At the default --step-timeout (30 s), once the scheduler has learned the workers' step costs a step's
    deadline is a multiple of its predicted time (at least the floor): a SIGSTOPped model is retired and
    its streams move on within seconds."""
    keys = Keys("frozen-learned")
    workers = [WorkerProcess(model_dir, redis_server, keys, w, tmp_path / f"{w}.log") for w in ("w1", "w2")]
    client, sched, gw, tasks = await start(redis_server, keys)  # step_timeout 30, floor 3 s, factor 10
    try:
        assert sched.base_step_timeout == 30.0
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 60)
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, LONG)
        await gw.wait(lambda: all(sched.workers[w].step_costs.expected_bound(1, 1) is not None
                                  for w in ("w1", "w2")), 120)
        on_w1 = {rid for rid, wid in sched.owner.items() if wid == "w1"} - set(gw.finish)
        assert on_w1, "the worker to freeze must hold live streams"
        workers[0].signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        await gw.wait(lambda: "w1" not in sched.workers, 30)
        retired_after = time.monotonic() - frozen_at
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS), 120)
        assert_matches(gw, long_reference)
        assert sched.step_timeout_floor <= retired_after < 8.0, retired_after
        assert gw.longest_stall < 10.0, gw.longest_stall
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


def test_a_step_deadline_follows_the_learned_cost_between_a_floor_and_the_step_timeout():
    from phaseserve.scheduler.step_cost import StepCostModel, step_deadline

    kw = dict(floor_s=3.0, factor=10.0, fallback_s=30.0)
    assert step_deadline(None, **kw) == 30.0  # not learned yet (a worker warming up)
    assert step_deadline(0.014, **kw) == 3.0  # 10 x 14 ms: the floor
    assert step_deadline(1.0, **kw) == 10.0
    assert step_deadline(10.0, **kw) == 30.0  # never past --step-timeout
    assert step_deadline(0.014, floor_s=3.0, factor=0.0, fallback_s=30.0) == 30.0  # off

    model = StepCostModel(min_samples=16, warmup=2)
    for i in range(18):  # decode steps all alike (two of warm-up first), one slowed
        assert model.expected_bound(4, 40) is None
        model.observe(4, 40, 0.02 if i != 9 else 0.05)
    # its prediction, or with no plausible fit the longest step measured
    assert model.expected_bound(4, 40) == (model.costs.predict(4, 40) if model.costs else 0.05)
    for i in range(64):  # steps of several sizes: a fit, which predicts a big step above any measured
        n = 1 + i % 8
        model.observe(n * 64, n * 640, 0.005 + 0.001 * n * 64 + 1e-6 * n * 640, 1)
    assert model.costs is not None
    assert model.expected_bound(2000, 20000, 1) == pytest.approx(model.costs.predict(2000, 20000, 1))


async def test_redis_restarted_on_its_port_every_service_resumes(model_dir, long_reference):
    """Redis stopped for 2 s and started again, empty, on the same port: the scheduler and both workers
    (models loaded, same processes) wait it out and every stream completes as in an unfaulted run."""
    keys = Keys("outage")
    server = EmbeddedRedis().start()
    workers = [WorkerThread(model_dir, server.url, keys, w, step_timeout=30.0) for w in ("w1", "w2")]
    client, sched, gw, tasks = await start(server.url, keys, allow_gaps=True, step_timeout=1.0)
    try:
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 30)
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, LONG)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        server.stop()
        unfinished = set(f"r{i}" for i in range(len(PROMPTS))) - set(gw.finish)
        assert unfinished
        await asyncio.sleep(2.0)
        server.start()
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS), 120)
        assert_matches(gw, long_reference)
        assert not tasks[0].done()  # the scheduler is still running
        assert all(w.error is None and w.thread.is_alive() for w in workers)  # same processes, models loaded
        await gw.submit("after", PROMPTS[2], 8)
        await gw.wait(lambda: "after" in gw.finish, 30)
        assert gw.tokens["after"] == long_reference[2][:8]
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()
        server.stop()


async def test_redis_restarted_empty_while_the_scheduler_claims_pending_entries(model_dir, long_reference):
    """Redis restarted without its data just before the scheduler's periodic claim of pending entries: the
    XAUTOCLAIM meets NOGROUP (the groups went with the data); the scheduler recreates its groups and goes
    on, and every stream completes."""
    keys = Keys("nogroup")
    server = EmbeddedRedis().start()
    workers = [WorkerThread(model_dir, server.url, keys, "w1", step_timeout=30.0)]
    client, sched, gw, tasks = await start(server.url, keys, allow_gaps=True, step_timeout=1.0)
    try:
        await gw.wait(lambda: "w1" in sched.workers, 30)
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, LONG)
        await gw.wait(lambda: all(len(gw.tokens.get(f"r{i}", ())) >= 3 for i in range(len(PROMPTS))))
        server.stop()
        # longer than a command's retries: the loop itself waits it out, and its first turn once Redis is
        # back starts with the claim
        sched._next_claim = 0.0
        await asyncio.sleep(3.0)
        server.start()
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS) or tasks[0].done(), 120)
        assert not tasks[0].done(), tasks[0].exception()  # the scheduler is still running
        assert_matches(gw, long_reference)
        await gw.submit("after", PROMPTS[2], 8)
        await gw.wait(lambda: "after" in gw.finish, 30)
        assert gw.tokens["after"] == long_reference[2][:8]
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()
        server.stop()


async def test_a_killed_scheduler_is_replaced_by_its_standby_and_samples_stay_one_sample(
        model_dir, long_reference, redis_server, tmp_path):
    """Two schedulers against one Redis: one holds the lease and plans, the other stands by. kill -9 the
    active one mid-stream: the standby takes over within the lease time, with a new epoch, resumes every
    sequence from its confirmed outputs, and an unseeded sampled stream continues the very sample its
    client has (it got a seed at admission, kept in its record)."""
    keys = Keys("failover")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    runner, inner = worker.service.runner, worker.service.runner.execute
    runner.execute = lambda plan: (time.sleep(0.01), inner(plan))[1]  # streams stay mid-flight
    lease = ["--scheduler-lease-ttl", "1.0", "--step-timeout", "2"]
    active = SchedulerProcess(redis_server, keys, tmp_path / "a.log", *lease)
    standby = None
    client = aioredis.Redis.from_url(redis_server)
    gw = Gateway(aioredis.Redis.from_url(redis_server), keys)
    ready = asyncio.Event()
    listener = asyncio.create_task(gw.listen(ready))
    try:
        await ready.wait()
        await gw.wait(lambda: "lease taken" in active.text(), 30)
        standby = SchedulerProcess(redis_server, keys, tmp_path / "b.log", *lease)
        await gw.wait(lambda: "standby" in standby.text(), 30)
        assert (await client.get(keys.scheduler_lease())).decode() == active.consumer
        epoch_a = int(await client.get(keys.scheduler_epoch()))

        sampled = SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True)  # no seed
        for i, p in enumerate(PROMPTS[:3]):
            await gw.submit(f"r{i}", p, LONG)
        await gw.submit("s", PROMPTS[3], params=sampled)
        ids = [f"r{i}" for i in range(3)] + ["s"]
        await gw.wait(lambda: all(len(gw.tokens.get(r, ())) >= 40 for r in ids), 60)
        record = SubmitRequest.from_wire(await client.hget(keys.request_record("s"), "submit"))
        assert record.params.seed is not None  # drawn at admission
        assert "lease taken" not in standby.text()  # the standby has planned nothing
        active.proc.kill()
        killed_at = time.monotonic()
        active.proc.wait(5)
        assert not any(gw.finish.get(r) for r in ids)
        await gw.wait(lambda: "lease taken" in standby.text(), 10)
        took_over = time.monotonic() - killed_at
        assert took_over < 1.0 + 1.5, took_over  # the lease time, plus a standby poll and start-up
        assert (await client.get(keys.scheduler_lease())).decode() == standby.consumer
        assert int(await client.get(keys.scheduler_epoch())) > epoch_a

        await gw.wait(lambda: all(r in gw.finish for r in ids), 120)
        # each resumed from the outputs its record had confirmed, not from its prompt
        resumed = dict(re.findall(r"request admitted .*?request_id=(\S+) resumed_from=(\d+)", standby.text()))
        # (records take confirmed tokens in runs of OUTPUTS_PER_WRITE: at least two runs by the kill)
        assert set(resumed) == set(ids) and all(int(n) >= 2 * OUTPUTS_PER_WRITE for n in resumed.values()), resumed
        assert [gw.tokens[f"r{i}"] for i in range(3)] == long_reference[:3] and gw.conflicts == 0
        seeded = SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True, seed=record.params.seed)
        (sample_ref,) = reference_for(model_dir, [PROMPTS[3]], seeded, LONG)
        assert gw.tokens["s"] == sample_ref  # one sample: what the client had, continued
        assert await client.keys(keys.request_record("*")) == []
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        for s in (active, standby):
            if s is not None:
                s.stop()
        worker.stop()
        await client.aclose()
        await gw.client.aclose()


class KeysWithTokenLog(Keys):
    """Keys with the relay's durable token log (the gateway side names it `Keys.token_log`)."""

    def token_log(self, seq_id: str) -> str:
        return f"{self.prefix}:out:{seq_id}"


async def test_a_takeover_resumes_from_the_token_log_when_it_is_ahead_of_the_record(redis_server):
    """The record's confirmed outputs lag a turn behind what the relay logged (and the client has): a
    takeover resumes from the longer of the two, and leaves alone a sequence whose client saw the end."""
    keys = KeysWithTokenLog("tlog")
    r = aioredis.Redis.from_url(redis_server)
    await r.sadd(keys.workers, "w")  # a heartbeat only: plans go to its stream, nobody runs them
    await r.set(keys.worker_heartbeat("w"), WorkerInfo("w", "mixed", "m", 64, 16, 2048, 1, 1.0).to_wire(), px=60_000)
    cases = {  # request id: (record's confirmed outputs, token log events (offset, tokens, finish))
        "ahead": ([5, 6, 7], [(0, [5], None), (1, [6, 7], None), (3, [8], None)]),
        "done": ([5], [(0, [5], None), (1, [6], "stop")]),
        "no-log": ([5, 6], []),
    }
    for rid, (outputs, events) in cases.items():
        req = SubmitRequest(rid, "gw", [1, 2, 3], GREEDY)
        await r.hset(keys.request_record(rid), mapping={"submit": req.to_wire(),
                                                        **{f"o{i}": t for i, t in enumerate(outputs)}})
        for off, toks, finish in events:
            await r.xadd(keys.token_log(rid), {FIELD: msgpack.packb(TokenEvent(rid, off, toks, finish).to_list())},
                         id=f"{off + len(toks)}-0")
    sched = SchedulerService(r, keys, PolicyLimits(max_num_batched_tokens=64), heartbeat_interval=0.1)
    try:
        await sched.acquire_lease()
        await sched.setup()
        policy = sched.workers["w"].policy
        assert policy.outputs_of("ahead") == [5, 6, 7, 8]
        assert policy.outputs_of("no-log") == [5, 6]
        assert not sched.is_known("done") and not await r.exists(keys.request_record("done"))
    finally:
        await sched.release_lease()
        await r.aclose()


async def test_entries_another_consumer_read_and_left_are_claimed(model_dir, reference, redis_server):
    """Entries another consumer read but will never handle (a dead scheduler's, or a deposed one's last
    read) are claimed: at takeover at once, later once idle for two leases; and served."""
    keys = Keys("ghost")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    client, sched, gw, tasks = await start(redis_server, keys, lease_ttl=0.3)
    try:
        await gw.wait(lambda: "w1" in sched.workers, 10)
        sched.stop()  # no active scheduler for a moment: a ghost reads the next submit
        await asyncio.wait_for(tasks[0], 10)
        await gw.submit("r0", PROMPTS[0], MAX_TOKENS)
        taken = await client.xreadgroup(keys.scheduler_group, "ghost", {keys.requests: ">"}, count=10)
        assert sum(len(e) for _s, e in taken) == 1
        sched = SchedulerService(client, keys, PolicyLimits(max_num_batched_tokens=64), heartbeat_interval=0.1,
                                 lease_ttl=0.3)
        tasks[0] = asyncio.create_task(sched.run())  # its takeover claims the ghost's entry (min idle 0)
        await gw.wait(lambda: "r0" in gw.finish, 30)
        # a ghost read while the active one runs: XADD and the ghost's read in one transaction, so the
        # active scheduler (blocked on the stream) is served after it and finds nothing new
        tx = client.pipeline(transaction=True)
        tx.xadd(keys.requests, {FIELD: SubmitRequest("r1", "gw", PROMPTS[1], GREEDY).to_wire()})
        tx.xreadgroup(keys.scheduler_group, "ghost", {keys.requests: ">"}, count=10)
        _entry, ghost_read = await tx.execute()
        assert sum(len(e) for _s, e in ghost_read) == 1
        read_at = time.monotonic()
        await gw.wait(lambda: "r1" in gw.finish, 30)  # claimed once idle for two leases
        assert time.monotonic() - read_at >= 0.6
        assert [gw.tokens[r] for r in ("r0", "r1")] == reference[:2]
        assert (await client.xpending(keys.requests, keys.scheduler_group))["pending"] == 0
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()


def test_timeouts_that_make_no_sense_are_refused_in_one_line(monkeypatch):
    from phaseserve import logs
    from phaseserve.scheduler.service import main as scheduler_main
    from phaseserve.workers.service import main as worker_main

    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # leave the tests' logging as it is

    with pytest.raises(SystemExit, match="--scheduler-lease-ttl must be > 0, got 0.0"):
        scheduler_main(["--redis-url", "redis://127.0.0.1:1", "--scheduler-lease-ttl", "0"])
    with pytest.raises(SystemExit, match="--step-timeout must be > 0, got -1.0"):
        worker_main(["--redis-url", "redis://127.0.0.1:1", "--step-timeout", "-1"])


def test_a_step_s_writes_sent_during_an_outage_arrive_after_it(redis_server):
    """execute() empties a pipeline even when it fails: a relay's step writes caught by an outage must still
    reach Redis once it is back (they were once lost, and clients' streams had a hole). The connection
    breaks inside execute() more times than the client's own retries allow, as when Redis dies mid-write."""
    import redis as redis_sync

    from phaseserve.redis_client import COMMAND_RETRIES, connect, execute_through_outages

    client = connect(redis_server)
    pipe = client.pipeline(transaction=False)
    pipe.xadd("log", {"m": b"token"}, id="9-0")
    pipe.publish("gw", b"batch")
    real, calls = pipe._execute_pipeline, []

    def broken_then_back(conn, stack, raise_on_error):
        calls.append(len(stack))
        if len(calls) <= COMMAND_RETRIES + 2:  # the first execute() gives up; the second one's first try too
            raise redis_sync.ConnectionError("connection reset (injected)")
        return real(conn, stack, raise_on_error)

    pipe._execute_pipeline = broken_then_back
    retries: list = []
    replies = execute_through_outages(pipe, retries.append)
    assert len(retries) == 1 and calls == [2] * len(calls)  # every attempt carried both writes
    assert not any(isinstance(r, Exception) for r in replies)
    assert [e[0] for e in client.xrange("log")] == [b"9-0"]
    client.close()


async def test_plans_of_a_turn_lost_to_an_outage_are_replanned_at_once(model_dir, reference, redis_server):
    """The scheduler's pipeline fails (the connection drops) in a turn that sends plans: they never reach
    the worker. They are given up as soon as Redis answers again, not at the step timeout (30 s here), so
    every stream completes in a few seconds, token for token."""
    import redis as redis_sync

    keys = Keys("voided")
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    # one plan in flight: no later result can reveal the lost one, only its deadline or the outage can
    client, sched, gw, tasks = await start(redis_server, keys, step_timeout=30.0, plans_in_flight=1)
    real_pipeline, failed = client.pipeline, []

    def pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*a, **kw):
            sends_plans = any(c[0][0] == "XADD" and str(c[0][1]).startswith(keys.steps("")) for c in pipe.command_stack)
            if sends_plans and not failed and sched.workers and "r0" in gw.tokens:
                failed.append(True)
                await pipe.reset()
                raise redis_sync.ConnectionError("connection reset (injected)")
            return await real_execute(*a, **kw)

        pipe.execute = execute
        return pipe

    client.pipeline = pipeline
    try:
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, MAX_TOKENS)
        started = time.monotonic()
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS), 10)
        assert failed and sched.num_steps_given_up >= 1
        assert time.monotonic() - started < 10
        assert [gw.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    finally:
        client.pipeline = real_pipeline
        await stop(client, sched, gw, tasks)
        worker.stop()
