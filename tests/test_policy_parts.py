"""The parts `WorkerPolicy` is composed of, each through its own interface: the KV cache manager, the draft
planner, the handoff book, the sequence queues and the tenant planner. Pure: no Redis, no model (the policy
driven whole is tests/test_scheduler_policy.py and its neighbours)."""

from __future__ import annotations

import pytest

from phaseserve.kv_admission import KVCapacity
from phaseserve.params import SamplingParams
from phaseserve.scheduler_stats import PrefixCacheStats, SpecDecodingStats
from phaseserve.wire import ScheduledChunk, StepResult, SubmitRequest, TokenEvent
from phaseserve.scheduler.budget import StepBudget, StepDraft
from phaseserve.scheduler.config import SchedulerConfig
from phaseserve.scheduler.draft_planner import DraftPlanner
from phaseserve.scheduler.fair_share import TenantShares
from phaseserve.scheduler.handoff_book import Handoff, HandoffBook
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.sequence import Sequence, SequenceStatus
from phaseserve.scheduler.sequence_queues import SequenceQueues
from phaseserve.scheduler.step_cost import StepCosts
from phaseserve.scheduler.tenant_planner import TenantPlanner


def req(rid: str, prompt: list[int], max_tokens: int = 8, tenant: str = "", priority: int = 0) -> SubmitRequest:
    return SubmitRequest(rid, "gw0", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                         tenant=tenant, priority=priority)


def running_seq(kv: KVCacheManager, rid: str, prompt: list[int], arrival: int = 0) -> Sequence:
    """A sequence started on its cached prefix with its whole prompt planned (as the policy would)."""
    seq = Sequence(req(rid, prompt), arrival, status=SequenceStatus.RUNNING)
    seq.prefill_len = len(prompt)
    seq.num_computed_tokens = seq.num_cached_tokens = kv.start_on_cached_prefix(seq)
    kv.allocate_slots(seq.block_table, seq.num_computed_tokens, len(prompt) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(prompt)
    return seq


# ---------------------------------------------------------------------------- KV cache manager


def test_kv_cache_manager_finds_what_is_cached_after_a_result_confirms_it():
    kv = KVCacheManager(num_blocks=16, block_size=4, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    a = running_seq(kv, "a", prompt)
    assert len(a.block_table) == 5 and kv.num_used_blocks == 5 and kv.num_free_blocks == 11
    # planned but unconfirmed: nothing is cached yet, for a sequence nor for routing
    b = Sequence(req("b", prompt + [7]), 1)
    assert kv.computed_blocks(b) == [] and kv.num_cached_tokens(prompt) == 0
    # the first token is confirmed: the full blocks before it are named
    a.output_ids.append(5)
    kv.cache_confirmed_blocks(a)
    assert a.num_named_blocks == 4
    assert kv.computed_blocks(b) == a.block_table[:4]
    assert kv.num_cached_tokens(prompt) == 16
    # b starts on them: shared, not taken from the free pool, and counted as a hit
    assert kv.blocks_to_admit(b, kv.blocks_for(19)) == 1  # 5 blocks, 4 of them held already
    b.status = SequenceStatus.RUNNING
    assert kv.start_on_cached_prefix(b) == 16 and b.block_table == a.block_table[:4]
    assert kv.block_manager.refs(a.block_table[0]) == 2
    assert kv.stats() == PrefixCacheStats(queries=len(prompt) + 19, hits=16, evictions=0, cached_blocks=4)
    # freed: cached blocks stay named and count as free; a later one still finds them
    kv.free(a.block_table)
    kv.free(b.block_table)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16 and kv.stats().cached_blocks == 4
    assert kv.num_cached_tokens(prompt) == 16


def test_kv_cache_manager_waits_for_a_block_another_sequence_is_computing():
    kv = KVCacheManager(num_blocks=16, block_size=4, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(50, 60))
    a = running_seq(kv, "a", prompt)  # computing its blocks now, none confirmed
    b = Sequence(req("b", prompt + [1]), 1)
    assert kv.waits_for_prefix(b, [a])  # a's first block is b's first block: b starts on it once confirmed
    assert not kv.waits_for_prefix(Sequence(req("c", [9] * 11), 2), [a])  # nothing in common
    a.output_ids.append(3)
    kv.cache_confirmed_blocks(a)
    assert not kv.waits_for_prefix(b, [a])  # confirmed: b starts on the cached blocks


def test_kv_cache_manager_without_prefix_caching_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=False)
    a = running_seq(kv, "a", list(range(12)))
    a.output_ids.append(1)
    kv.cache_confirmed_blocks(a)
    b = Sequence(req("b", list(range(12))), 1)
    assert kv.computed_blocks(b) == [] and kv.num_cached_tokens(list(range(12))) == 0
    assert kv.stats() == PrefixCacheStats()
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        kv.allocate_slots(a.block_table, 12, 100)


# ---------------------------------------------------------------------------- draft planner


def spec_config(k: int = 3, adaptive: bool = False) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=256,
                           speculative_tokens=k, speculative_adaptive=adaptive)


def test_draft_planner_gives_drafts_within_spare_blocks_and_settles_what_was_kept():
    cfg = spec_config(k=3)
    kv = KVCacheManager(cfg.num_blocks, cfg.block_size, 0.0, False)
    drafts = DraftPlanner(cfg)
    seq = running_seq(kv, "a", list(range(8)))  # two full blocks
    step, budget = StepDraft(), StepBudget.for_step(cfg)
    kv.allocate_slots(seq.block_table, 8, 1)
    step.decodes.append(ScheduledChunk("a", 8, 1, list(seq.block_table)))
    seq.num_computed_tokens = 9
    # no spare block: only what its table already holds past the decode (positions 9..11)
    drafts.plan(step, budget, kv, 0, {"a": seq}, step_id=7, step_costs=None)
    (c,) = step.decodes
    assert c.num_draft == 3 and seq.num_computed_tokens == 12 and seq.drafts_in_step == {7: 3}
    assert drafts.stats.num_draft_slots == 3
    # the worker verified 3 and kept 1 (two tokens: the kept draft and the draw after it)
    drafts.settle(seq, 7, TokenEvent("a", 0, [1, 2]), drafted=3)
    assert seq.num_inflight_drafts == 0 and seq.num_computed_tokens == 10
    assert drafts.stats == SpecDecodingStats(3, 3, 1, 1, [1, 1, 1], [1, 0, 0])
    # a lost step's drafts are released without counting a verification
    seq.drafts_in_step[8] = 2
    seq.num_inflight_drafts = 2
    drafts.settle(seq, 8, None)
    assert seq.num_inflight_drafts == 0 and drafts.stats.num_verifications == 1


def test_draft_planner_offers_nothing_when_speculation_is_off():
    cfg = spec_config(k=0)
    kv = KVCacheManager(cfg.num_blocks, cfg.block_size, 0.0, False)
    seq = running_seq(kv, "a", list(range(6)))
    step = StepDraft()
    step.decodes.append(ScheduledChunk("a", 6, 1, list(seq.block_table)))
    DraftPlanner(cfg).plan(step, StepBudget.for_step(cfg), kv, 10, {"a": seq}, 0, None)
    assert step.decodes[0].num_draft == 0 and seq.drafts_in_step == {}


def test_draft_planner_learns_the_verify_cost_only_from_plausible_costs():
    drafts = DraftPlanner(spec_config())
    costs = StepCosts(overhead_s=0.01, token_s=0.001, key_s=0.0)
    prior = drafts.verify_cost.units
    drafts.learn_verify_cost(StepResult(1, "w", [], step_time_s=0.5, ran=(4, 4, 0), drafted={"a": 2}), None)
    assert drafts.verify_cost.with_count == 0  # no learned costs yet: nothing to measure against
    for i in range(20):
        with_drafts = StepResult(i, "w", [], step_time_s=costs.predict(4, 4, 0) + 0.002, ran=(4, 4, 0),
                                 drafted={"a": 2})
        without = StepResult(i, "w", [], step_time_s=costs.predict(4, 4, 0), ran=(4, 4, 0))
        drafts.learn_verify_cost(with_drafts, costs)
        drafts.learn_verify_cost(without, costs)
    assert drafts.verify_cost.units == pytest.approx(2.0, rel=0.01) and drafts.verify_cost.units != prior


# ---------------------------------------------------------------------------- handoff book


def test_handoff_book_names_transfers_and_reports_ready_sequences_once():
    book = HandoffBook("p1")
    assert book.new_send() is None  # no decode worker: prefills stay here
    book.kv_transport = "shm"
    s1, s2 = book.new_send(), book.new_send()
    assert s1.transport == "shm" and s1.transfer_id != s2.transfer_id and s1.transfer_id.startswith("p1-")
    seq = Sequence(req("a", [1, 2, 3, 4, 5]), 0, [9], status=SequenceStatus.RUNNING)
    seq.prefill_len, seq.kv_send, seq.awaiting_handoff = 5, s1, True
    gone = Sequence(req("b", [1]), 1)
    book.first_token_confirmed(seq)
    book.first_token_confirmed(gone)
    assert book.take_ready({"a": seq}) == ["a"] and book.take_ready({"a": seq}) == []
    handoff = book.handoff_of(seq)
    assert handoff == Handoff(seq.request, [9], 5, s1)
    receive = book.receive(handoff, [3, 4], timeout_s=1.5)
    assert (receive.seq_id, receive.transfer_id, receive.block_ids, receive.num_tokens) == ("a", s1.transfer_id,
                                                                                             [3, 4], 5)
    book.keep(seq)
    assert not seq.awaiting_handoff and seq.kv_send is None


# ---------------------------------------------------------------------------- sequence queues


def test_sequence_queues_keep_rank_order_and_release_what_the_worker_holds():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=False)
    shares = TenantShares()
    q = SequenceQueues(kv, shares)
    low = q.new(req("low", [1, 2, 3], priority=5), [])
    high = q.new(req("high", [1, 2, 3, 4, 5], priority=0), [])
    assert q.waiting == [high, low] and q.queued_prefill_tokens == 8
    with pytest.raises(ValueError, match="already scheduled"):
        q.new(req("low", [1]), [])
    q.start(high)
    high.prefill_len = 5
    kv.allocate_slots(high.block_table, 0, 5)
    high.on_worker = True
    assert q.running == [high] and q.unprefilled() == [(low, 3, 0), (high, 5, 0)]
    q.send_back(high)  # preempted: its blocks go, the worker is told, it waits again in rank order
    assert q.waiting == [high, low] and kv.num_used_blocks == 0 and q.take_releases() == ["high"]
    assert high.status is SequenceStatus.WAITING and high.num_computed_tokens == 0
    assert [s.seq_id for s in q.take_waiting()] == ["high", "low"]
    assert q.seqs == {} and not shares.active


# ---------------------------------------------------------------------------- tenant planner


def test_tenant_planner_takes_from_the_tenant_furthest_over_its_share():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=False)
    shares = TenantShares()
    q = SequenceQueues(kv, shares)
    tenants = TenantPlanner(shares, kv, KVCapacity(8, 4, 64, watermark=0.0), max_num_seqs=4)
    hog = [q.new(req(f"a{i}", [1] * 8, tenant="a"), []) for i in range(3)]
    for s in hog:
        q.start(s)
        kv.allocate_slots(s.block_table, 0, 8)
    newcomer = q.new(req("b0", [2] * 4, tenant="b"), [])
    usage = tenants.usage(q.running)
    assert usage["a"] > 1.0 and usage["b"] == 0.0  # a holds 6 of 8 blocks and 3 of 4 slots
    assert tenants.victim(q.running, StepDraft()) is hog[-1]  # the lowest-ranked of the tenant over
    assert tenants.victim_for(newcomer, q.running) is hog[-1]
    # tenant b is behind in virtual time: it is tried first
    shares.charge("a", 100)
    assert tenants.admission_order(q.waiting, q.running, StepDraft())[0] is newcomer
