"""Poison requests, the workers' half (docs/architecture.md, "Poison requests"): a worker never waits for one
sequence's preparation (its grammar matcher), a preparation past its budget fails that sequence alone, and
a grammar that takes seconds to build, sent beside a live stream, never stalls that stream nor gets a
worker declared lost. (Quarantine, the scheduler's half, is pure: tests/test_scheduler_cluster.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from phaseserve import grammar, settings
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.params import SamplingParams
from phaseserve.wire import ERROR_GRAMMAR, FIELD, GrammarSpec, Keys, SubmitRequest
from runner_driver import run
from service_harness import WorkerProcess, start, stop
from phaseserve.workers.runner import ModelRunner

BUNDLED = settings.bundled_model_path()
# the poison: 60,000 alternatives as one grammar rule, which the engine takes seconds to build (the
# gateway now sends a choice as one terminal, and its budgets refuse such a grammar; it is put on the requests
# stream directly, as a gateway with raised budgets, or an older one, would)
POISON_OPTIONS = 60_000


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(BUNDLED)


class GatedBuilds:
    """Holds every matcher build of `runner` until `release()`: a grammar that takes as long as we say."""

    def __init__(self, runner: ModelRunner):
        self.gate = threading.Event()
        build = runner.grammar.build_matcher

        def gated(spec, output_ids):
            self.gate.wait(60)
            return build(spec, output_ids)
        runner.grammar.build_matcher = gated

    def release(self) -> None:
        self.gate.set()


def timed_steps(runner: ModelRunner) -> list[tuple[float, dict]]:
    """(seconds, deferred) of every step the runner executes from now on."""
    steps: list[tuple[float, dict]] = []
    execute = runner.execute

    def timed(plan):
        t = time.perf_counter()
        result = execute(plan)
        steps.append((time.perf_counter() - t, dict(result.deferred)))
        return result
    runner.execute = timed
    return steps


def test_a_sequence_whose_matcher_is_building_sits_out_and_then_samples_what_it_would_have(tokenizer):
    prompt = tokenizer.encode("Answer yes or no:")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    specs = [grammar.choice(["yes", "no", "maybe"]), None]
    free = run(ModelRunner(BUNDLED, num_blocks=64), [prompt] * 2, params, grammars=specs)

    runner = ModelRunner(BUNDLED, num_blocks=64)
    builds, steps = GatedBuilds(runner), timed_steps(runner)
    threading.Timer(1.5, builds.release).start()
    gated = run(runner, [prompt] * 2, params, grammars=specs)
    assert [s.outputs for s in gated] == [s.outputs for s in free]  # the same tokens, after sitting out
    assert tokenizer.decode(gated[0].outputs) in ("yes", "no", "maybe")
    sat_out = [t for t, deferred in steps if "s0" in deferred]
    assert len(sat_out) >= 3
    # no step waited for the build (held 1.5 s): the free sequence decoded meanwhile
    assert max(t for t, _ in steps) < 1.0, max(t for t, _ in steps)


def test_a_preparation_past_its_budget_fails_that_sequence_alone(tokenizer):
    prompt = tokenizer.encode("Answer yes or no:")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = run(ModelRunner(BUNDLED, num_blocks=64), [prompt], params)[0]

    runner = ModelRunner(BUNDLED, num_blocks=64, grammar_prepare_timeout=0.3)
    builds = GatedBuilds(runner)
    try:
        failed, other = run(runner, [prompt] * 2, params, grammars=[grammar.choice(["yes", "no"]), None])
    finally:
        builds.release()
    assert failed.finish_reason == "error" and failed.outputs == []
    assert other.outputs == alone.outputs and other.finish_reason == "length"


def poison_request(prompt: list[int]) -> SubmitRequest:
    spec = GrammarSpec("lark", "start: " + " | ".join(grammar.lark_string(str(i)) for i in range(POISON_OPTIONS)))
    return SubmitRequest("poison", "gw", prompt, SamplingParams(max_tokens=8, temperature=0.0),
                         arrival_time=time.time(), grammar=spec)


async def test_a_poison_grammar_beside_a_stream_fails_alone_with_no_stall_and_no_worker_lost(
        redis_server, tmp_path, tokenizer):
    """On the code before: the step waited seconds for the poison's matcher, past its deadline, so the worker
    was declared lost and the stream stalled for as long."""
    keys = Keys("poison")
    prompt = tokenizer.encode("Once upon a time")
    # room for a stream that outlasts the poison's build
    worker = WorkerProcess(BUNDLED, redis_server, keys, "w1", tmp_path / "w1.log", "--kv-cache-memory", "16MiB")
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        await gw.wait(lambda: "w1" in sched.workers, 120)
        life = sched.workers["w1"].info.started_at
        await gw.submit("stream", prompt, 2000)
        await gw.wait(lambda: len(gw.tokens.get("stream", ())) >= 20, 60)
        await client.xadd(keys.requests, {FIELD: poison_request(prompt).to_wire()})
        await gw.wait(lambda: "poison" in gw.finish, 120)
        assert "stream" not in gw.finish, "the stream must outlast the poison"
        n = len(gw.tokens["stream"])
        await gw.wait(lambda: len(gw.tokens["stream"]) >= n + 20, 30)  # and go on after it
        await gw.cancel("stream")

        kind, message = gw.errors["poison"]
        assert gw.finish["poison"] == "error" and kind == ERROR_GRAMMAR, (kind, message)
        assert "grammar" in message and "Traceback" not in message
        assert gw.tokens.get("poison", []) == []
        assert gw.longest_stall < 1.0, gw.longest_stall
        assert gw.gaps == gw.conflicts == 0
        # no worker declared lost: the same life throughout, no step given up, nothing quarantined
        assert list(sched.workers) == ["w1"] and sched.workers["w1"].info.started_at == life
        assert sched.num_steps_given_up == 0
        stats = sched.stats()
        assert stats.num_sat_out >= 1 and stats.num_quarantined == 0
        assert "overran" not in (tmp_path / "w1.log").read_text()
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()
