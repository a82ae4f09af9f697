"""The scheduling policy, step by step, with no Redis and no model.

A fake worker runs each StepPlan the way workers/runner.py does (releases,
then starts, then chunks; samples when a chunk reaches the end of the known
tokens; skips sequences it knows are finished), on a "model" whose next token
is a hash of the last tokens it reads back from a simulated paged KV cache.
So a block handed to two live sequences, a chunk that skips positions, or a
recompute that starts from the wrong tokens all change the output tokens or
trip an assertion, and every run is compared with a plain reference loop.
The fake worker also plays the gateway: it records every published token by
offset and checks that a stream never has a gap or a repeat, and that the
SeqStart of a recomputed sequence carries exactly what was published.
"""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from array import array
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import msgpack
import pytest

from phaseserve.params import SamplingParams, finish_reason
from phaseserve.settings import bundled_model_path
from phaseserve.wire import (ERROR_REJECTED, PROTOCOL_VERSION, StepPlan, StepResult, SubmitRequest, TokenBatch,
                             TokenEvent, WorkerInfo)
from phaseserve.scheduler.block_manager import BlockManager
from phaseserve.kv_admission import KVCapacity
from phaseserve.scheduler.budget import chunk_cost, max_chunk_tokens
from phaseserve.scheduler.policy import AdmissionError, SchedulerConfig, WorkerPolicy
from phaseserve.workers.loader import read_config
from phaseserve.workers.attention_horizon import ATTENTION_EFFICIENCY
from phaseserve.workers.attention_horizon import attention_horizon as runner_attention_horizon

VOCAB = 50_000


def next_token(ctx: list[int]) -> int:
    """The fake model: a function of the context length and its last 8 tokens."""
    return zlib.crc32(array("q", ctx[-8:]).tobytes() + len(ctx).to_bytes(4, "little")) % VOCAB


def make_req(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, stop: tuple = ()) -> SubmitRequest:
    prompt = [zlib.crc32(f"{rid}:{i}".encode()) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop))
    return SubmitRequest(rid, "gw0", prompt, params, priority=priority)


def reference(req: SubmitRequest, max_model_len: int) -> tuple[list[int], str]:
    """What an unscheduled, unpreempted run of the fake model generates."""
    ctx = list(req.prompt_ids)
    out: list[int] = []
    while True:
        tok = next_token(ctx)
        ctx.append(tok)
        out.append(tok)
        reason = finish_reason(req.params, tok, len(out), len(ctx), frozenset(), max_model_len)
        if reason:
            return out, reason


@dataclass
class WorkerSeq:
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    computed: int = 0
    finished: bool = False
    table: list[int] = field(default_factory=list)
    unprepared_steps: int = 0  # steps its preparation (a grammar matcher) still takes: it sits out sampling chunks
    sat_out: bool = False


class FakeWorker:
    def __init__(self, cfg: SchedulerConfig, published: dict | None = None, strict: bool = True,
                 prepare_steps: dict[str, int] | None = None):
        self.cfg = cfg
        self.prepare_steps = prepare_steps or {}  # seq id -> steps its preparation takes after each start
        self.kv = [[None] * cfg.block_size for _ in range(cfg.num_blocks)]
        self.seqs: dict[str, WorkerSeq] = {}
        self.published = published if published is not None else {}  # the gateway: seq -> tokens by offset
        self.finish: dict[str, str] = {}
        self.strict = strict
        self.skipped = 0
        self.sat_out = 0  # sampling chunks run as the runner does while a preparation is not ready
        self.recompute_starts: list = []

    def _read(self, table: list[int], pos: int, seq_id: str) -> int:
        # a cached prefix is another sequence's KV: what must match is the position (the token is checked
        # against the sequence's own by the caller)
        entry = self.kv[table[pos // self.cfg.block_size]][pos % self.cfg.block_size]
        assert entry is not None and entry[1] == pos, f"KV of {seq_id}@{pos} overwritten: {entry}"
        return entry[2]

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.cfg.block_size
        for rid in plan.releases:
            self.seqs.pop(rid, None)
        for s in plan.starts:
            assert s.seq_id not in plan.releases, "a start and a release of one id in one plan is ambiguous"
            pub = self.published.setdefault(s.seq_id, [])
            if self.strict:  # a recompute continues exactly where the client's stream is
                assert s.output_ids == pub, (s.seq_id, len(s.output_ids), len(pub))
            if s.output_ids:
                self.recompute_starts.append((plan.step_id, s.seq_id, list(s.output_ids)))
            self.seqs[s.seq_id] = WorkerSeq(len(s.prompt_ids), list(s.prompt_ids) + list(s.output_ids), s.params,
                                            computed=s.num_cached,
                                            unprepared_steps=self.prepare_steps.get(s.seq_id, 0))
        events = []
        deferred = {}
        for c in plan.chunks:
            w = self.seqs.get(c.seq_id)
            if w is None or w.finished:
                self.skipped += 1  # planned a step ahead of a finish, or already released
                continue
            end = c.start_pos + c.num_tokens
            if w.unprepared_steps and end >= len(w.tokens):  # a sampling chunk with no matcher yet: sits out
                deferred[c.seq_id] = w.computed
                self.sat_out += 1
                w.sat_out = True
                continue
            if c.start_pos > w.computed and w.sat_out:  # planned before its sit-out was known: moot
                self.skipped += 1
                continue
            assert c.start_pos == w.computed and c.num_tokens >= 1, (c, w.computed)
            assert end <= len(w.tokens), (c, len(w.tokens))
            # after a sit-out its table keeps the blocks its moot plans were given
            assert len(c.block_table) == -(-end // bs) or w.sat_out and len(c.block_table) > -(-end // bs), (c, end)
            w.table = list(c.block_table)
            written = {c.block_table[p // bs] for p in range(c.start_pos, end)}
            for other_id, other in self.seqs.items():  # a shared (cached) block is never written
                if other_id != c.seq_id and not other.finished:
                    assert not written & set(other.table), (c, other_id, other.table)
            for p in range(c.start_pos, end):
                self.kv[c.block_table[p // bs]][p % bs] = (c.seq_id, p, w.tokens[p])
            w.computed = end
            if end < len(w.tokens):
                continue
            # "attention" reads the whole prefix back from the paged cache
            ctx = [self._read(c.block_table, p, c.seq_id) for p in range(end)]
            assert ctx == w.tokens
            tok = next_token(ctx)
            offset = len(w.tokens) - w.prompt_len
            w.tokens.append(tok)
            reason = finish_reason(w.params, tok, offset + 1, len(w.tokens), frozenset(), self.cfg.max_model_len)
            w.finished = reason is not None
            pub = self.published.setdefault(c.seq_id, [])
            if offset < len(pub):
                assert not self.strict, f"{c.seq_id}: offset {offset} published twice"
                assert pub[offset] == tok
            else:
                assert offset == len(pub), f"{c.seq_id}: gap before offset {offset}"
                pub.append(tok)
            if reason:
                self.finish[c.seq_id] = reason
            events.append(TokenEvent(c.seq_id, offset, [tok], reason))
        for w in self.seqs.values():
            w.unprepared_steps = max(0, w.unprepared_steps - 1)
        return StepResult(plan.step_id, plan.worker_id, events, plan.num_tokens, deferred=deferred)


class Checker:
    """Invariants every plan must satisfy."""

    def __init__(self, sched: WorkerPolicy):
        self.sched = sched
        # prefill length of each sequence's current incarnation (those started before this driver too)
        self.prefill_len: dict[str, int] = {q.seq_id: q.prefill_len for q in sched.queues.running}
        self.num_cached: dict[str, int] = {}  # positions each start found in the prefix cache

    def check(self, plan: StepPlan) -> None:
        s, cfg = self.sched, self.sched.config
        for st in plan.starts:
            self.prefill_len[st.seq_id] = len(st.prompt_ids) + len(st.output_ids)
            self.num_cached[st.seq_id] = st.num_cached
            assert st.num_cached < self.prefill_len[st.seq_id], "the last prefill position is always computed"
        ids = [c.seq_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a sequence twice in one plan"
        assert len(ids) <= cfg.max_num_seqs
        kinds = ["d" if c.start_pos >= self.prefill_len[c.seq_id] else "p" for c in plan.chunks]
        assert "".join(kinds) == "d" * kinds.count("d") + "p" * kinds.count("p"), "decodes must come first"
        for c, k in zip(plan.chunks, kinds):
            assert k == "p" or c.num_tokens == 1
        writer: dict[int, str] = {}
        bs = cfg.block_size
        for c in plan.chunks:
            need = -(-(c.start_pos + c.num_tokens) // bs)
            # a sequence planned again after sitting out keeps the blocks given to its moot plans
            assert len(c.block_table) == need or len(c.block_table) > need and s.queues.seqs[c.seq_id].void_until >= 0
            for b in c.block_table:
                assert 0 <= b < cfg.num_blocks
            for b in c.block_table[c.start_pos // bs:]:  # the blocks it writes are its own
                assert writer.setdefault(b, c.seq_id) == c.seq_id, f"block {b} written by two sequences"
        for c in plan.chunks:  # and no other sequence's table holds them (a shared block is read-only)
            for b in c.block_table[:c.start_pos // bs]:
                assert writer.get(b, c.seq_id) == c.seq_id, f"block {b} read by {c.seq_id}, written by {writer[b]}"
        prefills = [c for c, k in zip(plan.chunks, kinds) if k == "p"]
        if cfg.enable_chunked_prefill:
            # over budget only through decodes (never dropped) and the one token that the head of the
            # queue, or an otherwise empty step, always gets
            cost = plan_cost(plan, cfg.attention_horizon)
            assert cost <= cfg.max_num_batched_tokens + 1e-9 or [c.num_tokens for c in prefills] in ([], [1]), \
                (cost, plan.chunks)
            if cfg.attention_horizon == 0:
                assert plan.num_tokens <= cfg.max_num_batched_tokens
        else:  # whole prompts only; only a step's single prefill may take it over the budget
            assert all(c.start_pos == self.num_cached.get(c.seq_id, 0)
                       and c.start_pos + c.num_tokens == self.prefill_len[c.seq_id] for c in prefills)
            assert plan.num_tokens <= cfg.max_num_batched_tokens or len(prefills) == 1
        assert s.num_running <= cfg.max_num_seqs
        assert s.num_used_blocks + s.num_free_blocks == cfg.num_blocks
        assert_references(s)


def assert_references(s: WorkerPolicy) -> None:
    """Every block's reference count is the number of running tables holding it: no reference is dropped
    twice or leaked (cached blocks nobody holds count as free)."""
    held = Counter(b for q in s.queues.running for b in q.block_table)
    assert s.num_used_blocks == len(held)
    assert all(s.kv.block_manager.refs(b) == n for b, n in held.items()), held


def plan_cost(plan: StepPlan, horizon: int) -> float:
    """Budget units of a plan, summed token by token (independent of chunk_cost's closed form)."""
    if horizon == 0:
        return plan.num_tokens
    return sum(1 + (p + 1) / horizon for c in plan.chunks for p in range(c.start_pos, c.start_pos + c.num_tokens))


def drive(sched: WorkerPolicy, worker: FakeWorker, *, depth: int = 1, arrivals: dict | None = None,
          max_iters: int = 5000, on_plan=None, stop_after: int | None = None) -> list[StepPlan]:
    """Run to idle. depth=2: schedule() for step N+1 is called before update() for step N."""
    arrivals = dict(arrivals or {})
    checker = Checker(sched)
    inflight: deque[StepPlan] = deque()
    plans: list[StepPlan] = []
    for i in range(max_iters):
        for req in arrivals.pop(i, []):
            sched.add_request(req)
        plan = None if stop_after is not None and len(plans) >= stop_after else sched.schedule()
        if plan is not None:
            checker.check(plan)
            plans.append(plan)
            inflight.append(plan)
            if on_plan:
                on_plan(len(plans) - 1, plan)
        elif not inflight and (stop_after is not None or not (sched.has_unfinished() or arrivals)):
            st = sched.stats()  # idle (or stopped early with every planned step run and applied)
            assert st.num_steps_in_flight == 0
            if worker.strict:  # a clean run never produces a result the scheduler has to ignore
                assert st.counters.num_ignored_results == st.counters.num_ignored_events == st.counters.num_resyncs == 0, st
            return plans
        if inflight and (len(inflight) >= depth or plan is None):
            sched.update(worker.run(inflight.popleft()))
    raise AssertionError(f"not idle after {max_iters} iterations: {sched.stats()}")


def assert_idle(sched: WorkerPolicy) -> None:
    assert not sched.has_unfinished()
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.num_free_blocks == sched.config.num_blocks and sched.num_used_blocks == 0
    assert sched.schedule() is None


def assert_reference(worker: FakeWorker, reqs: list[SubmitRequest], max_model_len: int) -> None:
    for r in reqs:
        out, reason = reference(r, max_model_len)
        assert worker.published[r.request_id] == out, r.request_id
        assert worker.finish[r.request_id] == reason, r.request_id


# ---------------------------------------------------------------------------- block manager


def test_block_manager_allocate_append_free_watermark():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.2)
    assert bm.watermark_blocks == 2
    table = bm.allocate(5)  # positions 0..4 -> 2 blocks
    assert len(table) == 2 and bm.num_free_blocks == 8 and bm.num_used_blocks == 2
    assert bm.append(table, 5, 3) == []  # 8 positions still fit in 2 blocks
    added = bm.append(table, 8, 1)
    assert len(added) == 1 and len(table) == 3
    assert bm.can_allocate(5) and not bm.can_allocate(6)  # 7 free, 2 kept by the watermark
    assert bm.can_allocate(7, use_watermark=False)
    assert not bm.can_allocate(4, reserved=2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append(table, 12, 4 * 8)
    assert len(table) == 3, "a failed append must not leave a partial table"
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free([added[0]])
    assert 0 in bm.allocate(40)  # block 0 is an ordinary block


# ---------------------------------------------------------------------------- (1) decode first


@pytest.mark.parametrize("depth", [1, 2])
def test_long_prompt_never_displaces_decodes_and_is_chunked(depth):
    cfg = SchedulerConfig(num_blocks=256, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          long_prefill_threshold=0)  # the budget alone (cap: tests below)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    shorts = [make_req(f"d{i}", 8, max_tokens=40) for i in range(16)]
    long = make_req("long", 2048, max_tokens=4)
    long_chunks: list = []
    decodes_per_plan: list[int] = []

    def on_plan(idx, plan):
        mine = [c for c in plan.chunks if c.seq_id == "long"]
        long_chunks.extend(mine)
        if mine and mine[0].start_pos + mine[0].num_tokens <= 2048 and mine[0].num_tokens > 1:
            decodes_per_plan.append(sum(1 for c in plan.chunks if c.seq_id.startswith("d")))
            assert plan.chunks[-1].seq_id == "long"  # decodes first
            assert plan.num_tokens <= 512
            assert mine[0].num_tokens <= 512 - 16

    drive(sched, worker, depth=depth, arrivals={0: shorts, 3: [long]}, on_plan=on_plan)
    prefill = [c for c in long_chunks if c.start_pos < 2048]
    assert [c.num_tokens for c in prefill] == [496, 496, 496, 496, 64]  # budget minus the 16 decodes
    assert [c.start_pos for c in prefill] == [0, 496, 992, 1488, 1984]
    assert decodes_per_plan == [16] * 5, "every decode stays in every step of the long prefill"
    assert_reference(worker, shorts + [long], cfg.max_model_len)
    assert sched.stats().counters.num_preemptions == 0
    assert_idle(sched)


# ---------------------------------------------------------------------------- (2) no starvation


@pytest.mark.parametrize("depth", [1, 2])
def test_short_prompt_behind_long_one_starts_on_the_next_plan(depth):
    cfg = SchedulerConfig(num_blocks=200, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          long_prefill_threshold=0)  # the budget alone (cap: tests below)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    long, short = make_req("long", 2048, max_tokens=2), make_req("short", 10, max_tokens=2)
    first_plan: dict[str, int] = {}
    prefill_done: dict[str, int] = {}

    def on_plan(idx, plan):
        for c in plan.chunks:
            first_plan.setdefault(c.seq_id, idx)
            if c.start_pos + c.num_tokens == len({"long": long, "short": short}[c.seq_id].prompt_ids):
                prefill_done[c.seq_id] = idx
        if idx == 1:
            assert {c.seq_id: c.num_tokens for c in plan.chunks} == {"long": 502, "short": 10}

    drive(sched, worker, depth=depth, arrivals={0: [long], 1: [short]}, on_plan=on_plan)
    assert first_plan == {"long": 0, "short": 1}  # the short one arrived just before plan 1
    assert prefill_done["short"] == 1 and prefill_done["long"] == 4
    assert_reference(worker, [long, short], cfg.max_model_len)
    assert_idle(sched)


def test_waiting_sequence_starts_within_k_plus_one_plans():
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          long_prefill_threshold=0)  # the budget alone (cap: tests below)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req("L1", 2048, 2), make_req("L2", 2048, 2), make_req("L3", 2048, 2), make_req("S", 10, 2)]
    first: dict[str, int] = {}
    drive(sched, worker, arrivals={0: reqs}, on_plan=lambda i, p: [first.setdefault(c.seq_id, i) for c in p.chunks])
    assert first == {"L1": 0, "L2": 1, "L3": 2, "S": 3}  # k sequences ahead -> starts in plan k
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


# ---------------------------------------------------------------------------- (3) preemption


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_preemption_by_recompute_gives_the_same_tokens(depth):
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=128, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req(f"s{i}", 5 + i, max_tokens=20) for i in range(6)]
    drive(sched, worker, depth=depth, arrivals={0: reqs})
    assert sched.stats().counters.num_preemptions > 0
    assert worker.recompute_starts, "a preempted sequence must be re-prefilled over prompt + outputs"
    for step_id, rid, outputs in worker.recompute_starts:
        ref, _ = reference(next(r for r in reqs if r.request_id == rid), cfg.max_model_len)
        assert outputs == ref[:len(outputs)]  # and FakeWorker checked: == everything published so far
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


def test_victim_is_lowest_priority_then_latest_arrival():
    cfg = SchedulerConfig(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, watermark=0.0)
    for prios, victim in (((0, 0, 0), "c"), ((5, 0, 0), "a")):
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        reqs = [make_req(n, 3, max_tokens=12, priority=p) for n, p in zip("abc", prios)]
        for r in reqs:
            sched.add_request(r)
        while True:
            plan = sched.schedule()
            if sched.stats().counters.num_preemptions:
                break
            sched.update(worker.run(plan))
        assert sched.stats().counters.num_preemptions == 1 and plan.releases == [victim]
        assert victim not in {c.seq_id for c in plan.chunks}, "the victim is not planned"
        sched.update(worker.run(plan))
        drive(sched, worker)
        assert_reference(worker, reqs, cfg.max_model_len)
        assert_idle(sched)


def test_no_admission_in_a_step_that_preempted():
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=64, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    a, c, d = make_req("a", 4, max_tokens=20), make_req("c", 24, max_tokens=5), make_req("d", 2, max_tokens=2)
    for r in (a, c, d):
        sched.add_request(r)
    p0 = sched.schedule()
    assert [(x.seq_id, x.num_tokens) for x in p0.chunks] == [("a", 4), ("c", 24)]  # 7 of 8 blocks
    sched.update(worker.run(p0))
    p1 = sched.schedule()  # a's decode takes the last block; c's decode needs one: c (latest) is preempted
    assert sched.stats().counters.num_preemptions == 1 and p1.releases == ["c"]
    assert [x.seq_id for x in p1.chunks] == ["a"] and p1.starts == [], "d must not slip in behind a preemption"
    sched.update(worker.run(p1))
    drive(sched, worker)
    assert_reference(worker, [a, c, d], cfg.max_model_len)
    assert_idle(sched)


@pytest.mark.parametrize("watermark", [0.0, 0.1])
def test_admission_keeps_the_watermark_free(watermark):
    cfg = SchedulerConfig(num_blocks=100, block_size=4, max_num_batched_tokens=512, max_model_len=1024,
                          watermark=watermark)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    big, small = make_req("big", 316, max_tokens=3), make_req("small", 56, max_tokens=3)  # 80 and 15 blocks
    plans = drive(sched, worker, arrivals={0: [big, small]})
    starts = {s.seq_id: i for i, p in enumerate(plans) for s in p.starts}
    last_big = max(i for i, p in enumerate(plans) if any(c.seq_id == "big" for c in p.chunks))
    if watermark:  # 100 - 80 - 15 < 10 kept free: small waits until big is done
        assert starts["small"] > last_big
    else:
        assert starts == {"big": 0, "small": 0}
    assert_reference(worker, [big, small], cfg.max_model_len)
    assert_idle(sched)


def test_partial_prefills_never_deadlock_on_blocks():
    # no decodes at all (max_tokens <= 2), long prompts, a pool that holds only a few of them: without the
    # blocks promised to partially-prefilled sequences, several partial prefills fill the pool and all stall
    for seed in range(40):
        rng = random.Random(seed)
        cfg = SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=16,
                              max_model_len=200, watermark=0.0)
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        reqs = [make_req(f"r{i}", rng.randint(10, 80), max_tokens=rng.randint(1, 2)) for i in range(8)]
        arrivals: dict[int, list] = {}
        for r in reqs:
            arrivals.setdefault(rng.randint(0, 10), []).append(r)
        drive(sched, worker, arrivals=arrivals, max_iters=500)
        assert_reference(worker, reqs, cfg.max_model_len)
        assert_idle(sched)


# ---------------------------------------------------------------------------- (4) idle


def test_all_blocks_free_after_cancels():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=100,
                          max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req(f"c{i}", 60, max_tokens=50) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    inflight = sched.schedule()
    for _ in range(2):  # two plans in flight when the cancels come
        nxt = sched.schedule()
        sched.update(worker.run(inflight))
        inflight = nxt
    assert sched.num_running == 4 and sched.num_waiting == 2 and sched.num_used_blocks > 0
    on_worker = set(worker.seqs)
    assert all(sched.cancel(r.request_id) for r in reqs)
    assert not sched.cancel("c0") and not sched.cancel("nope")
    assert sched.num_free_blocks == 64 and not sched.has_unfinished()
    assert sched.update(worker.run(inflight)) == []  # results of cancelled sequences are ignored
    plan = sched.schedule()
    assert plan.chunks == [] and plan.starts == [] and set(plan.releases) == on_worker
    worker.run(plan)
    assert worker.seqs == {}
    assert_idle(sched)
    assert sched.stats().counters.num_cancelled == 6


# ---------------------------------------------------------------------------- pipelining


def test_pipelined_plans_decode_before_the_result_and_tolerate_late_finishes():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    ref, _ = reference(make_req("stop", 6, max_tokens=10), cfg.max_model_len)
    assert ref[3] not in ref[:3]
    stopper = make_req("stop", 6, max_tokens=10, stop=(ref[3],))
    capped = make_req("cap", 5, max_tokens=3)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    sched.add_request(stopper)
    sched.add_request(capped)
    p0 = sched.schedule()
    p1 = sched.schedule()  # before update(p0): the worker holds the tokens p0 samples
    assert {(c.seq_id, c.start_pos, c.num_tokens) for c in p1.chunks} == {("stop", 6, 1), ("cap", 5, 1)}
    assert [s.seq_id for s in p0.starts] == ["stop", "cap"] and p1.starts == []
    plans = [p0, p1]
    inflight = deque([p0, p1])
    finished = []
    while inflight:
        finished += sched.update(worker.run(inflight.popleft()))
        plan = sched.schedule()
        if plan is not None:
            plans.append(plan)
            inflight.append(plan)
    assert sorted(finished) == ["cap", "stop"]
    assert_reference(worker, [stopper, capped], cfg.max_model_len)
    assert worker.published["stop"] == ref[:4]
    samples = {rid: sum(1 for p in plans for c in p.chunks if c.seq_id == rid) for rid in ("stop", "cap")}
    assert samples["cap"] == 3, "no decode is planned past max_tokens"
    assert samples["stop"] == 5 and worker.skipped == 1, "one extra decode after a stop token, skipped"
    assert sorted(r for p in plans for r in p.releases) == ["cap", "stop"]
    assert_idle(sched)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_sequence_whose_preparation_is_not_ready_sits_out_and_is_planned_again_not_recomputed(depth):
    """The worker sits a sequence out while its grammar matcher builds (StepResult.deferred, the position it
    holds it at): the scheduler plans it again from there, without a recompute or a resync, the plans it had
    in flight for it are moot, and the other streams decode every step meanwhile."""
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    reqs = [make_req("a", 5, max_tokens=14), make_req("slow", 40, max_tokens=6), make_req("b", 3, max_tokens=14)]
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg, prepare_steps={"slow": 7})
    plans = drive(sched, worker, depth=depth, arrivals={0: reqs})
    assert_reference(worker, reqs, cfg.max_model_len)
    assert worker.sat_out >= 3 and sched.stats().counters.num_sat_out >= 3
    assert worker.recompute_starts == [] and sched.stats().counters.num_preemptions == 0
    assert sum(st.seq_id == "slow" for p in plans for st in p.starts) == 1  # started once: its build goes on
    # its prefill's first chunk ran beside the others; only the chunk that samples waited for the matcher
    slow = [c for p in plans for c in p.chunks if c.seq_id == "slow"]
    assert slow[0].start_pos == 0 and slow[0].num_tokens < 40
    # a and b decode in every plan from their first token to their last: the sit-out stalls nobody
    for rid in ("a", "b"):
        steps = [i for i, p in enumerate(plans) if any(c.seq_id == rid for c in p.chunks)]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
    assert_idle(sched)


def test_update_ignores_unknown_duplicate_and_stale_results():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg, strict=False)
    a = make_req("a", 6, max_tokens=6)
    sched.add_request(a)
    p0 = sched.schedule()
    res = worker.run(p0)
    assert sched.update(StepResult(99, "local", res.events)) == []  # a step never planned
    bad = StepResult(p0.step_id, "local", [TokenEvent("a", 1, res.events[0].token_ids)])
    sched.update(bad)  # wrong offset: ignored, and the sequence is recomputed from what is confirmed
    assert sched.stats().counters.num_resyncs == 1 and sched.num_waiting == 1 and sched.num_free_blocks == 32
    assert sched.update(res) == []  # that step is already settled
    plan = sched.schedule()  # the restart waits until the worker has been told to drop the old state
    assert plan.releases == ["a"] and plan.starts == [] and plan.chunks == []
    assert sched.update(worker.run(plan)) == []
    drive(sched, worker)
    assert worker.published["a"] == reference(a, cfg.max_model_len)[0]
    assert sched.stats().counters.num_ignored_results == 2 and sched.stats().counters.num_ignored_events == 1
    assert_idle(sched)


def test_cancel_then_readd_same_id_is_a_new_sequence():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg, strict=False)
    a = make_req("a", 6, max_tokens=5)
    sched.add_request(a)
    p0 = sched.schedule()
    assert sched.cancel("a")
    sched.add_request(a)
    p1 = sched.schedule()
    assert p1.releases == ["a"] and p1.starts == [] and p1.chunks == []  # start waits for the release
    assert sched.update(worker.run(p0)) == []  # the old incarnation's token is not the new one's
    assert sched.update(worker.run(p1)) == []
    p2 = sched.schedule()
    assert [(s.seq_id, s.output_ids) for s in p2.starts] == [("a", [])]
    sched.update(worker.run(p2))
    drive(sched, worker)
    assert worker.published["a"] == reference(a, cfg.max_model_len)[0]
    assert_idle(sched)


# ---------------------------------------------------------------------------- limits and order


def test_priority_then_arrival_order():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=128,
                          max_model_len=512)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req("a", 100, 2), make_req("b", 100, 2), make_req("urgent", 100, 2, priority=-1)]
    order: list[str] = []
    drive(sched, worker, arrivals={0: reqs},
          on_plan=lambda i, p: [order.append(s.seq_id) for s in p.starts])
    assert order == ["urgent", "a", "b"]
    assert_reference(worker, reqs, cfg.max_model_len)


def test_max_num_seqs_bounds_running_sequences():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=3, max_num_batched_tokens=64,
                          max_model_len=256)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req(f"m{i}", 4, max_tokens=5 + i) for i in range(7)]
    peak = []
    plans = drive(sched, worker, arrivals={0: reqs}, on_plan=lambda i, p: peak.append(sched.num_running))
    assert max(peak) == 3 and max(len(p.chunks) for p in plans) == 3
    assert [s.seq_id for p in plans for s in p.starts] == [r.request_id for r in reqs]  # FCFS
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


@pytest.mark.parametrize("threshold", [0, 48])
@pytest.mark.parametrize("horizon", [0, 100])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_random_load_never_exceeds_budget_and_matches_reference(depth, chunked, horizon, threshold):
    rng = random.Random(7 + depth)
    cfg = SchedulerConfig(num_blocks=48, block_size=8, max_num_seqs=12, max_num_batched_tokens=128,
                          max_model_len=320, enable_chunked_prefill=chunked, attention_horizon=horizon,
                          long_prefill_threshold=threshold)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    arrivals: dict[int, list] = {}
    reqs = []
    for i in range(40):
        r = make_req(f"r{i}", rng.randint(1, 250), max_tokens=rng.randint(1, 40), priority=rng.choice([0, 0, 1]))
        reqs.append(r)
        arrivals.setdefault(rng.randint(0, 150), []).append(r)
    drive(sched, worker, depth=depth, arrivals=arrivals)
    assert sched.stats().counters.num_preemptions > 0  # the pool is small on purpose
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)
    st = sched.stats()
    assert st.counters.num_finished == 40 and st.counters.num_resyncs == 0


def test_chunked_prefill_off_schedules_whole_prompts():
    cfg = SchedulerConfig(num_blocks=128, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=512, enable_chunked_prefill=False)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    a, b = make_req("a", 40, max_tokens=30), make_req("b", 40, max_tokens=30)
    big = make_req("big", 200, max_tokens=3)
    plans = drive(sched, worker, arrivals={0: [a, b], 4: [big]})
    shape = [sorted((c.seq_id, c.num_tokens) for c in p.chunks) for p in plans]
    assert shape[0] == [("a", 40)]  # b does not fit beside a: it waits, it is not split
    assert shape[1] == [("a", 1), ("b", 40)]
    assert shape[4] == [("a", 1), ("b", 1), ("big", 200)]  # alone among prefills it may exceed the budget
    assert plans[4].num_tokens == 202
    for p in plans:
        prefills = [c for c in p.chunks if c.start_pos == 0]
        assert all(c.num_tokens == len({"a": a, "b": b, "big": big}[c.seq_id].prompt_ids) for c in prefills)
        if len(prefills) != 1:
            assert p.num_tokens <= 64  # only a lone prefill may exceed the budget
    assert_reference(worker, [a, b, big], cfg.max_model_len)
    assert_idle(sched)


# ---------------------------------------------------------------------------- migration


def test_take_all_moves_unfinished_sequences_to_another_scheduler():
    cfg = SchedulerConfig(num_blocks=40, block_size=8, max_num_seqs=3, max_num_batched_tokens=64,
                          max_model_len=256)
    published: dict = {}
    sched, worker = WorkerPolicy(cfg, "w1"), FakeWorker(cfg, published)
    reqs = [make_req(f"t{i}", 30, max_tokens=12) for i in range(5)]
    drive(sched, worker, depth=2, arrivals={0: reqs}, stop_after=4)
    taken = sched.take_all()
    assert [r.request_id for r, _ in taken] == [r.request_id for r in reqs]  # arrival order
    assert any(outs for _, outs in taken) and any(not outs for _, outs in taken)
    for r, outs in taken:
        assert outs == reference(r, cfg.max_model_len)[0][:len(outs)] == published.get(r.request_id, [])
    assert len(taken) == 5 and not sched.has_unfinished() and sched.num_free_blocks == 40
    plan = sched.schedule()
    assert plan is not None and plan.chunks == [] and set(plan.releases) == {"t0", "t1", "t2"}
    assert sched.schedule() is None

    other, worker2 = WorkerPolicy(cfg, "w2"), FakeWorker(cfg, published)  # same gateway record
    for r, outs in taken:
        other.add_request(r, outs)
    drive(other, worker2)
    assert {rid for _, rid, _ in worker2.recompute_starts} == {r.request_id for r, o in taken if o}
    assert_reference(worker2, reqs, cfg.max_model_len)  # `published` holds both workers' tokens
    assert_idle(other)


def test_take_waiting_moves_a_draining_worker_s_sequences_that_hold_no_blocks():
    """A draining worker: its waiting sequences go to another worker at once (nothing computed is lost, no
    block changes hands), its running ones finish where they are."""
    cfg = SchedulerConfig(num_blocks=40, block_size=8, max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=256)
    published: dict = {}
    sched, worker = WorkerPolicy(cfg, "w1"), FakeWorker(cfg, published)
    reqs = [make_req(f"d{i}", 20, max_tokens=12) for i in range(4)]
    drive(sched, worker, depth=2, arrivals={0: reqs}, stop_after=3)
    assert sched.num_running == 2 and sched.num_waiting == 2
    used = sched.num_used_blocks
    taken = sched.take_waiting()
    assert [r.request_id for r, _ in taken] == ["d2", "d3"] and all(outs == [] for _, outs in taken)
    assert sched.num_waiting == 0 and sched.num_running == 2 and sched.num_used_blocks == used
    assert sched.take_waiting() == []
    drive(sched, worker)  # the running ones finish on the draining worker
    assert_idle(sched)
    other, worker2 = WorkerPolicy(cfg, "w2"), FakeWorker(cfg, published)
    for r, outs in taken:
        other.add_request(r, outs)
    drive(other, worker2)
    assert_reference(worker, reqs[:2], cfg.max_model_len)
    assert_reference(worker2, reqs[2:], cfg.max_model_len)
    assert_idle(other)


# ---------------------------------------------------------------------------- bad input


def test_bad_config_and_requests_are_rejected_clearly():
    with pytest.raises(ValueError, match="num_blocks"):
        SchedulerConfig(num_blocks=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=8, max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(num_blocks=8, watermark=1.5)
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    sched = WorkerPolicy(cfg)
    sched.add_request(make_req("x", 4))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(make_req("x", 4))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_req("e", 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("long", 64))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_req("huge", 40, max_tokens=8))  # 47 positions > 8 blocks of 4
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(make_req("done", 4, max_tokens=2), output_ids=[1, 2])
    assert sched.num_waiting == 1


# ---------------------------------------------------------------------------- the shared admission rule


def _policy_admits(cfg: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    try:
        WorkerPolicy(cfg).add_request(make_req("probe", prompt_len, max_tokens))
    except AdmissionError:
        return False
    return True


@pytest.mark.parametrize("num_blocks,block_size,watermark,max_model_len,max_tokens", [
    (8, 4, 0.0, 64, 1),  # one output: its KV is never computed, so no decode slot is promised
    (8, 4, 0.0, 64, 2),
    (8, 4, 0.0, 64, 9),  # the whole cache bounds prompt + max_tokens
    (100, 4, 0.1, 1024, 3),  # the watermark (10 blocks) bounds the prefill
    (10, 16, 0.01, 2048, 16),
    (40, 16, 0.0, 200, 16),  # the cache holds more than max_model_len: the context is the limit
])
def test_largest_admissible_prompt_is_exactly_what_the_policy_admits(num_blocks, block_size, watermark,
                                                                     max_model_len, max_tokens):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=64,
                          max_model_len=max_model_len, watermark=watermark)
    cap = KVCapacity(num_blocks, block_size, max_model_len, watermark)
    limit = cap.max_prompt_len(max_tokens)
    assert 1 <= limit < max_model_len
    assert _policy_admits(cfg, limit, max_tokens)
    with pytest.raises(AdmissionError):
        WorkerPolicy(cfg).add_request(make_req("over", limit + 1, max_tokens))
    # the largest completion for that prompt, likewise, and a prompt at the limit really runs to its end
    most = cap.max_new_tokens(limit)
    assert most >= min(max_tokens, max_model_len - limit) and _policy_admits(cfg, limit, most)
    if limit + most < max_model_len:  # beyond that max_model_len caps the output, so more changes nothing
        assert not _policy_admits(cfg, limit, most + 1)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    req = make_req("at-limit", limit, max_tokens)
    drive(sched, worker, arrivals={0: [req]})
    assert_reference(worker, [req], max_model_len)
    assert_idle(sched)


def test_admission_rule_matches_the_policy_for_every_prompt():
    for watermark, max_tokens in ((0.0, 1), (0.0, 3), (0.25, 5), (0.25, 40)):
        cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_batched_tokens=64, max_model_len=64,
                              watermark=watermark)
        cap = KVCapacity(12, 4, 64, watermark)
        admitted = [p for p in range(1, 70) if _policy_admits(cfg, p, max_tokens)]
        assert admitted == list(range(1, cap.max_prompt_len(max_tokens) + 1)), (watermark, max_tokens)
        assert all(cap.admits(p, max_tokens) == (p in admitted) for p in range(1, 64))


# ---------------------------------------------------------------------------- cost-aware budget


def test_chunk_cost_is_the_sum_of_its_token_costs():
    for horizon in (0, 1, 3, 7, 980, 4032):
        for start in (0, 1, 15, 100, 1983):
            for n in (0, 1, 2, 5, 64, 496):
                brute = n if horizon == 0 else sum(1 + (start + j) / horizon for j in range(1, n + 1))
                assert chunk_cost(start, n, horizon) == pytest.approx(brute, rel=1e-12, abs=1e-12)
    assert chunk_cost(2000, 1, 980) == pytest.approx(1 + 2001 / 980)  # a decode at position 2000


def test_max_chunk_tokens_is_the_largest_chunk_that_fits():
    def brute(start: int, budget: float, horizon: int) -> int:
        n = 0  # exact rational arithmetic, token by token: no closed form, no float rounding
        total = Fraction(0)
        while True:
            nxt = total + (1 if horizon == 0 else 1 + Fraction(start + n + 1, horizon))
            if nxt > Fraction(budget):
                return n
            total, n = nxt, n + 1

    grid = [(s, b, k) for k in (0, 1, 2, 3, 50, 980, 4032) for s in (0, 1, 15, 500, 2000)
            for b in (-3, 0, 0.5, 1, 1.0001, 2, 7.3, 54, 64, 496, 512.25)]
    rng = random.Random(3)
    grid += [(rng.randint(0, 5000), rng.uniform(0, 600), rng.choice([1, 2, 9, 980, 4032])) for _ in range(300)]
    for start, budget, horizon in grid:
        n = max_chunk_tokens(start, budget, horizon)
        assert n == brute(start, budget, horizon), (start, budget, horizon)
        assert chunk_cost(start, n, horizon) <= budget or n == 0
        assert chunk_cost(start, n + 1, horizon) > budget
    # the closed form stays exact where the prefix dwarfs the horizon (no cancellation in the root)
    assert max_chunk_tokens(10**9, 10**4, 1) == brute(10**9, 10**4, 1) == 0
    assert max_chunk_tokens(10**6, 10**5, 3) == brute(10**6, 10**5, 3)


@pytest.mark.parametrize("horizon", [0, 980])
def test_long_prompt_chunks_shrink_as_its_prefix_grows(horizon):
    cfg = SchedulerConfig(num_blocks=256, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          attention_horizon=horizon, long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    shorts = [make_req(f"d{i}", 8, max_tokens=60) for i in range(16)]
    long = make_req("long", 2048, max_tokens=4)
    steps: list[tuple] = []  # (long's chunk, plan cost, decodes in the plan)

    def on_plan(idx, plan):
        mine = [c for c in plan.chunks if c.seq_id == "long" and c.num_tokens > 1]
        if mine:
            steps.append((mine[0], plan_cost(plan, horizon), sum(c.seq_id != "long" for c in plan.chunks)))

    drive(sched, worker, arrivals={0: shorts, 3: [long]}, on_plan=on_plan)
    sizes = [c.num_tokens for c, _, _ in steps]
    assert sum(sizes) == 2048 and all(d == 16 for _, _, d in steps), "the decodes stay in every step"
    full = steps[:-1]  # every chunk but the remainder is as large as the budget allows
    if horizon == 0:
        assert sizes == [496, 496, 496, 496, 64]
    else:
        assert all(a > b for a, b in zip(sizes, sizes[1:-1])), sizes  # strictly smaller, deeper in the prompt
        assert sizes[0] < 496 and sizes[-2] < sizes[0] * 0.6, sizes
    for c, cost, _ in full:  # each step fills the budget: less than one more token would fit
        assert 512 - chunk_cost(c.start_pos + c.num_tokens, 1, horizon) < cost <= 512
    assert_reference(worker, shorts + [long], cfg.max_model_len)
    assert sched.stats().counters.num_preemptions == 0
    assert_idle(sched)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_stay_within_the_cost_budget(seed, depth):
    # mostly short prompts with long outputs, some long prompts, contexts up to 10x the horizon and a small
    # budget: decodes alone sometimes exceed it. Checker bounds every plan's cost, summed token by token.
    rng = random.Random(100 + seed)
    horizon = rng.choice([20, 60, 300])
    cfg = SchedulerConfig(num_blocks=96, block_size=8, max_num_seqs=8, max_num_batched_tokens=32,
                          max_model_len=256, attention_horizon=horizon, watermark=0.0,
                          long_prefill_threshold=rng.choice([0, 12, 40]))
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs, arrivals = [], {}
    for i in range(32):
        prompt_len = rng.randint(1, 16) if rng.random() < 0.7 else rng.randint(40, 160)
        r = make_req(f"r{i}", prompt_len, max_tokens=rng.randint(1, 90), priority=rng.choice([0, 0, 1]))
        reqs.append(r)
        arrivals.setdefault(rng.randint(0, 60), []).append(r)
    drive(sched, worker, depth=depth, arrivals=arrivals)
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)
    assert sched.stats().counters.num_finished == 32


@pytest.mark.parametrize("horizon", [0, 980])
def test_waiting_sequence_starts_within_k_plus_one_plans_with_costs(horizon):
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          attention_horizon=horizon, long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [make_req("L1", 2048, 2), make_req("L2", 2048, 2), make_req("L3", 2048, 2), make_req("S", 10, 2)]
    first: dict[str, int] = {}
    done: dict[str, int] = {}

    def on_plan(i, p):
        for c in p.chunks:
            first.setdefault(c.seq_id, i)
            if c.seq_id == "S" and c.start_pos + c.num_tokens == 10:
                done["S"] = i

    drive(sched, worker, arrivals={0: reqs}, on_plan=on_plan)
    assert first == {"L1": 0, "L2": 1, "L3": 2, "S": 3}  # k sequences ahead -> starts in plan k (FCFS)
    assert done["S"] == 3, "a short prompt at the head is prefilled whole in its first plan"
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


@pytest.mark.parametrize("horizon", [0, 980])
@pytest.mark.parametrize("depth", [1, 2])
def test_long_prompts_share_the_cap_while_short_prompts_fill_the_budget(depth, horizon):
    """Prompts over T tokens take at most T units of a step together; a burst of short prompts still gets
    the rest of the budget, prefilled whole in its first plan; every decode stays in every step."""
    T = 128
    cfg = SchedulerConfig(num_blocks=512, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          attention_horizon=horizon, long_prefill_threshold=T)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    streams = [make_req(f"d{i}", 8, max_tokens=80) for i in range(16)]
    longs = [make_req("long1", 1500, max_tokens=3), make_req("long2", 700, max_tokens=3)]
    burst = [make_req(f"s{i}", 100, max_tokens=3) for i in range(3)]
    prompt_len = {r.request_id: len(r.prompt_ids) for r in streams + longs + burst}
    long_cost_per_plan, both_long, burst_plans, decodes_beside_long = [], 0, set(), []

    def on_plan(idx, plan):
        nonlocal both_long
        long_chunks = [c for c in plan.chunks if c.seq_id.startswith("long") and c.num_tokens > 1]
        cost = sum(chunk_cost(c.start_pos, c.num_tokens, horizon) for c in long_chunks)
        if long_chunks:
            long_cost_per_plan.append(cost)
            decodes_beside_long.append(sum(c.seq_id.startswith("d") for c in plan.chunks))
            assert cost <= T
        both_long += len(long_chunks) == 2
        for c in plan.chunks:
            if c.seq_id.startswith("s") and c.start_pos < 100:
                assert c.start_pos == 0 and c.num_tokens == 100  # whole, in one plan
                burst_plans.add(idx)

    drive(sched, worker, depth=depth, arrivals={0: streams, 3: longs[:1], 4: longs[1:], 6: burst}, on_plan=on_plan)
    assert len(burst_plans) == 1, "the burst is prefilled in one plan beside the long chunks"
    assert both_long > 0, "the two long prompts overlapped and shared the cap"
    assert max(long_cost_per_plan) > T - chunk_cost(1500, 1, horizon)  # the cap is filled, not undershot
    assert sum(decodes_beside_long) > 0 and all(d in (0, 16) for d in decodes_beside_long)
    if horizon == 0:
        assert [c for c in long_cost_per_plan[:3]] == [128, 128, 128]
    assert_reference(worker, streams + longs + burst, cfg.max_model_len)
    assert sched.stats().counters.num_preemptions == 0
    assert_idle(sched)


@pytest.mark.parametrize("horizon", [0, 980])
def test_the_long_cap_applies_only_beside_decodes(horizon):
    """The cap protects streams decoding beside a long prompt: alone, the prompt's chunks take the whole
    budget (smaller chunks would only cost its TTFT); once a stream decodes beside it, they take at most T."""
    T = 128
    cfg = SchedulerConfig(num_blocks=512, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                          attention_horizon=horizon, long_prefill_threshold=T)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    long, stream = make_req("long", 3000, max_tokens=2), make_req("d", 8, max_tokens=200)
    alone, beside = [], []

    def on_plan(idx, plan):
        cost = sum(chunk_cost(c.start_pos, c.num_tokens, horizon) for c in plan.chunks if c.seq_id == "long"
                   and c.start_pos + c.num_tokens <= 3000)
        if cost:
            (beside if any(c.seq_id == "d" and c.start_pos >= 8 for c in plan.chunks) else alone).append(cost)

    drive(sched, worker, arrivals={0: [long], 3: [stream]}, on_plan=on_plan)
    assert len(alone) >= 3 and len(beside) >= 3
    assert all(c > 512 - chunk_cost(3000, 1, horizon) for c in alone[:3]), "alone it fills the budget"
    assert all(c <= T for c in beside) and max(beside) > T - chunk_cost(3000, 1, horizon)
    assert_reference(worker, [long, stream], cfg.max_model_len)
    assert_idle(sched)


def test_a_long_prompt_moves_every_plan_even_when_one_token_costs_more_than_the_cap():
    # T = 2 units; from position 8 on a token costs 1 + (p + 1) / 8 > 2: the step's first long chunk still
    # gets one token, so the prompt progresses every plan beside the decodes and finishes
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=256, attention_horizon=8, long_prefill_threshold=2)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    streams = [make_req(f"d{i}", 2, max_tokens=60) for i in range(2)]  # 2 tokens: not long
    long = make_req("long", 40, max_tokens=2)
    chunks = []
    drive(sched, worker, arrivals={0: streams, 1: [long]},
          on_plan=lambda i, p: chunks.extend((i, c.num_tokens) for c in p.chunks if c.seq_id == "long"))
    prefill = chunks[:40]
    assert [n for _, n in prefill] == [1] * 40, "one token a plan: the cap holds it to the minimum"
    assert [i for i, _ in prefill] == list(range(1, 41)), "and it moves on every plan"
    assert_reference(worker, streams + [long], cfg.max_model_len)
    assert_idle(sched)


def test_head_starts_even_when_decodes_use_up_the_budget():
    # a budget of 4 units, and three decodes that cost 1 + (p + 1) / 8 units each: from position 2 on they
    # use it all up, yet the head of the queue starts on the very next plan (with one token)
    cfg = SchedulerConfig(num_blocks=128, block_size=8, max_num_seqs=4, max_num_batched_tokens=4,
                          max_model_len=256, attention_horizon=8, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    olds = [make_req(f"o{i}", 1, max_tokens=60) for i in range(3)]  # all three prefilled in one step
    for r in olds:
        sched.add_request(r)
    for _ in range(3):
        plan = sched.schedule()
        sched.update(worker.run(plan))
    assert sorted((c.seq_id, c.start_pos) for c in plan.chunks) == [("o0", 2), ("o1", 2), ("o2", 2)]
    new = make_req("new", 20, max_tokens=3)
    sched.add_request(new)
    plan = sched.schedule()
    assert plan_cost(plan, 8) - chunk_cost(0, 1, 8) > 4, "the decodes alone exceed the budget"
    assert [(c.seq_id, c.start_pos, c.num_tokens) for c in plan.chunks if c.seq_id == "new"] == [("new", 0, 1)]
    assert [s.seq_id for s in plan.starts] == ["new"]
    sched.update(worker.run(plan))
    drive(sched, worker)  # its prefill waits for budget beside the decodes, then finishes
    assert_reference(worker, olds + [new], cfg.max_model_len)
    assert_idle(sched)


def test_a_lone_prefill_progresses_when_one_token_costs_more_than_the_budget():
    cfg = SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=4,
                          max_model_len=256, attention_horizon=8, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    req = make_req("deep", 100, max_tokens=2)
    plans = drive(sched, worker, arrivals={0: [req]})  # drive fails if a plan is empty while work is left
    chunks = [c for p in plans for c in p.chunks if c.start_pos < 100]
    expected, pos = [], 0  # as many tokens as fit in 4 units, summed token by token; at least one
    while pos < 100:
        n = 0
        while pos + n < 100 and sum(1 + (pos + j) / 8 for j in range(1, n + 2)) <= 4:
            n += 1
        expected.append(max(n, 1))
        pos += max(n, 1)
    assert [c.num_tokens for c in chunks] == expected
    forced = [c for c in chunks if chunk_cost(c.start_pos, 1, 8) > 4]
    assert len(forced) > 60 and all(c.num_tokens == 1 for c in forced)  # from position 24 on: 1 + 25/8 > 4
    assert_reference(worker, [req], cfg.max_model_len)
    assert_idle(sched)


def test_attention_horizon_is_validated():
    with pytest.raises(ValueError, match="attention_horizon"):
        SchedulerConfig(num_blocks=8, attention_horizon=-1)
    with pytest.raises(ValueError, match="attention_horizon"):
        SchedulerConfig(num_blocks=8, attention_horizon=2.5)


# ---------------------------------------------------------------------------- horizon: worker -> scheduler


def test_worker_info_carries_the_attention_horizon():
    info = WorkerInfo("w1", "mixed", "m", 100, 16, 2048, 42, 1.5, attention_horizon=991)
    assert WorkerInfo.from_wire(info.to_wire()) == info
    old = msgpack.packb({"v": PROTOCOL_VERSION, "k": WorkerInfo.KIND, "worker_id": "w0", "role": "mixed",
                         "model": "m", "num_blocks": 10, "block_size": 16, "max_model_len": 512, "pid": 1,
                         "started_at": 2.0}, use_bin_type=True)  # from a worker that predates the field
    decoded = WorkerInfo.from_wire(old)
    assert decoded.attention_horizon == 0 and decoded.num_blocks == 10
    assert (decoded.dtype, decoded.cpu_level, decoded.kernels) == ("", "", {})


def test_worker_info_carries_what_the_worker_computes_with():
    info = WorkerInfo("w1", "mixed", "m", 100, 16, 2048, 42, 1.5, dtype="float32", cpu_level="avx2",
                      kernels={"attention": "native avx2", "linear": "torch"})
    assert WorkerInfo.from_wire(info.to_wire()) == info


def test_token_event_error_kind_is_additive():
    rejected = TokenEvent("s", 0, [], "error", None, "needs up to 9 KV blocks", ERROR_REJECTED)
    batch = TokenBatch(-1, "scheduler", [rejected, TokenEvent("t", 3, [7, 8], "length")])
    assert TokenBatch.from_wire(batch.to_wire()).events == batch.events
    # an event without a kind is encoded exactly as before the field existed, and such old events decode
    assert TokenEvent("t", 3, [7, 8], "length").to_list() == ["t", 3, [7, 8], "length", None, None]
    assert TokenEvent.from_list(["s", 0, [], "error", None, "boom"]).error_kind is None


def test_attention_horizon_from_the_model_shape(tmp_path):
    # bundled model: 2 * 724,992 weights * 6 layers per token / (4 * 6 * 8 * 32) = 1416; * 0.32 -> 453
    assert runner_attention_horizon(read_config(bundled_model_path())) == round(ATTENTION_EFFICIENCY * 1416) == 453
    shape = json.loads((Path(bundled_model_path()) / "config.json").read_text())
    shape.update(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=64, num_hidden_layers=16)  # the 200M benchmark model
    (tmp_path / "config.json").write_text(json.dumps(shape))
    assert runner_attention_horizon(read_config(tmp_path)) == round(ATTENTION_EFFICIENCY * 5760) == 1843
