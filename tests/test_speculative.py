"""Speculative decoding: the worker's ngram proposer and verification, the scheduler's adaptive rule and its
bookkeeping with plans in flight, and the outputs: greedy identical with it on and off (float32) on the
bundled model, a random GQA model and the default model, under preemption, with a stop token or max_tokens
inside an accepted run, several sequences of one prompt; seeded samples identical; unseeded samples drawn
from the model's distribution (a chi-square test over many draws on a vocabulary of 8)."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest

from model_factory import make_model
from phaseserve.models.model_source import bundled_model_path, resolve_model
from phaseserve.params import SamplingParams
from phaseserve.speculative_config import SpeculativeConfig, parse_speculative_config
from phaseserve.stack.engine import Engine
from phaseserve.wire import ScheduledChunk, StepResult, SubmitRequest, TokenEvent
from phaseserve.scheduler.config import SchedulerConfig
from phaseserve.scheduler.policy import WorkerPolicy
from phaseserve.scheduler_stats import SpecDecodingStats
from phaseserve.scheduler.draft_rule import Acceptance, DraftCandidate, choose_drafts
from phaseserve.scheduler.step_cost import StepCosts
from phaseserve.workers.ngram_drafts import NgramProposer
from phaseserve.workers.token_acceptance import accepted_run

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


# ---------------------------------------------------------------- the worker's proposer and verification


def test_ngram_proposes_the_continuation_of_the_latest_earlier_occurrence_longest_n_first():
    p = NgramProposer(1, 3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" occurred twice before; the latest (followed by 9, 2) wins over the first (8, 1)
    assert p.propose(tokens, 3) == [9, 2, 6]
    tokens += [9]  # "6 7 9" now matches at length 3: continuation 2, 6, 7, 9
    assert p.propose(tokens, 10) == [2, 6, 7, 9]
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 3) == []  # no earlier "3 4"
    assert NgramProposer(1, 1).propose([4, 1, 2, 4], 2) == [1, 2]
    assert p.propose(tokens, 0) == []


def test_ngram_index_built_incrementally_equals_one_built_at_once():
    tokens = [(i * 7) % 5 for i in range(60)]
    inc = NgramProposer(1, 4)
    for n in range(1, len(tokens) + 1):
        assert inc.propose(tokens[:n], 4) == NgramProposer(1, 4).propose(tokens[:n], 4)


def test_a_verification_keeps_the_drafts_equal_to_the_draws_and_the_draw_after_them():
    assert accepted_run([3, 4, 5], [3, 4, 9, 1]) == 2
    assert accepted_run([3, 4, 5], [3, 4, 5, 1]) == 3
    assert accepted_run([3], [2, 3]) == 0
    assert accepted_run([], [7]) == 0


def test_the_speculative_config_is_vllms_json_and_bad_values_say_what_is_wrong():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert cfg == SpeculativeConfig("ngram", 3, 1, 5)
    assert parse_speculative_config(str(cfg)) == cfg  # what `up` hands its workers
    assert parse_speculative_config("") is None and parse_speculative_config("off") is None
    for bad, says in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative"),
                      ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup"),
                      ('{"k": 2}', "unknown keys"), ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=says):
            parse_speculative_config(bad)


# ---------------------------------------------------------------- the scheduler's rule


def cand(key, rate=0.8, fill=1.0, position=100, max_drafts=4):
    return DraftCandidate(key, position, max_drafts, rate, fill)


def test_the_rule_speculates_where_a_steps_fixed_cost_dominates():
    # one decode, a fixed cost of 25 token-units: a draft kept 80% of the time is nearly free
    chosen = choose_drafts([cand("a")], step_units=26, step_tokens=1, chunk_units=1, horizon=2048, budget_units=500)
    assert chosen == {"a": 4}


def test_the_rule_stops_when_the_batch_is_compute_bound_or_acceptance_is_low():
    many = [cand(i) for i in range(32)]
    # 32 decodes at 25 + 32 units: a step already brings ~0.56 tokens a unit, a draft at most 0.8 / 2
    assert choose_drafts(many, step_units=57, step_tokens=32, chunk_units=1, horizon=2048, budget_units=500) == {}
    # one decode, but its drafts are rarely kept
    assert choose_drafts([cand("a", rate=0.03)], step_units=26, step_tokens=1, chunk_units=1, horizon=2048,
                         budget_units=500) == {}
    # a worker that seldom finds a draft for it (fill) is worth as little
    assert choose_drafts([cand("a", fill=0.02)], step_units=26, step_tokens=1, chunk_units=1, horizon=2048,
                         budget_units=500) == {}


def test_the_rule_goes_deeper_for_better_acceptance_and_keeps_within_the_budget():
    few = choose_drafts([cand("lo", rate=0.35), cand("hi", rate=0.95)], step_units=12, step_tokens=2,
                        chunk_units=1, horizon=2048, budget_units=500)
    assert few.get("hi", 0) > few.get("lo", 0) >= 0 and few["hi"] == 4
    tight = choose_drafts([cand("a", max_drafts=8)], step_units=26, step_tokens=1, chunk_units=1, horizon=2048,
                          budget_units=3.5)
    assert tight == {"a": 2}  # 1 + 1 chunk unit + ~1 > 3.5 - ...: what fits


def test_every_chosen_draft_raises_expected_tokens_per_unit_of_step_time():
    """The rule's invariant, over many random steps: the chosen drafts never lower the step's expected tokens
    per unit against decoding alone, and adding the best draft left would lower it."""
    import random
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 24)
        cands = [cand(i, rate=rng.random(), fill=rng.random(), position=rng.randint(1, 2000)) for i in range(n)]
        overhead = rng.uniform(0, 60)
        base = overhead + sum(1 + (c.position + 1) / 2048 for c in cands)
        chosen = choose_drafts(cands, step_units=base, step_tokens=n, chunk_units=1.0, horizon=2048,
                               budget_units=1e9)
        units, tokens = base, float(n)
        for c in cands:
            for j in range(1, chosen.get(c.key, 0) + 1):
                units += 1 + (c.position + j + 1) / 2048 + (1.0 if j == 1 else 0.0)
                tokens += c.fill * c.rate ** j
        assert tokens / units >= n / base - 1e-12


def test_acceptance_follows_what_the_worker_reports_and_recovers_when_idle():
    a = Acceptance()
    assert a.rate == pytest.approx(0.5)
    for _ in range(20):
        a.observe(4, 4)
    assert a.rate > 0.9 and a.fill > 0.9
    for _ in range(20):
        a.observe(4, 0)
    assert a.rate < 0.2
    low = a.rate
    for _ in range(200):
        a.rest()
    assert a.rate > low + 0.2  # pulled back toward the prior: it is tried again
    a.observe(0, 0)
    assert a.fill < 1.0
    s = SpecDecodingStats()
    s.observe(3, 1)
    s.observe(1, 1)
    assert s.drafted_at == [2, 1, 1] and s.accepted_at == [2, 0, 0]
    assert (s + s).num_accepted_tokens == 4 and (s + s).drafted_at == [4, 2, 2]


# ---------------------------------------------------------------- the policy, plans in flight


def spec_policy(k=3, adaptive=False, num_blocks=64, **kw):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                          speculative_tokens=k, speculative_adaptive=adaptive, watermark=0.0, **kw)
    return WorkerPolicy(cfg)


def submit(policy, rid, n_prompt=6, max_tokens=20, first=1):
    policy.add_request(SubmitRequest(rid, "gw", list(range(first, first + n_prompt)),
                                     SamplingParams(max_tokens=max_tokens, temperature=0.0)))


def test_plans_in_flight_carry_the_highest_position_and_the_slack_below_it():
    policy = spec_policy(k=3)
    submit(policy, "a")
    p0 = policy.schedule()  # the prefill: samples output 0
    (c0,) = p0.chunks
    assert (c0.start_pos, c0.num_tokens, c0.num_draft) == (0, 6, 0)
    p1 = policy.schedule()  # the first decode, planned before p0's result: position 6, up to 3 drafts
    (c1,) = p1.chunks
    assert (c1.start_pos, c1.num_tokens, c1.num_draft, c1.slack) == (6, 1, 3, 0)
    assert len(c1.block_table) * 4 >= 6 + 1 + 3
    p2 = policy.schedule()  # two plans ahead: the highest start is 10, and it may be 3 below
    (c2,) = p2.chunks
    assert (c2.start_pos, c2.num_draft, c2.slack) == (10, 3, 3)
    assert len(c2.block_table) * 4 >= 10 + 1 + 3
    policy.update(StepResult(p0.step_id, "local", [TokenEvent("a", 0, [50])]))
    # p1 kept one draft of the three it was allowed: the bound comes down by two
    policy.update(StepResult(p1.step_id, "local", [TokenEvent("a", 1, [51, 52])], drafted={"a": 3}))
    p3 = policy.schedule()
    (c3,) = p3.chunks
    assert (c3.start_pos, c3.slack) == (12, 3)  # 8 (after p1) + 4 at most from p2
    assert policy.stats().spec_decoding == SpecDecodingStats(num_draft_slots=9, num_draft_tokens=3,
                                                             num_accepted_tokens=1, num_verifications=1,
                                                             drafted_at=[1, 1, 1], accepted_at=[1, 0, 0])


def test_drafts_never_plan_past_max_tokens_and_never_preempt():
    policy = spec_policy(k=4)
    submit(policy, "a", max_tokens=4)
    policy.schedule()
    (c1,) = policy.schedule().chunks
    assert c1.num_draft == 2  # outputs 0 (prefill) and 1 (this decode) planned: 2 more reach max_tokens
    assert policy.schedule() is None or not policy.schedule().chunks  # nothing more may be planned yet
    # a cache with no block to spare: the decode runs, its drafts get only what its table already holds
    tight = spec_policy(k=4, num_blocks=4)
    submit(tight, "b", n_prompt=7, max_tokens=8)
    submit(tight, "c", n_prompt=7, max_tokens=8, first=20)  # no prefix shared with "b"
    tight.schedule()
    plan = tight.schedule()
    assert tight.stats().counters.num_preemptions == 0 and tight.num_free_blocks == 0 and len(plan.chunks) == 2
    for c in plan.chunks:
        assert c.num_draft == 0 and c.start_pos + 1 <= len(c.block_table) * 4


def test_a_lost_step_with_drafts_is_recomputed_and_its_slack_released():
    policy = spec_policy(k=2)
    submit(policy, "a")
    p0, p1, p2 = policy.schedule(), policy.schedule(), policy.schedule()
    policy.update(StepResult(p0.step_id, "local", [TokenEvent("a", 0, [9])]))
    policy.update(StepResult(p2.step_id, "local", []))  # p1's result never came: "a" is recomputed
    seq = policy.queues.seqs["a"]
    assert seq.num_inflight_drafts == 0 and seq.drafts_in_step == {} and seq.num_inflight_samples == 0
    assert policy.num_waiting == 1


def test_adaptive_speculation_waits_for_learned_costs_to_say_it_pays():
    # a worker whose step is all per-token work (no fixed cost): a draft never pays
    policy = spec_policy(k=4, adaptive=True)
    policy.step_costs = StepCosts(overhead_s=1e-6, token_s=1e-3, key_s=1e-7)
    submit(policy, "a")
    policy.schedule()
    (c,) = policy.schedule().chunks
    assert c.num_draft == 0
    # one dominated by its fixed cost (reading the weights): it does
    policy = spec_policy(k=4, adaptive=True)
    policy.step_costs = StepCosts(overhead_s=20e-3, token_s=2e-4, key_s=1e-7)
    submit(policy, "a")
    policy.schedule()
    (c,) = policy.schedule().chunks
    assert c.num_draft == 4


# ---------------------------------------------------------------- outputs on and off


def copy_prompts(vocab: int) -> list[list[int]]:
    """Prompts with repeats in them, so prompt lookup finds drafts, and one without."""
    base = [(5 * j + 3) % (vocab - 20) + 10 for j in range(24)]
    return [base + base[:12], base * 2 + base[:5], [(11 * j) % (vocab - 20) + 10 for j in range(40)],
            base[:8] * 4]


def outputs(engine, prompts, params):
    return [c.token_ids for c in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gqa"), "llama_gqa_llama3")


def model_path(name, gqa_model):
    if name == "bundled":
        return bundled_model_path()
    if name == "gqa":
        return gqa_model
    # the default model from the user's cache (the tests' own cache is empty): fetched once if missing
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phaseserve"
    return resolve_model(None, cache=user_cache).path


@pytest.mark.parametrize("name", ["bundled", "gqa", "default"])
def test_greedy_outputs_are_identical_with_speculation_on_and_off(name, gqa_model):
    path = model_path(name, gqa_model)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = Engine(path, dtype="float32")
    prompts = copy_prompts(off.runner.vocab_size)
    reference = outputs(off, prompts, params)
    for spec in (FIXED, NGRAM):
        on = Engine(path, dtype="float32", speculative=spec)
        assert outputs(on, prompts, params) == reference, spec
        assert on.scheduler.stats().counters.num_resyncs == 0  # no planned decode was skipped and recomputed
        if spec is FIXED:
            stats = on.scheduler.stats().spec_decoding
            assert stats.num_accepted_tokens > 0 and on.num_steps < off.num_steps


def test_greedy_outputs_are_identical_under_preemption():
    path = bundled_model_path()
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    off = Engine(path, dtype="float32", num_blocks=14, block_size=16)
    prompts = copy_prompts(off.runner.vocab_size)
    reference = outputs(off, prompts, params)
    on = Engine(path, dtype="float32", num_blocks=14, block_size=16, speculative=FIXED)
    assert outputs(on, prompts, params) == reference
    assert on.scheduler.stats().counters.num_preemptions > 0 and on.scheduler.stats().spec_decoding.num_accepted_tokens > 0
    assert on.scheduler.stats().counters.num_resyncs == 0


def run_of_several(completion) -> tuple[int, int] | None:
    """(offset, length) of the first event that carried 3 or more tokens."""
    ends = completion.offsets[1:] + [len(completion.token_ids)]
    return next(((o, e - o) for o, e in zip(completion.offsets, ends) if e - o >= 3), None)


def test_a_stop_token_or_max_tokens_inside_an_accepted_run_ends_it_there():
    path = bundled_model_path()
    on = Engine(path, dtype="float32", speculative=FIXED)
    off = Engine(path, dtype="float32")
    prompt = copy_prompts(on.runner.vocab_size)[3]
    free = on.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    run = run_of_several(free)
    assert run is not None, "the prompt should give a run of accepted drafts"
    offset, length = run
    middle = offset + 1  # a token inside the run, neither its first nor its last
    stop = free.token_ids[middle]
    first = free.token_ids.index(stop)
    with_stop = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, stop_token_ids=[stop])
    got = on.generate([prompt], with_stop)[0]
    assert got.token_ids == free.token_ids[:first + 1] and got.finish_reason == "stop"
    assert got.token_ids == off.generate([prompt], with_stop)[0].token_ids
    capped = SamplingParams(temperature=0.0, max_tokens=middle + 1, ignore_eos=True)
    got = on.generate([prompt], capped)[0]
    assert got.token_ids == free.token_ids[:middle + 1] and got.finish_reason == "length"


def test_seeded_samples_are_identical_with_speculation_on_and_off():
    path = bundled_model_path()
    on = Engine(path, dtype="float32", speculative=FIXED)
    off = Engine(path, dtype="float32")
    prompts = copy_prompts(on.runner.vocab_size)
    params = [SamplingParams(temperature=t, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True,
                             repetition_penalty=r)
              for t, s, r in [(0.7, 1, 1.0), (1.0, 2, 1.1), (0.3, 3, 1.0), (0.5, 4, 1.0)]]
    # several sequences of one prompt, as n > 1 makes them, each with its own seed
    prompts += [prompts[0]] * 3
    params += [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=40, ignore_eos=True) for i in range(3)]
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert on.scheduler.stats().spec_decoding.num_accepted_tokens > 0


def test_unseeded_samples_come_from_the_models_distribution(tmp_path):
    """A vocabulary of 8: the exact probability of every (t1, t2, t3) from the model's logprobs, against the
    counts of 12,000 speculative draws (t2 and t3 come from a verification whenever t1 has a draft), by a
    chi-square test at p = 0.001."""
    path = make_model(tmp_path, "llama", vocab_size=8)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    probe = Engine(path, dtype="float32")

    def dist(prefixes):
        got = probe.generate([prompt + list(p) for p in prefixes],
                             SamplingParams(temperature=0.0, max_tokens=1, logprobs=8, ignore_eos=True))
        return [{t: math.exp(lp) for t, lp in c.logprobs[0][1]} for c in got]

    (p1,) = dist([()])
    p2 = dict(zip(range(8), dist([(a,) for a in range(8)])))
    pairs = list(itertools.product(range(8), range(8)))
    p3 = dict(zip(pairs, dist(pairs)))
    exact = {(a, b, c): p1[a] * p2[a][b] * p3[(a, b)][c] for a, b, c in itertools.product(range(8), repeat=3)}
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)

    on = Engine(path, dtype="float32", speculative={"method": "ngram", "num_speculative_tokens": 2,
                                                    "adaptive": False}, max_num_seqs=256,
                max_num_batched_tokens=4096)
    n = 12_000
    counts: dict[tuple, int] = {}
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    for _ in range(n // 1000):
        for c in on.generate([prompt] * 1000, params):
            key = tuple(c.token_ids)
            counts[key] = counts.get(key, 0) + 1
    assert on.scheduler.stats().spec_decoding.num_accepted_tokens > 500  # verifications drew many of these tokens
    # cells expected fewer than 5 times are pooled
    chi2, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, p in exact.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + e
        else:
            chi2 += (counts.get(key, 0) - e) ** 2 / e
            dof += 1
    if pooled_exp:
        chi2 += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    import torch
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)).item()  # chi-square sf
    assert p_value > 1e-3, (chi2, dof)


def test_a_plain_decode_behind_drafts_in_flight_carries_their_slack():
    """A decode planned without drafts while an earlier step's drafts are in flight: its start is the highest
    the sequence can have reached, so the worker must be told how far below it may be (it used to skip the
    chunk as one after a lost plan, and the sequence was recomputed)."""
    policy = spec_policy(k=3)
    submit(policy, "a", max_tokens=6)
    policy.schedule()
    (c1,) = policy.schedule().chunks
    assert c1.num_draft == 3
    (c2,) = policy.schedule().chunks  # outputs 0, 1 and three drafts planned: one more may come, no draft
    assert (c2.start_pos, c2.num_draft, c2.slack) == (10, 0, 3)


def test_the_worker_runs_a_plain_decode_behind_rejected_drafts_where_the_sequence_is(tmp_path):
    from phaseserve.workers.runner import ModelRunner
    from phaseserve.wire import SeqStart, StepPlan
    runner = ModelRunner(make_model(tmp_path, "llama"), num_blocks=16, block_size=4, speculative=FIXED)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    table = list(range(8))
    # one output known (a recomputed sequence): prompt lookup proposes 5, 6, 7 after "6 7"
    runner.execute(StepPlan(0, "w", [SeqStart("a", "gw", prompt, params, [7])], [ScheduledChunk("a", 0, 8, table)]))
    r1 = runner.execute(StepPlan(1, "w", [], [ScheduledChunk("a", 8, 1, table, num_draft=3)]))
    kept = len(r1.events[0].token_ids)
    assert r1.drafted == {"a": 3} and 1 <= kept < 4  # the random model rejects a draft
    # planned at the highest start (8 + 4) with the three drafts as slack: it runs where the sequence is
    r2 = runner.execute(StepPlan(2, "w", [], [ScheduledChunk("a", 12, 1, table, slack=3)]))
    assert [e.offset for e in r2.events] == [1 + kept] and len(r2.events[0].token_ids) == 1


def test_a_verifications_extra_cost_is_learned_from_measured_steps():
    from phaseserve.scheduler.draft_rule import PRIOR_VERIFY_UNITS, VerifyCost
    v = VerifyCost()
    assert v.units == PRIOR_VERIFY_UNITS
    for i in range(40):  # the prediction runs 1 ms short on every step; each verification adds 0.5 ms
        v.observe(1e-3, 0, 1e-4)
        v.observe(1e-3 + 3 * 0.5e-3, 3, 1e-4)
    assert v.units == pytest.approx(5.0)  # 0.5 ms at 0.1 ms a token-unit
    for i in range(200):  # verifications got cheaper than predicted: never below nothing
        v.observe(1e-3, 0, 1e-4)
        v.observe(0.0, 2, 1e-4)
    assert v.units == 0.0


def test_the_policy_learns_the_verify_cost_from_results():
    policy = spec_policy(k=2)
    policy.step_costs = StepCosts(overhead_s=5e-3, token_s=1e-4, key_s=1e-8)
    submit(policy, "a", max_tokens=100)
    p = policy.schedule()
    policy.update(StepResult(p.step_id, "local", [TokenEvent("a", 0, [9])], step_time_s=0.01, ran=[6, 21, 1]))
    for i in range(1, 20):
        p = policy.schedule()
        (c,) = p.chunks
        predicted = policy.step_costs.predict(3, 3 * c.start_pos + 6, 0)
        policy.update(StepResult(p.step_id, "local", [TokenEvent("a", len(policy.queues.seqs["a"].output_ids), [9])],
                                 step_time_s=predicted + 2e-4, ran=[3, 3 * c.start_pos + 6, 0], drafted={"a": 2}))
    assert policy.drafts.verify_cost.units == pytest.approx(2.0, rel=0.01)


def test_drafts_take_only_what_prefill_leaves_under_the_itl_target():
    """One stream decoding beside a long prompt, under the ITL target with learned costs that make drafts pay:
    each step's prefill chunk is the one planned without speculation, and the drafts come on top of it from
    what is left of max_num_batched_tokens."""
    from phaseserve.itl_target import ItlTarget
    costs = StepCosts(overhead_s=0.020, token_s=0.0008, key_s=0.0008 / 2000, prefill_chunk_s=0.002)

    def plans(k):
        cfg = SchedulerConfig(num_blocks=512, block_size=16, max_num_batched_tokens=128, max_model_len=4096,
                              attention_horizon=2000, itl_target=ItlTarget(ratio=1.3), speculative_tokens=k)
        policy = WorkerPolicy(cfg)
        policy.step_costs = costs
        policy.add_request(SubmitRequest("s", "gw", list(range(1, 9)), SamplingParams(max_tokens=200)))
        first = policy.schedule()
        policy.update(StepResult(first.step_id, "local", [TokenEvent("s", 0, [5])]))
        policy.add_request(SubmitRequest("long", "gw", list(range(1, 1001)), SamplingParams(max_tokens=2)))
        out = []
        for _ in range(4):
            p = policy.schedule()
            out.append(p)
            outputs = len(policy.queues.seqs["s"].output_ids)
            policy.update(StepResult(p.step_id, "local", [TokenEvent("s", outputs, [5])]))
        return out

    with_spec, without = plans(4), plans(0)
    for a, b in zip(with_spec, without):
        assert [c for c in a.chunks if c.seq_id == "long"] == [c for c in b.chunks if c.seq_id == "long"]
        assert sum(c.num_tokens + c.num_draft for c in a.chunks) <= 128
    assert any(c.num_draft for p in with_spec for c in p.chunks if c.seq_id == "s")


def test_a_bad_speculative_config_flag_is_a_clear_usage_error(capsys):
    from phaseserve import settings
    args = settings.parse("worker", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == SpeculativeConfig("ngram", 4)
    assert settings.parse("worker", []).speculative_config is None
    with pytest.raises(SystemExit):
        settings.parse("worker", ["--speculative-config", '{"method": "draft_model"}'])
    assert 'method "draft_model" needs "model"' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings.parse("worker", ["--speculative-config", '{"method": "eagle"}'])
    assert "speculative method 'eagle' is not one of ngram, draft_model" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bundled", "gqa"])
def test_a_draft_model_keeps_greedy_outputs_identical(name, gqa_model):
    """The model drafting for itself (the simplest pair with one tokenizer): its greedy drafts are the
    target's own tokens, so nearly all are kept, and the output is the one without speculation."""
    path = model_path(name, gqa_model)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = Engine(path, dtype="float32")
    prompts = copy_prompts(off.runner.vocab_size)
    reference = outputs(off, prompts, params)
    on = Engine(path, dtype="float32", speculative={"method": "draft_model", "model": str(path),
                                                    "num_speculative_tokens": 3, "adaptive": False})
    assert outputs(on, prompts, params) == reference
    stats = on.scheduler.stats().spec_decoding
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    assert on.scheduler.stats().counters.num_resyncs == 0
