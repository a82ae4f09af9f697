"""Prefix caching changes no token: greedy outputs with the cache on equal those with it off (float32), on the
bundled model, a random GQA model and the default model (SmolLM2-135M-Instruct), with a shared system prompt,
a multi-turn chat resending its history, n > 1 (the same prompt several times at once), and under preemption
(a KV cache too small for the batch). The in-process engine: the same policy and runner as the services."""

from __future__ import annotations

import pytest
from model_factory import make_model

from phaseserve.models.model_source import bundled_model_path, resolve_model
from phaseserve.params import SamplingParams
from phaseserve.stack.engine import Engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["bundled", "gqa", "default"])
def model_dir(request, tmp_path_factory):
    if request.param == "bundled":
        return bundled_model_path()
    if request.param == "gqa":
        return make_model(tmp_path_factory.mktemp("gqa"), "llama_gqa_llama3")
    return resolve_model(None).path


def workload(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Wave 1: prompts sharing a 70-token system prompt, one of them 3 times (n = 3). Wave 2 is built from
    wave 1's outputs: each chat's history + answer + a new turn."""
    system = [(11 * j + 5) % (vocab - 10) + 5 for j in range(70)]
    users = [[(13 * i + 7 * j) % (vocab - 10) + 5 for j in range(5 + 9 * i)] for i in range(4)]
    wave1 = [system + u for u in users] + [system + users[1]] * 2
    return wave1, users


def run(model_dir, caching: bool, **settings) -> tuple[list[list[int]], dict]:
    engine = Engine(str(model_dir), dtype="float32", enable_prefix_caching=caching, **settings)
    wave1, users = workload(engine.runner.vocab_size)
    first = [c.token_ids for c in engine.generate(wave1, GREEDY)]
    wave2 = [p + out + u[:6] for p, out, u in zip(wave1, first, reversed(users))]
    second = [c.token_ids for c in engine.generate(wave2, GREEDY)]
    return first + second, engine.scheduler.stats()


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(model_dir, num_blocks):
    settings = dict(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=128)
    off, st_off = run(model_dir, False, **settings)
    on, st_on = run(model_dir, True, **settings)
    assert on == off
    assert st_off.prefix_cache.hits == 0
    # wave 1 shares the system prompt (and n = 3 forks), wave 2 resends whole histories
    assert st_on.prefix_cache.hits >= 4 * 64
    assert st_on.counters.num_prefill_tokens < st_off.counters.num_prefill_tokens
    if num_blocks == 14:
        assert st_on.counters.num_preemptions > 0  # the cache lets more start at once: they preempt


def test_a_worker_reads_a_cached_prefix_only_from_blocks_it_wrote_itself():
    """A scheduler that has not yet seen a worker restart may still name blocks of its previous life: the
    runner computes nothing over blocks this process never wrote (no token: the scheduler recomputes), and
    shares blocks it did write, with the same token as computing them."""
    from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.runner import ModelRunner

    runner = ModelRunner(bundled_model_path(), num_blocks=16, dtype="float32")
    runner.warm_up()  # writes scratch KV into the first blocks: that is no one's prefix either
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [(7 * j) % 500 + 5 for j in range(20)]

    def start(seq_id, num_cached, table, step):
        return runner.execute(StepPlan(step, "w", [SeqStart(seq_id, "gw", prompt, params, [], num_cached,
                                                            cached_tokens=num_cached)],
                                       [ScheduledChunk(seq_id, num_cached, 20 - num_cached, table)]))

    assert start("stale", 16, [0, 1], 1).events == []  # block 0: warm-up scratch, not a prefix
    assert runner.seqs["stale"].finished
    whole = runner.execute(StepPlan(2, "w", [SeqStart("a", "gw", prompt, params)],
                                    [ScheduledChunk("a", 0, 20, [2, 3])]))
    shared = start("b", 16, [2, 4], 3)
    assert [e.token_ids for e in shared.events] == [e.token_ids for e in whole.events]
    assert shared.events[0].cached_tokens == 16 and whole.events[0].cached_tokens == 0
