"""Prefix caching in the scheduler's block accounting, pure: no Redis, no model. The fake worker of
tests/test_scheduler_policy.py keeps a paged "KV" of (seq, position, token) and checks that every read finds
the right token at the right position and that no block another live sequence holds is ever written."""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest
from test_scheduler_policy import (
    VOCAB, Checker, FakeWorker, assert_idle, assert_reference, assert_references, drive, make_req,
)

from phaseserve.params import SamplingParams
from phaseserve.wire import SubmitRequest
from phaseserve.scheduler.block_manager import BlockManager
from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
from phaseserve.scheduler.prefix_index import block_hashes
from phaseserve.scheduler.recent_prompts import RecentPrompts


def shared_req(rid: str, prefix: list[int], tail_len: int, max_tokens: int = 8, n_tail_seed: str | None = None):
    tail = [zlib.crc32(f"{n_tail_seed or rid}:t{i}".encode()) % VOCAB for i in range(tail_len)]
    return SubmitRequest(rid, "gw0", list(prefix) + tail, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def prefix_tokens(n: int, seed: str = "sys") -> list[int]:
    return [zlib.crc32(f"{seed}:{i}".encode()) % VOCAB for i in range(n)]


def run_one(sched: WorkerPolicy, worker: FakeWorker, req: SubmitRequest) -> list:
    sched.add_request(req)
    return drive(sched, worker)


# ---------------------------------------------------------------------------- hashes and the index


def test_block_hashes_chain_the_prefix():
    a = list(range(40))
    b = a[:21] + [999] + a[22:]  # differs in block 2 (block size 8)
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert len(ha) == 5 and ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert block_hashes(a[:39], 8) == ha[:4]  # the partial block has no name
    assert block_hashes(a, 8, start_block=2, prev=ha[1]) == ha[2:]
    # the same tokens behind another prefix are another block
    assert block_hashes(a[8:16], 8) != [ha[1]]


def test_recent_prompts_say_where_a_similar_prompt_parts():
    recent = RecentPrompts(size=2)
    recent.add("a", [1, 2, 3, 4])
    recent.add("b", [1, 2, 9])
    recent.add("c", [7])  # "a" leaves
    assert recent.most_similar([1, 2, 3, 4, 5]) == ("b", 2, 2)
    long = list(range(100, 400))
    recent.add("d", long)
    # one early token changed: they part at 10 and agree on every other position
    assert recent.most_similar(long[:10] + [0] + long[11:] + [5]) == ("d", 10, 299)
    # one early token became two: the rest agrees a position later
    assert recent.most_similar(long[:10] + [0, 0] + long[11:]) == ("d", 10, 299)


def test_block_manager_shares_counts_idle_cached_blocks_as_free_and_evicts_lru():
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0, enable_prefix_caching=True)
    a = bm.allocate(12)  # 3 blocks
    hashes = block_hashes(list(range(12)), 4)
    for blk, h in zip(a, hashes):
        bm.name(blk, h)
    assert bm.cached_blocks(hashes) == a and bm.num_cached_blocks == 3
    b: list[int] = []
    bm.share(b, a[:2])
    assert [bm.refs(x) for x in a] == [2, 2, 1]
    bm.free(a)
    assert a == [] and bm.num_used_blocks == 2 and bm.num_free_blocks == 4  # the idle cached block is free
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    with pytest.raises(RuntimeError):
        bm.free([hashes and 0])  # nobody holds it: a second release is refused
    # empty blocks go first, then idle cached ones, deepest (least shared) first
    c = bm.allocate(4 * 4)
    assert bm.num_evictions == 1 and bm.cached_blocks(hashes) == bm.cached_blocks(hashes)[:2]
    assert len(bm.cached_blocks(hashes)) == 2
    bm.free(c)
    bm.forget_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 6 and bm.cached_blocks(hashes) == []


# ---------------------------------------------------------------------------- the policy


def test_a_resent_prefix_is_not_prefilled_again_and_gives_the_same_tokens():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_batched_tokens=256, max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(100)
    first = shared_req("t1", system, 5)
    plans = run_one(sched, worker, first)
    assert plans[0].starts[0].num_cached == 0
    assert_idle(sched)
    assert sched.stats().prefix_cache.cached_blocks > 0  # kept after the sequence finished
    # turn 2 resends turn 1 (prompt + answer) and more
    history = first.prompt_ids + worker.published["t1"]
    second = shared_req("t2", history, 7)
    plans = run_one(sched, worker, second)
    start = plans[0].starts[0]
    # every full block of turn 1's prompt + answer but the last answer token's (its KV was never computed)
    assert start.num_cached == (len(history) - 1) // 8 * 8 and start.cached_tokens == start.num_cached
    assert plans[0].chunks[0].start_pos == start.num_cached
    assert_reference(worker, [first, second], cfg.max_model_len)
    st = sched.stats()
    assert st.prefix_cache.hits == start.num_cached
    assert st.prefix_cache.queries == len(first.prompt_ids) + len(second.prompt_ids)


def test_a_fully_cached_prompt_still_computes_its_last_position():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=256)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    prompt = prefix_tokens(16)  # exactly 4 blocks
    a = SubmitRequest("a", "gw0", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    b = SubmitRequest("b", "gw0", list(prompt), SamplingParams(max_tokens=3, temperature=0.0))
    run_one(sched, worker, a)
    plans = run_one(sched, worker, b)
    assert plans[0].starts[0].num_cached == 12 and plans[0].chunks[0].num_tokens == 4
    assert worker.published["a"] == worker.published["b"]


def test_n_choices_prefill_once_and_fork():
    cfg = SchedulerConfig(num_blocks=128, block_size=8, max_num_batched_tokens=512, max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    prompt = prefix_tokens(203)
    reqs = [SubmitRequest(f"r-{i}", "gw0", list(prompt), SamplingParams(max_tokens=6, temperature=0.0))
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    plans = drive(sched, worker)
    starts = [s for p in plans for s in p.starts]
    assert [s.num_cached for s in starts] == [0, 200, 200, 200]
    assert sched.stats().counters.num_prefill_tokens == 203 + 3 * 3
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


@pytest.mark.parametrize("depth", [1, 2])
def test_shared_prefixes_under_preemption_match_the_reference_and_release_every_reference(depth):
    """A small cache, shared system prompts and multi-turn histories: preemptions, evictions, and every
    plan's block references checked (Checker -> assert_references)."""
    rng = random.Random(11 + depth)
    cfg = SchedulerConfig(num_blocks=40, block_size=8, max_num_seqs=10, max_num_batched_tokens=128,
                          max_model_len=320)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    systems = [prefix_tokens(rng.randint(20, 90), seed=f"s{k}") for k in range(3)]
    arrivals: dict[int, list] = {}
    reqs = []
    for i in range(36):
        r = shared_req(f"r{i}", rng.choice(systems), rng.randint(1, 60), max_tokens=rng.randint(1, 30))
        reqs.append(r)
        arrivals.setdefault(rng.randint(0, 120), []).append(r)
    drive(sched, worker, depth=depth, arrivals=arrivals)
    assert sched.stats().counters.num_preemptions > 0  # the pool is small on purpose
    st = sched.stats()
    assert st.prefix_cache.hits > 0 and st.prefix_cache.evictions > 0
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


def test_cancel_and_preempt_release_each_reference_once():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=256)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(40)
    run_one(sched, worker, shared_req("warm", system, 2, max_tokens=2))
    reqs = [shared_req(f"c{i}", system, 30, max_tokens=40) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    inflight = sched.schedule()
    nxt = sched.schedule()  # two plans in flight when a sharer is cancelled and another preempted
    shared = sched.queues.seqs["c0"].block_table[:10]
    assert all(sched.kv.block_manager.refs(b) == 4 for b in shared)
    sched.cancel("c1")
    sched.steps.preempt(sched.queues.seqs["c2"])
    assert all(sched.kv.block_manager.refs(b) == 2 for b in shared)
    assert_references(sched)
    assert not sched.cancel("c1")  # a second cancel releases nothing
    for plan in (inflight, nxt):
        sched.update(worker.run(plan))
    sched.cancel("c0")
    sched.cancel("c3")
    assert_references(sched)
    drive(sched, worker)
    assert_idle(sched)
    assert sched.kv.stats().cached_blocks >= 10  # the system prompt stays cached


def test_blocks_of_a_lost_step_are_never_shared():
    """A block is named when a result confirms it: a lost plan's blocks were maybe never written."""
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_batched_tokens=512, max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg, strict=False)
    system = prefix_tokens(64)
    sched.add_request(shared_req("a", system, 5))
    lost = sched.schedule()
    assert lost.chunks[0].num_tokens == 69
    sched.drop_step(lost.step_id)  # its plan never reached the worker
    assert sched.kv.stats().cached_blocks == 0
    sched.add_request(shared_req("b", system, 5))
    plans = drive(sched, worker)
    # one of them computes the prompt from scratch (the lost plan's blocks are not cached), the other starts
    # on its blocks once a result confirmed them (the fake worker's reads would find never-written KV else)
    starts = sorted((i, s.num_cached) for i, p in enumerate(plans) for s in p.starts)
    assert starts[0] == (0, 0) and starts[1][0] > 0 and starts[1][1] == 64
    assert_reference(worker, [shared_req("a", system, 5), shared_req("b", system, 5)], cfg.max_model_len)


def test_a_cached_block_in_use_by_a_plan_in_flight_is_never_evicted():
    """Blocks a running sequence shares are referenced, so only idle ones are evicted, and those only for a
    later plan; the fake worker's KV reads check the contents of every shared block."""
    cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=48, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(20)
    run_one(sched, worker, shared_req("a", system, 1, max_tokens=2))
    assert sched.num_free_blocks == 12 and sched.kv.stats().cached_blocks == 5
    sched.add_request(shared_req("b", system, 1, max_tokens=12))
    sched.add_request(make_req("big", 28, max_tokens=2))  # needs blocks only evicting can give
    plans = drive(sched, worker, depth=2)
    assert plans[0].starts[0].num_cached == 20
    assert sched.kv.stats().evictions > 0
    assert_idle(sched)


def test_cached_blocks_count_as_free_for_admission_and_stats():
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=128,
                          watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    run_one(sched, worker, make_req("a", 40, max_tokens=2))
    st = sched.stats()
    assert st.prefix_cache.cached_blocks == 10 and st.num_free_blocks == 16 and st.num_used_blocks == 0
    whole = make_req("whole", 60, max_tokens=4)  # every block of the cache
    run_one(sched, worker, whole)
    assert_reference(worker, [whole], cfg.max_model_len)
    assert sched.stats().prefix_cache.evictions == 10


def test_prefix_caching_off_shares_nothing():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_batched_tokens=256, max_model_len=512,
                          enable_prefix_caching=False)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(100)
    run_one(sched, worker, shared_req("a", system, 3))
    plans = run_one(sched, worker, shared_req("b", system, 3))
    assert plans[0].starts[0].num_cached == 0
    st = sched.stats()
    assert st.prefix_cache.cached_blocks == st.prefix_cache.hits == 0


def test_cached_prefix_length_for_routing():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_batched_tokens=256, max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(50)
    assert sched.num_cached_tokens(system + [1, 2, 3]) == 0
    run_one(sched, worker, shared_req("a", system, 3))
    assert sched.num_cached_tokens(system + [1, 2, 3]) == 48
    assert sched.num_cached_tokens(system[:20]) == 16
    assert sched.num_cached_tokens([7] + system) == 0


def test_a_long_prompt_mostly_cached_is_a_short_prefill():
    """The long-prompt cap (one long prefill's worth of a step) counts the positions a prefill computes: chats
    resending a long cached history with a short question each start together instead of one a step."""
    cfg = SchedulerConfig(num_blocks=256, block_size=8, max_num_batched_tokens=512, max_model_len=1024,
                          long_prefill_threshold=64)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    system = prefix_tokens(400)
    run_one(sched, worker, shared_req("warm", system, 3))
    for i in range(4):
        sched.add_request(shared_req(f"chat{i}", system, 30))
    plan = sched.schedule()
    assert len(plan.starts) == 4 and all(s.num_cached == 400 for s in plan.starts)
    assert sorted(c.num_tokens for c in plan.chunks) == [30] * 4  # every question in the first step
