"""Prefix caching across the four topologies of tests/test_phase_workers.py: real workers, a real Redis, the
scheduler service. Greedy outputs equal the uncached reference (runner_driver: no scheduler, no cache) on the
bundled model and a random GQA model, in two waves: prompts sharing a system prompt (one of them three times
at once), then each chat's history + answer + a new turn. Prefill workers keep what they prefilled cached
(a decode worker's cache serves its own recomputes only: new sequences start on prefill workers)."""

from __future__ import annotations

import pytest

import runner_driver
from model_factory import make_model
from phaseserve.models.model_source import bundled_model_path
from phaseserve.params import SamplingParams
from phaseserve.wire import Keys
from phaseserve.scheduler.service import PolicyLimits
from service_harness import WorkerThread, start, stop
from test_phase_workers import TOPOLOGIES
from phaseserve.workers.runner import ModelRunner

MAX_TOKENS = 6


def first_wave(vocab: int) -> list[list[int]]:
    system = [(11 * j + 5) % (vocab - 10) + 5 for j in range(37)]
    tails = [[(13 * i + 7 * j) % (vocab - 10) + 5 for j in range(4 + 11 * i)] for i in range(3)]
    return [system + t for t in tails] + [system + tails[1]] * 2


def second_wave(first: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    return [p + out + [5 + i, 6 + i, 7] for i, (p, out) in enumerate(zip(first, outputs))]


@pytest.fixture(scope="module", params=["bundled", "gqa"])
def model(request, tmp_path_factory):
    path = bundled_model_path() if request.param == "bundled" else make_model(
        tmp_path_factory.mktemp("gqa"), "llama_gqa_llama3")
    runner = ModelRunner(path, num_blocks=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    wave1 = first_wave(runner.vocab_size)
    out1 = [s.outputs for s in runner_driver.run(runner, wave1, params)]
    runner.reset()
    wave2 = second_wave(wave1, out1)
    out2 = [s.outputs for s in runner_driver.run(runner, wave2, params)]
    return path, wave1, out1, out2


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_cached_prefixes_give_the_reference_tokens_in_every_topology(model, topology, redis_server):
    model_dir, wave1, out1, out2 = model
    roles = TOPOLOGIES[topology]
    keys = Keys("pc")
    workers = [WorkerThread(model_dir, redis_server, keys, f"{role}{i}", num_blocks=96, role=role)
               for i, role in enumerate(roles)]
    limits = PolicyLimits(max_num_batched_tokens=64, long_prefill_threshold=40)
    client, sched, gw, tasks = await start(redis_server, keys, limits=limits)
    try:
        await gw.wait(lambda: len(sched.workers) == len(roles), 10)
        for i, p in enumerate(wave1):
            await gw.submit(f"a{i}", p, max_tokens=MAX_TOKENS)
        await gw.wait(lambda: len(gw.finish) == len(wave1), 60)
        assert [gw.tokens[f"a{i}"] for i in range(len(wave1))] == out1
        for i, p in enumerate(second_wave(wave1, out1)):
            await gw.submit(f"b{i}", p, max_tokens=MAX_TOKENS)
        await gw.wait(lambda: len(gw.finish) == 2 * len(wave1), 60)
        assert [gw.tokens[f"b{i}"] for i in range(len(wave1))] == out2
        await gw.wait(lambda: sched.stats().num_running == 0, 10)
        st = sched.stats()
        # wave 1: the system prompt (2 blocks) for all but the first, the whole shared prompt for the n = 3
        # copies; wave 2: each history's full blocks
        assert st.prefix_cache.hits >= 4 * 32 + sum(len(p) // 16 * 16 for p in wave1) - 5 * 16
        assert gw.conflicts == 0 and gw.duplicates == 0
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_sixteen_multi_turn_sessions_on_two_mixed_workers_stay_with_their_prefix(redis_server):
    """Two mixed workers on the bundled model, 16 sessions of 3 turns at once, each resending its history:
    >= 90% of the later turns run on the worker that ran the turn before (the one holding its history), and
    neither worker runs more than 1.5x the sequences of the other."""
    import asyncio

    model_dir = bundled_model_path()
    keys = Keys("pr")
    workers = [WorkerThread(model_dir, redis_server, keys, f"mixed{i}", num_blocks=256) for i in range(2)]
    client, sched, gw, tasks = await start(redis_server, keys, limits=PolicyLimits(max_num_batched_tokens=256))
    system = [(11 * j + 5) % 500 + 5 for j in range(40)]
    ran_on: dict[tuple[int, int], str] = {}

    async def session(s: int) -> None:
        history = system + [(s * 31 + j) % 500 + 7 for j in range(8)]
        for t in range(3):
            rid = f"s{s}-t{t}"
            await gw.submit(rid, history, max_tokens=4)
            await gw.wait(lambda: rid in gw.finish, 120)
            ran_on[s, t] = gw.finished_by[rid]
            history = history + gw.tokens[rid] + [(s * 17 + t + j) % 500 + 9 for j in range(8)]

    try:
        await gw.wait(lambda: len(sched.workers) == 2, 10)
        await asyncio.gather(*(session(s) for s in range(16)))
        later = [(s, t) for s in range(16) for t in (1, 2)]
        stayed = sum(ran_on[s, t] == ran_on[s, t - 1] for s, t in later)
        assert stayed >= 0.9 * len(later), ran_on
        per_worker = [list(ran_on.values()).count(w) for w in ("mixed0", "mixed1")]
        assert max(per_worker) <= 1.5 * min(per_worker), per_worker
        assert sched.stats().prefix_cache.hits > 0
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()
