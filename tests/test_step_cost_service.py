"""The scheduler service learns each worker's step costs from its results (real worker, real Redis)."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory import make_model
from phaseserve.wire import Keys
from phaseserve.scheduler.step_cost import ItlTarget
from service_harness import WorkerThread, start, stats, stop

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "llama")


async def test_the_service_learns_step_costs_from_measured_steps(model_dir, redis_server):
    keys = Keys("sc1")
    client, sched, gw, tasks = await start(redis_server, keys)
    sched.limits.itl_target = ItlTarget(ratio=1.3)  # before the worker joins: its policy gets it
    worker = WorkerThread(model_dir, redis_server, keys, "w1")
    try:
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, max_tokens=80)
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS))
        slot = sched.workers["w1"]
        assert slot.policy.config.itl_target == ItlTarget(ratio=1.3)
        model = slot.step_costs
        # every answered plan's features are dropped; the last plans' results may land after the finishes
        await gw.wait(lambda: not slot.plan_features, 5)
        assert model.num_samples >= 80 - 8  # one per step that ran tokens (80 decodes), but the warm-up
        fit = model.fit()
        assert min(fit.overhead_s, fit.token_s, fit.key_s, fit.prefill_chunk_s) >= 0
        # the policy plans with the model's costs: None while no plausible fit (this tiny model's steps
        # cost the same whatever their tokens, so its fit has free tokens and there is nothing to bound)
        assert slot.policy.step_costs is model.costs
        assert model.costs is not None or not fit.is_plausible
        # the decode-only steps the worker measured (one token a chunk) are predicted within 2x (the median)
        n = min(model.num_samples, model.window)
        x, y = model._x[:n], model._y[:n]
        decode = x[:, 3] == 0
        predicted = np.array([fit.predict(t, k, 0) for t, k in x[decode, 1:3]])
        assert 0.5 < float(np.median(y[decode] / predicted)) < 2, (fit, np.median(y[decode]))
        assert 0.25 < model.decode_ratio < 4
        # the decode-only steps are fitted apart too (the ITL target's baseline), and only they
        decode_model = slot.decode_step_costs
        m = min(decode_model.num_samples, decode_model.window)
        assert decode_model.num_samples >= int(decode.sum()) - 8 and not decode_model._x[:m, 3].any()
        assert slot.policy.decode_step_costs is decode_model.costs
        s = await stats(client, keys)
        assert s["num_steps_held_by_itl_target"] >= 0
    finally:
        await stop(client, sched, gw, tasks)
        worker.stop()
