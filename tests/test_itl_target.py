"""The policy under an ITL target (scheduler/budget.py; docs/architecture.md, "The step budget"): with learned step costs, a planned
step's predicted time stays under the target while streams decode, decodes are never dropped, and a
waiting prompt still progresses. Driven by test_scheduler_policy's fake worker and invariant checks."""

from __future__ import annotations

import pytest

from phaseserve.scheduler.budget import StepBudget, chunk_cost, max_chunk_tokens
from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
from phaseserve.step_shape import step_shape
from phaseserve.scheduler.step_cost import ItlTarget, StepCosts
from test_scheduler_policy import FakeWorker, assert_idle, assert_reference, drive, make_req

# a 200M-like worker: a decode step of 16 costs ~33 ms, a 256-token chunk ~8 decode steps' worth
COSTS = StepCosts(overhead_s=0.020, token_s=0.0008, key_s=0.0008 / 2000, prefill_chunk_s=0.002)  # K = 2000


def config(target: ItlTarget, **kw) -> SchedulerConfig:
    base = dict(num_blocks=512, block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                attention_horizon=2000, itl_target=target)
    base.update(kw)
    return SchedulerConfig(**base)


def split(plan, prefill_lens: dict[str, int]):
    decodes = [c for c in plan.chunks if c.start_pos >= prefill_lens.get(c.seq_id, 0)]
    prefills = [c for c in plan.chunks if c.start_pos < prefill_lens.get(c.seq_id, 0)]
    return decodes, prefills


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("target", [ItlTarget(ratio=1.5), ItlTarget(ratio=1.2), ItlTarget(ms=45.0)])
def test_planned_steps_stay_under_the_target_and_decodes_are_never_dropped(depth, target):
    cfg = config(target)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    sched.step_costs = COSTS
    shorts = [make_req(f"d{i}", 8, max_tokens=120) for i in range(16)]
    longs = [make_req("long0", 2000, max_tokens=2), make_req("long1", 1500, max_tokens=2)]
    reqs = {r.request_id: r for r in shorts + longs}
    lens = {rid: len(r.prompt_ids) for rid, r in reqs.items()}
    long_progress: dict[str, list[int]] = {"long0": [], "long1": []}
    checked = 0
    one_token = chunk_cost(cfg.max_model_len - 1, 1, COSTS.horizon) * COSTS.token_s

    def on_plan(idx, plan):
        nonlocal checked
        decodes, prefills = split(plan, lens)
        for c in prefills:
            if c.seq_id in long_progress:
                long_progress[c.seq_id].append(idx)
        if idx < 2 or len(decodes) < 16 or not prefills:
            return  # the streams' own prompts, or a step with no long prefill beside all 16 streams
        decode_s = COSTS.predict(*step_shape(decodes))
        bound = target.ratio * decode_s if target.ratio else target.ms / 1e3
        # the head of the queue may take one token beyond what the target leaves
        assert COSTS.predict(*step_shape(plan.chunks)) <= bound + one_token + 1e-9, (idx, plan.chunks)
        checked += 1

    plans = drive(sched, worker, depth=depth, arrivals={0: shorts, 4: longs}, on_plan=on_plan)
    assert checked >= 10, "the long prompts prefilled beside the decoding streams"
    # every stream decodes in every plan until it finishes: count each stream's decodes per plan
    for rid in lens:
        if rid.startswith("d"):
            idx = [i for i, p in enumerate(plans) if any(c.seq_id == rid and c.start_pos >= 8 for c in p.chunks)]
            assert idx == list(range(idx[0], idx[0] + len(idx))), f"{rid} skipped a step"
    # the long prompts progressed: long0 (the head) in every plan from its start until its prefill ended
    p0 = long_progress["long0"]
    assert p0 == list(range(p0[0], p0[0] + len(p0)))
    assert_reference(worker, shorts + longs, cfg.max_model_len)
    assert_idle(sched)
    assert sched.stats().counters.num_steps_held_by_itl_target > 0
    assert sched.stats().counters.num_steps_past_itl_patience == 0  # no prompt waited its patience: the target held


def test_the_target_slows_the_long_prompt_as_expected():
    """Against no target, the long prompt takes more steps (it waits) and each chunk is smaller."""
    chunks: dict[str, list[int]] = {}
    for name, target in (("off", ItlTarget()), ("1.5x", ItlTarget(ratio=1.5))):
        cfg = config(target, long_prefill_threshold=0)
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        sched.step_costs = COSTS
        shorts = [make_req(f"d{i}", 8, max_tokens=300) for i in range(16)]
        long = make_req("long", 2000, max_tokens=2)
        got = chunks.setdefault(name, [])
        drive(sched, worker, arrivals={0: shorts, 4: [long]},
              on_plan=lambda i, p: got.extend(c.num_tokens for c in p.chunks if c.seq_id == "long"
                                              and c.start_pos < 2000))
    assert sum(chunks["off"]) == sum(chunks["1.5x"]) == 2000
    assert len(chunks["1.5x"]) > 3 * len(chunks["off"])
    # 1.5x of ~33 ms leaves ~16 ms = ~20 units of a 0.8 ms token, minus attention deeper in the prompt
    assert max(chunks["1.5x"]) <= 25 and max(chunks["off"]) > 400


def test_an_ms_target_below_the_decode_step_still_moves_every_prompt():
    """Decodes alone exceed a 10 ms target: prefill gets the floor (the deepest token's cost) a step, so
    a waiting prompt still finishes, a few tokens at a time."""
    cfg = config(ItlTarget(ms=10.0), long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    sched.step_costs = COSTS
    shorts = [make_req(f"d{i}", 8, max_tokens=120) for i in range(8)]
    late = make_req("late", 40, max_tokens=2)
    got: list[int] = []
    drive(sched, worker, arrivals={0: shorts, 3: [late]},
          on_plan=lambda i, p: got.extend(c.num_tokens for c in p.chunks if c.seq_id == "late" and c.start_pos < 40))
    floor = chunk_cost(cfg.max_model_len - 1, 1, COSTS.horizon)  # the deepest token's cost: 3.05 units
    assert sum(got) == 40 and max(got) == max_chunk_tokens(0, floor, COSTS.horizon) == 3 and len(got) >= 13
    assert_reference(worker, shorts + [late], cfg.max_model_len)


def test_no_target_without_costs_or_decodes():
    cfg = config(ItlTarget(ratio=1.5))
    # no costs learned yet: the token budget alone, exactly as with the target off
    budget = StepBudget.for_step(cfg, None)
    assert budget.left == cfg.max_num_batched_tokens and budget.horizon == cfg.attention_horizon
    # nor with costs the model would not believe (everything on the keys)
    budget = StepBudget.for_step(cfg, StepCosts(0.0, 0.0, 6e-4))
    assert budget.target_left == float("inf") and budget.horizon == cfg.attention_horizon
    budget = StepBudget.for_step(cfg, COSTS)
    assert budget.left == cfg.max_num_batched_tokens  # no decode charged: no stream to protect
    for pos in range(16):
        budget.charge_decode(1000 + pos)
    decode_units = budget.decode_units
    # half of the decode-only step, less what the first prefill chunk adds beyond its tokens
    assert budget.target_left == pytest.approx(0.5 * (COSTS.overhead_units + decode_units)
                                              - COSTS.prefill_chunk_units)
    assert budget.held_by_target
    # a lone long prompt (no stream decoding) gets full budget-sized chunks
    sched = WorkerPolicy(cfg)
    sched.step_costs = COSTS
    sched.add_request(make_req("alone", 2000, max_tokens=2))
    plan = sched.schedule()
    assert plan.chunks[0].num_tokens > 200


def test_a_ratio_target_is_of_the_decode_only_step_as_fitted_apart():
    """The main fit, made of steps that carry prefill while long prompts run, can put a fixed cost that only
    steps with prefill pay on every step; the fit of decode-only steps says what the streams' steps take
    without it, and the ratio is of that. Without a plausible one, or where it predicts a longer step than the
    main fit, of the main fit's prediction."""
    cfg = config(ItlTarget(ratio=1.5))
    decode_only = StepCosts(overhead_s=0.008, token_s=0.0008, key_s=0.0008 / 2000)  # 12 ms less fixed cost
    budget = StepBudget.for_step(cfg, COSTS, decode_only)
    for pos in range(16):
        budget.charge_decode(1000 + pos)
    keys = sum(1001 + pos for pos in range(16))
    bound_s = 1.5 * decode_only.predict(16, keys)
    assert budget.target_s == pytest.approx(bound_s)
    room = bound_s / COSTS.token_s - COSTS.overhead_units - budget.decode_units - COSTS.prefill_chunk_units
    assert budget.target_room(floor=False) == pytest.approx(room)
    # here the fixed cost the main fit adds is more than the 0.5x leaves: a long prompt gets only the floor
    assert room < 0 and budget.target_left == pytest.approx(budget.target_floor)
    # a decode-only fit that predicts a longer step than the main fit does not loosen the bound
    slower = StepCosts(overhead_s=0.030, token_s=0.0008, key_s=0.0008 / 2000)
    for implausible in (None, StepCosts(0.0, 0.0, 6e-4), slower):
        fallback = StepBudget.for_step(cfg, COSTS, implausible)
        for pos in range(16):
            fallback.charge_decode(1000 + pos)
        assert fallback.target_s == pytest.approx(1.5 * COSTS.predict(16, keys))


def test_beside_another_tenant_long_chunks_keep_the_plans_in_flight_within_the_wait():
    """`hold_long_cap(wait_s, behind_plans)`: in a step with no decode, long chunks keep the step within the
    wait (a 256-unit chunk here is ~0.24 s); behind a plan in flight, a long prompt moves nothing, not even the
    token it otherwise always moves. Beside decodes the ITL target bounds the step instead, and without
    learned costs only the long cap holds."""
    cfg = config(ItlTarget(ratio=1.3))
    alone = StepBudget.for_step(cfg, COSTS)
    alone.hold_long_cap()
    assert alone.chunk_tokens(3000, 0, alone.left) == max_chunk_tokens(0, 256, 2000)  # the long cap

    first = StepBudget.for_step(cfg, COSTS)
    first.hold_long_cap(0.1)
    n = first.chunk_tokens(3000, 0, first.left)
    first.charge_prefill(3000, 0, n)
    assert 0 < n < max_chunk_tokens(0, 256, 2000) and first.predicted_s <= 0.1
    assert first.predicted_s + COSTS.token_s * chunk_cost(n, 2, 2000) > 0.1  # the most that fits

    behind = StepBudget.for_step(cfg, COSTS)
    behind.hold_long_cap(0.1, behind_plans=True)
    assert behind.waits_for_plans(3000) and behind.chunk_tokens(3000, n, behind.left) == 0
    assert behind.chunk_tokens(40, 0, behind.left) >= 40  # a short prompt is not held

    beside_decodes = StepBudget.for_step(cfg, COSTS)
    beside_decodes.charge_decode(100)
    beside_decodes.hold_long_cap(0.1, behind_plans=True)
    assert not beside_decodes.waits_for_plans(3000)
    assert beside_decodes.chunk_tokens(3000, n, beside_decodes.left) >= 1  # the ITL target's room, its floor

    unlearned = StepBudget.for_step(cfg)
    unlearned.hold_long_cap(0.1, behind_plans=True)
    assert unlearned.chunk_tokens(3000, 0, unlearned.left) == max_chunk_tokens(0, 256, 2000)


def test_short_prompts_are_not_held_by_the_target():
    """The target bounds long prompts (longer than the long-prompt threshold): a burst of chat prompts beside
    the decoding streams is prefilled as fast as with the target off, so their TTFT (and a workload of
    short prompts only, like workload A) does not pay for it. The streams' baseline ITL includes them."""
    chunks: dict[str, list[int]] = {}
    for name, target in (("off", ItlTarget()), ("1.3x", ItlTarget(ratio=1.3))):
        cfg = config(target)
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        sched.step_costs = COSTS
        streams = [make_req(f"d{i}", 8, max_tokens=60) for i in range(16)]
        chats = [make_req(f"c{i}", 200, max_tokens=2) for i in range(6)]
        got = chunks.setdefault(name, [])
        drive(sched, worker, arrivals={0: streams, 4: chats},
              on_plan=lambda i, p: got.append(sum(c.num_tokens for c in p.chunks if c.seq_id.startswith("c")
                                                  and c.start_pos < 200)))
        assert_reference(worker, streams + chats, cfg.max_model_len)
    assert chunks["1.3x"] == chunks["off"] and max(chunks["off"]) > 200


def test_chunked_prefill_off_ignores_the_target():
    cfg = config(ItlTarget(ratio=1.5), enable_chunked_prefill=False)
    assert StepBudget.for_step(cfg, COSTS).target_left == float("inf")


@pytest.mark.parametrize("depth", [1, 2])
def test_short_prompts_are_not_stuck_behind_long_ones_under_the_target(depth):
    """Long prompts wait under the target; a chat prompt arriving behind them still starts at once and
    finishes its prefill in a few steps (short partial prefills go before long ones)."""
    cfg = config(ItlTarget(ratio=1.5))
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    sched.step_costs = COSTS
    streams = [make_req(f"d{i}", 8, max_tokens=200) for i in range(16)]
    longs = [make_req(f"long{i}", 2000, max_tokens=2) for i in range(3)]
    chats = [make_req(f"chat{i}", 60, max_tokens=4) for i in range(4)]
    first: dict[str, int] = {}
    done: dict[str, int] = {}

    def on_plan(idx, plan):
        for c in plan.chunks:
            first.setdefault(c.seq_id, idx)
            if c.seq_id.startswith("chat") and c.start_pos + c.num_tokens == 60:
                done[c.seq_id] = idx

    drive(sched, worker, depth=depth, arrivals={0: streams, 4: longs, 10: chats[:2], 30: chats[2:]},
          on_plan=on_plan)
    arrived = {"chat0": 10, "chat1": 10, "chat2": 30, "chat3": 30}
    for rid, at in arrived.items():
        assert first[rid] - at <= 2 and done[rid] - at <= 8, (rid, first[rid], done[rid])
    assert max(first[f"long{i}"] for i in range(3)) <= 8  # the long ones started too, and wait their turn
    assert_reference(worker, streams + longs + chats, cfg.max_model_len)


# a worker whose learned fixed cost is small in token-units (2-8 in the concurrency-16 record's runs):
# beside a few decodes a ratio target leaves a long prompt a token or two a step
SMALL_FIXED = StepCosts(overhead_s=0.020, token_s=0.005, key_s=0.005 / 1843, prefill_chunk_s=0.005)  # O = 4


@pytest.mark.parametrize("depth", [1, 2])
def test_long_prompts_beside_few_decodes_are_not_starved(depth):
    """bench/results/2026-11-28-speculative-concurrency-16.md, section 4: beside 2 streams a 1.3x target leaves
    room for about one deep token a step, so ten 512-token prompts prefill one after another, each waiting
    for those before it, and the last one's first token comes after well over the gateway's default progress
    timeout (60 s) of step time. The target may hold a prompt back for `itl_patience_s` of predicted step time
    from the start of its prefill: then it moves every step and prefills under the budget and the long cap."""
    cfg = config(ItlTarget(ratio=1.3), max_model_len=2048, attention_horizon=1843)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    sched.step_costs = SMALL_FIXED
    streams = [make_req(f"d{i}", 8, max_tokens=2030) for i in range(2)]
    longs = [make_req(f"long{i}", 512, max_tokens=4) for i in range(10)]
    clock = 0.0  # the plans' predicted step time, summed: what the streams and the gateway see pass
    chunks: dict[str, list[float]] = {}  # long prompt -> the clock at each of its prefill chunks

    def on_plan(idx, plan):
        nonlocal clock
        clock += SMALL_FIXED.predict(*step_shape(plan.chunks))
        for c in plan.chunks:
            if c.seq_id.startswith("long") and c.start_pos < 512:
                chunks.setdefault(c.seq_id, []).append(clock)

    drive(sched, worker, depth=depth, arrivals={0: streams, 4: longs}, on_plan=on_plan, max_iters=6000)
    assert set(chunks) == {r.request_id for r in longs}
    # a started prompt is vouched for only while it moves: no chunk-less stretch beyond the patience (and a
    # step), and every first token well inside the progress timeout
    worst_gap = max(b - a for times in chunks.values() for a, b in zip(times, times[1:]))
    assert worst_gap <= cfg.itl_patience_s + 1.0, worst_gap
    assert max(t[-1] for t in chunks.values()) <= 4 * cfg.itl_patience_s, sorted(t[-1] for t in chunks.values())
    assert sched.stats().counters.num_steps_past_itl_patience > 0  # the target yielded, and it shows
    assert_reference(worker, streams + longs, cfg.max_model_len)
    assert_idle(sched)


def test_an_overdue_long_prompt_is_bounded_by_the_budget_and_the_long_cap_only():
    cfg = config(ItlTarget(ratio=1.3))
    budget = StepBudget.for_step(cfg, SMALL_FIXED)
    for pos in range(2):
        budget.charge_decode(100 + pos)
    held = budget.chunk_tokens(512, 0, budget.left)
    assert 0 < held <= 4  # the target's room beside two decodes
    assert budget.chunk_tokens(512, 0, budget.left, overdue=True) == max_chunk_tokens(0, 256, budget.horizon)
    budget.charge_prefill(512, 0, budget.chunk_tokens(512, 0, budget.left, overdue=True))
    # the long cap is spent: the next overdue prompt still moves one token, one not overdue nothing
    assert budget.chunk_tokens(512, 0, budget.left, overdue=True) == 1
    assert budget.chunk_tokens(512, 0, budget.left) == 0
