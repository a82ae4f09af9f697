"""The learned step-cost model (scheduler/step_cost.py) and the ITL target setting."""

from __future__ import annotations

import argparse
import random

import pytest

from phaseserve import settings
from phaseserve.wire import Keys, ScheduledChunk, WorkerInfo
from phaseserve.scheduler.budget import chunk_cost
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.step_shape import chunk_keys, step_shape
from phaseserve.scheduler.step_cost import ItlTarget, StepCostModel, StepCosts, parse_itl_target

TRUE = StepCosts(overhead_s=0.030, token_s=0.0008, key_s=0.0008 / 1500, prefill_chunk_s=0.004)


def random_step(rng: random.Random) -> tuple[int, int, int]:
    """A step like a serving mix: a batch of decodes at random contexts, sometimes a prefill chunk."""
    chunks = [ScheduledChunk(f"d{i}", rng.randrange(10, 2000), 1, []) for i in range(rng.randrange(1, 33))]
    if rng.random() < 0.4:
        chunks.append(ScheduledChunk("p", rng.randrange(0, 1800), rng.randrange(8, 257), []))
    return step_shape(chunks)


def feed(model: StepCostModel, truth: StepCosts, n: int, rng: random.Random, noise: float = 0.05,
         outliers: float = 0.0) -> None:
    for _ in range(n):
        tokens, keys, prefills = random_step(rng)
        t = truth.predict(tokens, keys, prefills) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:  # another process took the core: 2x-6x slower
            t *= rng.uniform(2, 6)
        model.observe(tokens, keys, t, prefills)


def assert_close(fit: StepCosts, truth: StepCosts, rel: float) -> None:
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=rel)
    assert fit.token_s == pytest.approx(truth.token_s, rel=rel)
    assert fit.key_s == pytest.approx(truth.key_s, rel=rel)
    assert fit.prefill_chunk_s == pytest.approx(truth.prefill_chunk_s, rel=2 * rel)


def test_recovers_known_coefficients_from_noisy_steps_with_outliers():
    model = StepCostModel()
    feed(model, TRUE, 600, random.Random(1), noise=0.05, outliers=0.05)
    assert_close(model.costs, TRUE, rel=0.15)
    assert model.costs.horizon == pytest.approx(1500, rel=0.2)
    # what the policy uses: the predicted time of a decode-only step and of a prefill chunk beside it
    for tokens, keys, p in [(16, 16 * 1000, 0), (16 + 256, 16 * 1000 + chunk_keys(1000, 256), 1)]:
        assert model.costs.predict(tokens, keys, p) == pytest.approx(TRUE.predict(tokens, keys, p), rel=0.05)


def test_outliers_barely_move_the_fit():
    clean, noisy = StepCostModel(), StepCostModel()
    feed(clean, TRUE, 400, random.Random(2), noise=0.02)
    feed(noisy, TRUE, 400, random.Random(2), noise=0.02, outliers=0.1)
    for tokens, keys, p in [(16, 16 * 500, 0), (300, 16 * 500 + chunk_keys(500, 284), 1)]:
        assert noisy.costs.predict(tokens, keys, p) == pytest.approx(clean.costs.predict(tokens, keys, p), rel=0.1)
    # measured / predicted, by kind of step (the service logs them)
    assert clean.decode_ratio == pytest.approx(1, abs=0.03) and clean.prefill_ratio == pytest.approx(1, abs=0.03)


def test_adapts_when_the_machine_slows_down():
    model = StepCostModel()
    rng = random.Random(3)
    feed(model, TRUE, 500, rng)
    slow = StepCosts(TRUE.overhead_s * 2, TRUE.token_s * 3, TRUE.key_s * 3, TRUE.prefill_chunk_s * 2)  # e.g. another job on the cores
    feed(model, slow, 1500, rng)
    assert_close(model.costs, slow, rel=0.2)


def test_prior_until_min_samples_and_bad_samples_ignored():
    model = StepCostModel(min_samples=16, warmup=3)
    assert model.costs is None
    rng = random.Random(4)
    for _ in range(3):  # the worker's first steps (lazy initialisation) are not learned from
        model.observe(16, 16 * 100, 10.0)
    feed(model, TRUE, 15, rng)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(10, 100, bad)
    model.observe(0, 0, 0.01)  # a plan of releases only
    assert model.costs is None and model.num_samples == 15
    feed(model, TRUE, 1, rng)
    assert model.costs is not None
    assert min(model.costs.overhead_s, model.costs.token_s, model.costs.key_s) >= 0
    assert model.costs.predict(16, 16 * 100) < 0.2, "the 10 s warm-up steps were not fitted"


def test_constant_batch_predicts_its_own_steps_and_stays_nonnegative():
    """Pure decode at one batch cannot tell the fixed cost from the per-token one: the prior settles the
    split, the prediction for those steps is still right, and nothing goes negative."""
    model = StepCostModel()
    rng = random.Random(5)
    for _ in range(300):
        keys = 16 * rng.randrange(100, 400)
        model.observe(16, keys, TRUE.predict(16, keys) * (1 + rng.gauss(0, 0.02)))
    c = model.costs
    assert min(c.overhead_s, c.token_s, c.key_s, c.prefill_chunk_s) >= 0
    assert c.predict(16, 16 * 250) == pytest.approx(TRUE.predict(16, 16 * 250), rel=0.05)


def test_features_match_the_policy_units():
    """A chunk's chunk_cost in units of token_s with K = token_s / key_s is its predicted time."""
    chunks = [ScheduledChunk("a", 700, 1, []), ScheduledChunk("b", 40, 300, [])]
    tokens, keys, n = step_shape(chunks)
    assert (tokens, keys, n) == (301, 701 + sum(range(41, 341)), 1)
    units = sum(chunk_cost(c.start_pos, c.num_tokens, TRUE.horizon) for c in chunks)
    units += TRUE.prefill_chunk_units  # the one prefill chunk
    assert units * TRUE.token_s == pytest.approx(TRUE.predict(tokens, keys, n) - TRUE.overhead_s)


def test_a_verification_counts_its_tokens_and_keys_but_is_not_a_prefill_chunk():
    """One rule for the scheduler's planned steps and a speculating worker's steps as run (StepResult.ran):
    a decode grown by 3 drafts attends like a 4-token chunk, and stays out of the prefill chunks' count."""
    chunks = [ScheduledChunk("v", 100, 4, []), ScheduledChunk("p", 0, 50, []), ScheduledChunk("d", 9, 1, [])]
    assert step_shape(chunks, {"v": [1, 2, 3]}) == (55, chunk_keys(100, 4) + chunk_keys(0, 50) + 10, 1)
    assert step_shape(chunks) == (55, chunk_keys(100, 4) + chunk_keys(0, 50) + 10, 2)
    assert chunk_keys(100, 4) == 101 + 102 + 103 + 104


def test_itl_target_parsing():
    assert parse_itl_target("1.5x") == ItlTarget(ratio=1.5)
    assert parse_itl_target(" 80ms ") == ItlTarget(ms=80.0)
    assert parse_itl_target("2X") == ItlTarget(ratio=2.0)
    assert parse_itl_target("off").is_off
    assert str(parse_itl_target("1.25x")) == "1.25x" and str(parse_itl_target("80ms")) == "80ms"
    for bad in ("1x", "0.5x", "0ms", "fast", "80", "-3ms", ""):
        with pytest.raises(ValueError, match="ITL target"):
            parse_itl_target(bad)


def test_itl_target_setting_default_and_clear_error(capsys):
    args = settings.parse("scheduler", [])
    assert args.itl_target == ItlTarget(ratio=1.3)
    assert settings.parse("up", ["--itl-target", "60ms"]).itl_target == ItlTarget(ms=60.0)
    err = scheduler_usage_error(capsys, "--itl-target", "soon")
    assert "expected a ratio like 1.5x" in err and "Traceback" not in err


def scheduler_usage_error(capsys, *argv: str) -> str:
    """What `phaseserve scheduler` prints on stderr for a command line it refuses."""
    parser = argparse.ArgumentParser(prog="phaseserve scheduler")
    settings.add_arguments(parser, "scheduler")
    with pytest.raises(SystemExit):
        parser.parse_args(list(argv))
    return capsys.readouterr().err


@pytest.mark.parametrize("name, default", [("itl_patience", 15.0), ("tenant_wait", 0.1)])
def test_a_seconds_setting_reaches_the_policy_and_rejects_a_negative(capsys, name, default):
    flag = "--" + name.replace("_", "-")
    assert getattr(settings.parse("scheduler", []), name) == default
    args = settings.parse("up", [flag, "4.5"])
    cluster = Cluster(Keys("t"), PolicyLimits(**{name + "_s": getattr(args, name)}))
    slot = cluster.add_worker(WorkerInfo("w0", "mixed", "m", 64, 16, 2048), epoch=1)
    assert getattr(slot.policy.config, name + "_s") == 4.5
    err = scheduler_usage_error(capsys, flag, "-1")
    assert "must be >= 0" in err and "Traceback" not in err


def test_an_implausible_fit_is_not_believed():
    """All time on the keys (no fixed cost, free tokens) would make every token cost thousands of units:
    the model keeps its last plausible fit, and the policy does not take such costs."""
    assert not StepCosts(0.0, 0.0, 6e-4).is_plausible
    assert not StepCosts(0.01, 1e-4, 1e-4 / 4).is_plausible  # attention = linears at 4 keys
    assert StepCosts(0.01, 1e-4, 0.0).is_plausible and TRUE.is_plausible
    model = StepCostModel(min_samples=16, warmup=0)
    feed(model, TRUE, 64, random.Random(6))
    good = model.costs
    # steps whose time grows only with the keys (a decode-only stretch at one batch on a busy machine)
    for i in range(64):
        model.observe(8, 8 * (100 + i), 6e-4 * 8 * (100 + i))
    assert model.costs is not None and model.costs.is_plausible
    assert model.costs.token_s > 0 and model.costs.overhead_s > 0
    assert good.is_plausible


def test_a_fit_that_stays_implausible_is_retried_at_the_cadence_not_on_every_step():
    """Decode-only steps at one batch all look alike, so their fit stays implausible; refitting on each of
    them put the numpy solves on every result's path (the scheduler's CPU a step rose by half)."""
    model = StepCostModel(refit_every=32, min_samples=48, warmup=0)
    fits = []
    implausible = StepCosts(0.0, 0.0, 6e-4)  # all on the keys: what such steps can give
    model.fit = lambda: fits.append(model.num_samples) or implausible
    for _ in range(400):
        model.observe(8, 800, 0.016)
    assert model.costs is None
    assert fits[0] == 48 and len(fits) < 400 // 4, fits
