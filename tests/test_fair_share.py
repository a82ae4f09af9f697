"""Tenants in the scheduler, step by step with no Redis and no model: the pure fair-share helpers
(scheduler/fair_share.py), then `WorkerPolicy` sharing tokens, slots and blocks between tenants by weight,
ordering within a tenant by priority, and naming prefix blocks per cache scope and salt. The fake worker of
tests/test_scheduler_policy.py runs every plan, so a wrong block, start or recompute changes the tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phaseserve.scheduler.fair_share import TenantShares, fair_order, most_over_share, usage_over_share, weighted_split
from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
from phaseserve.scheduler.step_cost import ItlTarget, StepCosts
from tests.test_scheduler_policy import FakeWorker, assert_idle, assert_reference, drive, make_req


def tenant_req(rid: str, prompt_len: int, tenant: str, weight: float = 1.0, max_tokens: int = 4,
               priority: int = 0, scope: str | None = None, salt: str = "", prompt_of: str | None = None):
    req = make_req(prompt_of or rid, prompt_len, max_tokens=max_tokens, priority=priority)
    return replace(req, request_id=rid, tenant=tenant, tenant_weight=weight,
                   cache_scope=tenant if scope is None else scope, cache_salt=salt)


# ---------------------------------------------------------------------------- the pure helpers


def test_fair_order_interleaves_tenants_by_weight_and_keeps_each_tenant_s_order():
    items = [("a", i) for i in range(6)] + [("b", i) for i in range(6)]
    order = fair_order(items, lambda x: x[0], {}, {"a": 1.0, "b": 2.0}, lambda x: 10)
    # b (weight 2) advances half as fast: two of b's for each of a's once both start level
    assert [t for t, _ in order[:9]] == ["a", "b", "b", "a", "b", "b", "a", "b", "b"]
    assert [i for t, i in order if t == "a"] == list(range(6))  # within a tenant: the given order
    assert [i for t, i in order if t == "b"] == list(range(6))


def test_fair_order_lets_the_tenant_behind_in_virtual_time_go_first_and_leaves_one_tenant_alone():
    items = [("a", 0), ("a", 1), ("b", 0)]
    assert fair_order(items, lambda x: x[0], {"a": 100.0, "b": 0.0}, {}, lambda x: 10)[0] == ("b", 0)
    level = fair_order(items, lambda x: x[0], {"a": 5.0, "b": 5.0}, {}, lambda x: 10, tiebreak={"a": 2.0})
    assert level[0] == ("b", 0)  # level in virtual time: the one holding less of the worker first
    single = [("a", i) for i in range(5)]
    assert fair_order(single, lambda x: x[0], {}, {}, lambda x: 10) == single


def test_a_tenant_coming_back_from_idle_has_no_banked_credit():
    shares = TenantShares()
    shares.join("a", 1.0)
    shares.join("b", 1.0)
    shares.charge("a", 500)
    shares.charge("b", 300)
    shares.leave("b")  # b idle while a keeps going
    shares.charge("a", 1000)
    shares.join("b", 1.0)
    assert shares.vtime["b"] == pytest.approx(1500)  # the least busy virtual time, not its old 300
    assert shares.is_shared
    shares.leave("a")
    shares.leave("b")
    assert not shares.is_shared and shares.vtime == {}


def test_usage_over_share_and_the_tenant_most_over_it():
    usage = usage_over_share({"a": 60, "b": 20}, {"a": 1.0, "b": 1.0, "c": 2.0}, 100)
    assert usage == pytest.approx({"a": 2.4, "b": 0.8, "c": 0.0})  # shares 25, 25, 50
    assert most_over_share(usage, ["b", "a"]) == "a"
    assert most_over_share(usage, []) is None


def test_weighted_split_is_max_min_fair_by_weight():
    assert weighted_split(400, {"a": 1000, "b": 1000}, {"a": 1.0, "b": 3.0}) == pytest.approx({"a": 100, "b": 300})
    # b wants less than its part: it gets what it wants, a the rest (nothing held back while there is work)
    assert weighted_split(400, {"a": 1000, "b": 20}, {"a": 1.0, "b": 3.0}) == pytest.approx({"a": 380, "b": 20})
    split = weighted_split(300, {"a": 1000, "b": 50, "c": 1000}, {"a": 1.0, "b": 1.0, "c": 2.0})
    assert split == pytest.approx({"b": 50, "a": 250 / 3, "c": 500 / 3})
    assert weighted_split(100, {"a": 0}, {}) == {}


# ---------------------------------------------------------------------------- the policy with tenants


def test_one_named_tenant_plans_exactly_as_no_tenant():
    cfg = SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=128, watermark=0.0)
    runs = []
    for tenant in ("", "team-a"):
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        reqs = [tenant_req(f"r{i}", 5 + 7 * i, tenant, max_tokens=12, priority=i % 3) for i in range(8)]
        plans = drive(sched, worker, arrivals={0: reqs[:5], 3: reqs[5:]})
        runs.append([(p.starts and [s.seq_id for s in p.starts], [(c.seq_id, c.start_pos, c.num_tokens)
                                                                   for c in p.chunks], p.releases) for p in plans])
        assert sched.stats().counters.num_fair_share_preemptions == 0
    assert runs[0] == runs[1]


def test_a_flood_of_one_tenant_does_not_hold_back_another_s_request():
    """Tenant A fills every slot and queues more; B's request starts on the next plan (A's latest is preempted
    for it), where without tenants it would wait for A's queue to drain."""
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                          max_model_len=2048, watermark=0.0, long_prefill_threshold=0)
    first: dict[str, int] = {}
    for tenants in (("a", "b"), ("", "")):
        sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
        flood = [tenant_req(f"a{i}", 300, tenants[0], max_tokens=40) for i in range(10)]
        b = tenant_req("b0", 20, tenants[1], max_tokens=8)  # arrives while A's four slots are full, six queued
        starts: dict[str, int] = {}
        plans: list[int] = []
        add = sched.add_request
        sched.add_request = lambda r: (starts.setdefault("arrived", len(plans)) if r is b else None, add(r))

        def on_plan(i, plan):
            plans.append(i)
            for s in plan.starts:
                starts.setdefault(s.seq_id, i)

        drive(sched, worker, arrivals={0: flood, 8: [b]}, on_plan=on_plan)
        first[tenants[0] or "none"] = starts["b0"] - starts["arrived"]
        assert_reference(worker, flood + [b], cfg.max_model_len)
        assert_idle(sched)
        if tenants[0]:
            assert sched.stats().counters.num_fair_share_preemptions >= 1
    assert first["a"] == 0  # B starts on the first plan after it arrives
    assert first["none"] > 40  # FCFS: behind A's queue


def test_a_tenant_at_its_share_does_not_queue_ahead_of_one_under_it():
    """A holds every slot and has more queued; B, ahead of A in virtual time (its streams were served more
    tokens lately, as interactive chats beside a throttled flood are), sends a request: it starts on the next
    plan, one of A's preempted for it. In fair order alone A's queue would come first until A's virtual time
    caught up, and A's head cannot start (A holds its share of the slots): B's first token would wait for A's
    tokens, not for its turn (bench/results/2026-11-29-tenants-ttft.md)."""
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                          max_model_len=2048, watermark=0.0, long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    flood = [tenant_req(f"a{i}", 300, "a", max_tokens=40) for i in range(10)]
    chat = tenant_req("b0", 20, "b", max_tokens=60)
    b1 = tenant_req("b1", 20, "b", max_tokens=8)
    starts: dict[str, int] = {}
    plans: list[int] = []
    add = sched.add_request

    def arrive(req):
        if req is b1:
            # B ahead of A by more than A's queued prompts (weight 1: virtual time is tokens)
            sched.shares.charge("b", sched.shares.vtime["a"] - sched.shares.vtime["b"] + 1000)
            starts["arrived"] = len(plans)
        add(req)

    def on_plan(i, plan):
        plans.append(i)
        for s in plan.starts:
            starts.setdefault(s.seq_id, i)

    sched.add_request = arrive
    drive(sched, worker, arrivals={0: flood + [chat], 12: [b1]}, on_plan=on_plan)
    assert starts["b0"] == 0 and "a9" in starts
    assert starts["b1"] == starts["arrived"]  # the first plan after it arrived
    assert sched.stats().counters.num_fair_share_preemptions >= 1
    assert_reference(worker, flood + [chat, b1], cfg.max_model_len)
    assert_idle(sched)


def under_itl_target(num_blocks: int = 2000, prefill_chunk_s: float = 0.0, **config):
    """(config, policy, fake worker) of a worker with 16 slots and a 512-token budget under a 1.3x ITL target,
    its step costs learned: 2 ms a step, 0.1 ms a token, `prefill_chunk_s` a prefill chunk."""
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                          max_model_len=4096, watermark=0.0, itl_target=ItlTarget(ratio=1.3), **config)
    sched = WorkerPolicy(cfg)
    sched.step_costs = StepCosts(overhead_s=0.002, token_s=1e-4, key_s=0.0, prefill_chunk_s=prefill_chunk_s)
    return cfg, sched, FakeWorker(cfg)


def paused_chat_plans(window_s: float, **config) -> list[tuple[float, int, int, int]]:
    """A's flood of long prompts beside B's chat of two turns, the second sent when the first's last token
    is applied, as a chat client does. Each plan: (planner clock, decode tokens, A's prefill tokens, B's)."""
    cfg, sched, worker = under_itl_target(paused_stream_s=window_s, **config)
    flood = [tenant_req(f"a{i}", 3000, "a", max_tokens=1) for i in range(4)]
    turns = [tenant_req("b0", 24, "b", max_tokens=6), tenant_req("b1", 40, "b", max_tokens=6)]
    plans: list[tuple[float, int, int, int]] = []
    update = sched.update

    def next_turn_when_done(result):
        finished = update(result)
        if "b0" in finished:
            sched.add_request(turns[1])
        return finished

    def on_plan(i, plan):
        prompt = {r.request_id: len(r.prompt_ids) for r in flood + turns}
        tokens = {"decode": 0, "a": 0, "b": 0}
        for c in plan.chunks:
            kind = "decode" if c.start_pos >= prompt[c.seq_id] else c.seq_id[0]
            tokens[kind] += c.num_tokens
        plans.append((sched.steps.clock_s, tokens["decode"], tokens["a"], tokens["b"]))

    sched.update = next_turn_when_done
    drive(sched, worker, depth=2, arrivals={0: flood + turns[:1]}, on_plan=on_plan)
    assert_reference(worker, flood + turns, cfg.max_model_len)
    assert_idle(sched)
    return plans


def test_a_chat_paused_between_turns_keeps_the_other_tenant_s_steps_short():
    """Between two turns of B's chat no stream decodes, so the ITL target would not bound the step, and A's
    flood fills it with long prefill chunks, two plans in flight, that B's next turn waits behind
    (bench/results/2026-11-29-tenants-paused-streams.md). For `paused_stream_s` of planned step time after B's
    last decode, a step with no decode keeps the bound of one stream: B's next turn starts beside a short chunk
    of A's, and past the window A's chunks grow back to what the budget allows."""
    held, off = paused_chat_plans(0.05), paused_chat_plans(0.0, tenant_wait_s=0.0)
    b1_first = next(p for p in held if p[3] == 40)  # B's second prompt, whole in one chunk (it is short)
    last_b_decode = max(i for i, p in enumerate(held) if p[1] and p[0] < b1_first[0])
    paused = held[last_b_decode + 1:held.index(b1_first) + 1]
    assert paused and all(p[1] == 0 for p in paused)  # the steps of the pause: nothing decodes
    # one stream's room at 1.3x: 0.3 x (20 units of overhead + 1) = 6 tokens of A's a step
    assert all(p[2] <= 8 for p in paused), paused
    assert b1_first[2] <= 8
    later = [p for p in held if p[0] > b1_first[0] + 0.06 and not p[1]]
    assert later and max(p[2] for p in later) == 256  # past the window, the long cap's chunks again
    # without it (nor the tenants' wait, which keeps A's long chunks out of a plan pipelined behind B's last
    # decode), the pause's steps are A's long chunks
    b1_first_off = next(i for i, p in enumerate(off) if p[3] == 40)
    assert off[b1_first_off - 1][2] == 256


def test_once_two_tenants_used_a_worker_the_long_cap_holds_in_steps_with_no_decode():
    """A request of another tenant waits for the steps in flight: with two tenants known, a step with no
    decode is held to the long cap (T = 256 units) instead of max_num_batched_tokens (512). A tenant alone
    keeps the whole budget for its long prompts' TTFT."""
    shared = [p for p in paused_chat_plans(0.0) if not p[1] and not p[3]]
    assert shared and max(p[2] for p in shared) == 256
    cfg, sched, worker = under_itl_target()
    plans = drive(sched, worker, arrivals={0: [tenant_req("a0", 3000, "a", max_tokens=1)]})
    assert max(c.num_tokens for p in plans for c in p.chunks) == 512


def flood_plans(b_first: bool) -> list[tuple[int, int, float, int]]:
    """A's flood of long prompts, two plans in flight, with a 20 ms wait for other tenants (a 512-token step
    is ~53 ms here), after B's one request if `b_first`. Each plan with A's tokens: (A's tokens, B's, its
    predicted time, plans in flight with it)."""
    cfg, sched, worker = under_itl_target(tenant_wait_s=0.02)
    flood = [tenant_req(f"a{i}", 3000, "a", max_tokens=1) for i in range(2)]
    earlier = [tenant_req("b0", 20, "b", max_tokens=1)] if b_first else []
    later = [tenant_req("b1", 40, "b", max_tokens=1)]
    plans: list[tuple[int, int, float, int]] = []

    def on_plan(i, plan):
        tokens = {"a": 0, "b": 0}
        for c in plan.chunks:
            tokens[c.seq_id[0]] += c.num_tokens
        plans.append((tokens["a"], tokens["b"], sched.last_budget.predicted_s, sched.stats().num_steps_in_flight))

    drive(sched, worker, depth=2, arrivals={0: earlier, 4: flood, 30: later}, on_plan=on_plan)
    assert_reference(worker, earlier + flood + later, cfg.max_model_len)
    assert_idle(sched)
    return plans


def test_once_two_tenants_used_a_worker_long_chunks_keep_the_plans_in_flight_within_the_wait():
    """A request of another tenant waits for the plans in flight. Once two tenants have used the worker, A's
    long chunks in a step with no decode keep it within `tenant_wait_s` of predicted time and are not
    pipelined behind another plan: one plan of A's at a time, each within the wait, and B's request starts in
    the plan after the one in flight when it arrives. A tenant alone keeps whole budgets, two plans in
    flight."""
    shared = flood_plans(b_first=True)
    a_only = [p for p in shared if p[0] and not p[1]]
    # (20 ms - 2 ms of fixed cost) / 0.1 ms a token; a prompt at the head of the queue starts with a token
    # even past the bound, as it does past the budget
    assert a_only and all(p[0] <= 181 and p[2] <= 0.0201 + 1e-9 and p[3] == 1 for p in a_only), a_only
    assert max(p[0] for p in a_only) == 181 and sum(p[0] == 180 for p in a_only) > len(a_only) / 2
    b1 = next(i for i, p in enumerate(shared) if p[1] == 40)
    assert shared[b1][3] <= 2 and shared[b1 - 1][2] <= 0.0201 + 1e-9
    alone = [p for p in flood_plans(b_first=False) if p[0] and not p[1]]
    assert max(p[0] for p in alone) == 512 and max(p[3] for p in alone) == 2


def test_a_chat_s_prompts_take_the_part_of_the_budget_a_held_back_flood_cannot_spend():
    """B's 8 prompts (480 tokens) arrive beside A's flood while one of A's streams decodes: the ITL target
    holds A's long chunks to a few tokens, so B's prompts all start in the step they arrive in. Split by
    weight over what A has to prefill, B would get half of the step and its prompts would start two steps
    apart, A's half unspent."""
    cfg, sched, worker = under_itl_target()
    flood = [tenant_req("a-stream", 8, "a", max_tokens=300)] + [tenant_req(f"a{i}", 3000, "a", max_tokens=1)
                                                                 for i in range(2)]
    chats = [tenant_req(f"b{i}", 60, "b", max_tokens=2) for i in range(8)]
    starts: dict[str, int] = {}

    def on_plan(i, plan):
        for s in plan.starts:
            starts.setdefault(s.seq_id, i)

    drive(sched, worker, depth=2, arrivals={0: flood, 10: chats}, on_plan=on_plan)
    assert {starts[c.request_id] for c in chats} == {starts["b0"]}, starts
    assert_reference(worker, flood + chats, cfg.max_model_len)
    assert_idle(sched)


def test_a_chat_s_first_turn_starts_whole_in_a_short_step_beside_a_flood():
    """B's 8 prompts (480 tokens) arrive while nothing of B's decodes and A's long prompts prefill. The step
    they start in keeps the ITL target's bound of one stream, as for a chat paused between turns: A's long
    chunks get what it leaves (a few tokens, no floor: the step is not for A's streams), so B's whole turn
    starts in that step and its first tokens come from a step not stretched by A's chunk. Split by weight, B
    would get half of the step and its prompts would start two steps apart, each beside 256 units of A's."""
    cfg, sched, worker = under_itl_target()
    flood = [tenant_req(f"a{i}", 3000, "a", max_tokens=1) for i in range(2)]
    chats = [tenant_req(f"b{i}", 60, "b", max_tokens=2) for i in range(8)]
    starts: dict[str, int] = {}
    a_tokens: dict[int, int] = {}

    def on_plan(i, plan):
        for s in plan.starts:
            starts.setdefault(s.seq_id, i)
        a_tokens[i] = sum(c.num_tokens for c in plan.chunks if c.seq_id.startswith("a"))

    drive(sched, worker, depth=2, arrivals={0: flood, 10: chats}, on_plan=on_plan)
    first = starts["b0"]
    assert {starts[c.request_id] for c in chats} == {first}, starts
    # one stream's room at 1.3x: 0.3 x (20 units of overhead + 1) = 6 tokens of A's
    assert a_tokens[first] <= 6 and a_tokens[first - 1] == 512, a_tokens  # before: A alone, the whole budget
    assert_reference(worker, flood + chats, cfg.max_model_len)
    assert_idle(sched)


def test_a_turn_of_several_chats_starts_together_when_a_flood_holds_every_slot():
    """A holds all 8 slots; B's four chats send their next turns at once. Each needs a slot from A (over its
    share of 4), and all four start in the plan after they arrive: made room for one at a time, the fourth
    would start three steps after the first."""
    cfg = SchedulerConfig(num_blocks=1000, block_size=16, max_num_seqs=8, max_num_batched_tokens=2048,
                          max_model_len=2048, watermark=0.0, long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    flood = [tenant_req(f"a{i}", 600, "a", max_tokens=40) for i in range(12)]
    chats = [tenant_req(f"b{i}", 20, "b", max_tokens=4) for i in range(4)]
    starts: dict[str, int] = {}
    running_at_arrival = []

    def on_plan(i, plan):
        for s in plan.starts:
            starts.setdefault(s.seq_id, i)
        if i == 5:
            running_at_arrival.append(sched.num_running)

    drive(sched, worker, arrivals={0: flood, 6: chats}, on_plan=on_plan)
    assert running_at_arrival == [8]  # A holds every slot when B's turn arrives
    assert {starts[c.request_id] for c in chats} == {6}, starts
    assert sched.stats().counters.num_fair_share_preemptions >= 4
    assert_reference(worker, flood + chats, cfg.max_model_len)
    assert_idle(sched)


def test_prefill_tokens_are_shared_by_weight():
    cfg = SchedulerConfig(num_blocks=2000, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=4096, watermark=0.0, long_prefill_threshold=0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    a = [tenant_req(f"a{i}", 1500, "a", weight=1.0, max_tokens=2) for i in range(4)]
    b = [tenant_req(f"b{i}", 1500, "b", weight=3.0, max_tokens=2) for i in range(4)]
    tokens = {"a": 0, "b": 0}

    def count(i, plan):
        if i < 16:  # while both still have prompts to prefill
            for c in plan.chunks:
                tokens[c.seq_id[0]] += c.num_tokens

    drive(sched, worker, arrivals={0: a + b}, on_plan=count)
    assert tokens["b"] / tokens["a"] == pytest.approx(3.0, rel=0.15), tokens
    assert_reference(worker, a + b, cfg.max_model_len)
    assert_idle(sched)


def test_a_decode_short_of_a_block_preempts_the_tenant_most_over_its_share():
    cfg = SchedulerConfig(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=64, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    # a holds three sequences (most blocks), b one that arrived last: without tenants b would be the victim
    reqs = [tenant_req(f"a{i}", 3, "a", max_tokens=12) for i in range(3)] + [tenant_req("b0", 3, "b", max_tokens=12)]
    for r in reqs:
        sched.add_request(r)
    while True:
        plan = sched.schedule()
        if sched.stats().counters.num_preemptions:
            break
        sched.update(worker.run(plan))
    assert plan.releases and plan.releases[0].startswith("a"), plan.releases
    sched.update(worker.run(plan))
    drive(sched, worker)
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)


def test_priority_orders_within_a_tenant_not_across_tenants():
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=1, max_num_batched_tokens=256,
                          max_model_len=2048, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    reqs = [tenant_req("a-low", 8, "a", priority=5), tenant_req("a-high", 8, "a", priority=0),
            tenant_req("b-low", 8, "b", priority=9)]
    order: list[str] = []
    drive(sched, worker, arrivals={0: reqs}, on_plan=lambda i, p: order.extend(s.seq_id for s in p.starts))
    assert order.index("a-high") < order.index("a-low")  # within a: by priority
    assert order.index("b-low") < order.index("a-low")  # across tenants: b's turn comes, whatever a claims


def test_a_high_priority_request_behind_a_full_queue_gets_its_first_token_in_one_round():
    """A full queue of low-priority prompts, then a high-priority one: it starts on the very next plan and
    that plan samples its first token (its prompt fits the head's reserve)."""
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                          max_model_len=4096, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    low = [tenant_req(f"low{i}", 300, "a", priority=10) for i in range(40)]
    high = tenant_req("high", 60, "a", priority=0)
    sampled_at: dict[str, int] = {}

    def on_plan(i, plan):
        for c in plan.chunks:
            if c.seq_id == "high" and c.start_pos + c.num_tokens == 60:
                sampled_at.setdefault("high", i)

    drive(sched, worker, arrivals={0: low, 3: [high]}, on_plan=on_plan)
    assert sampled_at["high"] == 3
    assert worker.published["high"]
    assert_reference(worker, low + [high], cfg.max_model_len)


def test_prefix_blocks_are_shared_within_a_cache_scope_only():
    cfg = SchedulerConfig(num_blocks=200, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                          max_model_len=2048, watermark=0.0)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    cached: dict[str, int] = {}

    def run(req):
        drive(sched, worker, arrivals={0: [req]},
              on_plan=lambda i, p: cached.update({s.seq_id: s.cached_tokens for s in p.starts}))

    run(tenant_req("a1", 200, "a", prompt_of="p"))
    run(tenant_req("a2", 200, "a", prompt_of="p"))  # same tenant: hits
    run(tenant_req("b1", 200, "b", prompt_of="p"))  # another tenant, same prompt: misses
    run(tenant_req("a3", 200, "a", salt="s1", prompt_of="p"))  # a salt of one key: misses
    run(tenant_req("c1", 200, "c", scope="a", prompt_of="p"))  # a tenant the operator lets share a's: hits
    assert cached == {"a1": 0, "a2": 192, "b1": 0, "a3": 0, "c1": 192}
    # and routing sees the same: a's prompt is cached for a's scope only
    prompt = make_req("p", 200).prompt_ids
    from phaseserve.scheduler.prefix_index import scope_seed
    assert sched.num_cached_tokens(prompt, scope_seed("a", "")) == 192
    assert sched.num_cached_tokens(prompt, scope_seed("b", "")) == 192  # b1 ran: b's own copy now
    assert sched.num_cached_tokens(prompt, scope_seed("d", "")) == 0
    assert sched.num_cached_tokens(prompt) == 0


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("caching", [True, False])
def test_random_load_of_three_tenants_keeps_every_invariant_and_matches_reference(depth, chunked, caching):
    """Random prompts, weights, priorities, salts and arrivals of three tenants on a small pool (preemptions,
    fair-share ones among them): every plan passes the policy's checks (budget, blocks, decodes first) and
    every stream is the unscheduled reference's."""
    import random

    rng = random.Random(11 + depth)
    cfg = SchedulerConfig(num_blocks=48, block_size=8, max_num_seqs=6, max_num_batched_tokens=128,
                          max_model_len=320, enable_chunked_prefill=chunked, attention_horizon=100,
                          long_prefill_threshold=48, enable_prefix_caching=caching)
    sched, worker = WorkerPolicy(cfg), FakeWorker(cfg)
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    arrivals: dict[int, list] = {}
    reqs = []
    for i in range(45):
        t = rng.choice("aab c".replace(" ", "c"))
        r = tenant_req(f"{t}{i}", rng.randint(1, 200), t, weights[t], max_tokens=rng.randint(1, 30),
                       priority=rng.choice([0, 0, 1]), salt=rng.choice(["", "", "s"]),
                       prompt_of=f"p{rng.randint(0, 6)}")  # shared prompts: hits within a scope only
        reqs.append(r)
        arrivals.setdefault(rng.randint(0, 120), []).append(r)
    drive(sched, worker, depth=depth, arrivals=arrivals)
    st = sched.stats()
    assert st.counters.num_preemptions > 0 and st.counters.num_finished == 45 and st.counters.num_resyncs == 0
    assert_reference(worker, reqs, cfg.max_model_len)
    assert_idle(sched)
    assert not sched.shares.active and not sched.shares.vtime


def test_a_flood_s_promised_blocks_count_as_its_holding():
    """A's long prompts prefill a few tokens a step beside A's stream (the ITL target) and hold few blocks,
    but each is promised the blocks to finish, and the promises fill the cache. Those count as A's: A is over
    its share, so B's four chats preempt A's latest prompts and start in the plan they arrive in. Counted by
    the blocks held alone, A looks under its share and B's chats wait for A's prompts to finish."""
    cfg, sched, worker = under_itl_target(num_blocks=380)
    flood = [tenant_req("a-stream", 8, "a", max_tokens=200)] + [tenant_req(f"a{i}", 1000, "a", max_tokens=1)
                                                                 for i in range(8)]
    chats = [tenant_req(f"b{i}", 40, "b", max_tokens=4) for i in range(4)]
    starts: dict[str, int] = {}
    promised_full = []

    def on_plan(i, plan):
        for s in plan.starts:
            starts.setdefault(s.seq_id, i)
        if i == 9:
            promised_full.append(sched.kv.num_free_blocks - sched.steps.promised_blocks() < 3)

    drive(sched, worker, depth=2, arrivals={0: flood, 10: chats}, on_plan=on_plan)
    assert promised_full == [True]  # A's promises hold the cache when B's turn arrives
    assert {starts[c.request_id] for c in chats} == {10}, starts
    assert sched.stats().counters.num_fair_share_preemptions >= 1
    assert_reference(worker, flood + chats, cfg.max_model_len)
    assert_idle(sched)


def long_prompt_beside_streams(chat_tenant: str) -> list[tuple[int, int]]:
    """A's long prompt beside four chat streams of `chat_tenant`, under an ITL target that leaves no room for a
    prefill chunk (a chunk's own cost is more than 0.3 x the decode step). Each plan with decodes: (decode
    tokens, the long prompt's tokens)."""
    cfg, sched, worker = under_itl_target(prefill_chunk_s=0.002)
    chats = [tenant_req(f"chat{i}", 24, chat_tenant, max_tokens=30) for i in range(4)]
    flood = [tenant_req("long", 3000, "a", max_tokens=1)]
    plans: list[tuple[int, int]] = []

    def on_plan(i, plan):
        decodes = sum(c.num_tokens for c in plan.chunks if c.seq_id != "long" and c.start_pos >= 24)
        if decodes:
            plans.append((decodes, sum(c.num_tokens for c in plan.chunks if c.seq_id == "long")))

    drive(sched, worker, depth=2, arrivals={0: chats, 2: flood}, on_plan=on_plan)
    assert_reference(worker, chats + flood, cfg.max_model_len)
    assert_idle(sched)
    return plans


def test_a_long_prompt_beside_another_tenant_s_streams_gets_only_the_itl_target_s_room():
    """The floor (a long prompt moves at least a token a step beside streams) exists so one tenant's streams
    cannot starve its own long prompts. Beside another tenant's streams it would stretch every one of their
    steps by a chunk's cost, past the target: there the long prompt gets what the target leaves, here none,
    and its tokens wait for the streams to end. With one tenant it still moves every step."""
    other = long_prompt_beside_streams("b")
    # one token as it starts (the head of the queue starts on the next plan), then nothing beside the streams
    assert len(other) >= 25 and sum(long for _, long in other) == 1, other
    own = long_prompt_beside_streams("a")
    assert len(own) >= 25 and all(long >= 1 for _, long in own[1:]), own
