"""The live view's data without a browser: the scheduler's StackView (scheduler/cluster_view.py) as a worker's steps
run, its writing only while a gateway wants it (scheduler/stats_publishing.py), the gateway's frame of it
(gateway/live_view.py) and the last minute's percentiles read from histogram buckets (gateway/latency_window.py)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from phaseserve.gateway.latency_window import Cumulative, LatencyWindow, bucket_counts, quantile
from phaseserve.gateway.live_view import OTHERS, as_seen_by, frame
from phaseserve.params import SamplingParams
from phaseserve.redis_client import connect_async
from phaseserve.stack_view import StackView, StepSample, TenantShare, WaitingSequence, WorkerView
from phaseserve.wire import Keys, StepPlan, StepResult, SubmitRequest, TokenEvent, WorkerInfo
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.scheduler.service import SchedulerService

KEYS = Keys("t")
BUDGET = 16


def req(rid: str, prompt_len: int, max_tokens: int = 64, arrival: float = 0.0, **tenant) -> SubmitRequest:
    return SubmitRequest(rid, "gw", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0),
                         arrival_time=arrival, **tenant)


class FakeWorker:
    """Answers plans as a worker would: one token for every chunk that reaches its sequence's end."""

    def __init__(self, cluster: Cluster, wid: str):
        self.cluster, self.wid, self.known, self.outputs, self.now = cluster, wid, {}, {}, 0.0

    def step(self, step_s: float = 0.01) -> StepPlan:
        [(_, plan)] = self.cluster.plan_steps(self.now, 1, 1, lambda plan, expected: 30.0, 1.0)
        for s in plan.starts:
            self.known[s.seq_id] = len(s.prompt_ids) + len(s.output_ids)
            self.outputs[s.seq_id] = len(s.output_ids)
        events = []
        for c in plan.chunks:
            if c.start_pos + c.num_tokens >= self.known[c.seq_id]:
                events.append(TokenEvent(c.seq_id, self.outputs[c.seq_id], [7]))
                self.outputs[c.seq_id] += 1
                self.known[c.seq_id] += 1
        self.now += step_s
        self.cluster.apply_result(StepResult(plan.step_id, self.wid, events, step_time_s=step_s, epoch=1), 1,
                                  self.now)
        return plan


def test_the_view_shows_a_long_prompts_chunks_beside_the_decodes_and_who_waits():
    c = Cluster(KEYS, PolicyLimits(max_num_seqs=8, max_num_batched_tokens=BUDGET, long_prefill_threshold=8))
    c.add_worker(WorkerInfo("a", "mixed", "m", 256, 16, 2048, 1, 1.0, host="h", threads=3), epoch=1)
    worker = FakeWorker(c, "a")
    c.admit(req("short", 4, arrival=100.0))
    worker.step()  # nobody watches: the step is not sampled
    assert not c.workers["a"].recent_steps and not c.workers["a"].plan_samples
    c.watched = True
    worker.step()
    worker.step()  # "short" decodes now
    c.admit(req("long", 200, max_tokens=2, arrival=101.0))
    worker.step(step_s=0.02)
    view = c.view(taken_at=105.0, now=worker.now + 0.5)
    [w] = view.workers
    assert (w.worker_id, w.role, w.host, w.threads) == ("a", "mixed", "h", 3)
    assert (w.num_running, w.num_waiting) == (2, 0)
    last = w.steps[-1]
    assert last.decode_tokens == 1 and 0 < last.prefill_tokens <= BUDGET - 1 and last.prefill_chunks == 1
    assert last.step_s == 0.02 and len(w.steps) == 3 and w.last_step_age_s == pytest.approx(0.5)
    assert [(s.decode_tokens, s.prefill_tokens) for s in w.steps[:2]] == [(1, 0), (1, 0)]  # "short" decodes alone
    assert w.kv_blocks_used > 0 and w.kv_blocks_used + w.kv_blocks_free == w.kv_blocks_total == 256
    assert view.num_waiting == 1
    [waiting] = view.waiting
    assert (waiting.request_id, waiting.worker_id, waiting.arrival_time, waiting.prompt_tokens) == \
        ("long", "a", 101.0, 200)
    assert waiting.prefilled_tokens == last.prefill_tokens
    assert view.max_num_batched_tokens == BUDGET and view.itl_target == "off" and view.tenants == []
    assert StackView.from_wire(view.to_wire()) == view
    # the worker dies: its sequences are parked, waiting for a worker, and it is gone from the view
    c.retire_worker("a", "heartbeat expired")
    view = c.view(taken_at=106.0, now=worker.now + 1)
    assert view.workers == [] and [(s.request_id, s.worker_id) for s in view.waiting] == [("short", ""), ("long", "")]


def test_tenants_show_with_their_weight_and_each_tenant_sees_only_its_own_requests():
    c = Cluster(KEYS, PolicyLimits(max_num_seqs=8, max_num_batched_tokens=BUDGET))
    c.add_worker(WorkerInfo("a", "mixed", "m", 256, 16, 2048, 1, 1.0), epoch=1)
    c.watched = True
    worker = FakeWorker(c, "a")
    c.admit(req("a1", 4, tenant="acme", tenant_weight=2.0))
    worker.step()  # a1 runs
    for i, tenant in enumerate(("acme", "beta", "gamma")):
        c.admit(req(f"w{i}", 300, arrival=10.0 + i, tenant=tenant))
    view = c.view(taken_at=20.0, now=worker.now)
    assert view.tenants == [TenantShare("acme", 2.0, 1, 1), TenantShare("beta", 1.0, 0, 1),
                            TenantShare("gamma", 1.0, 0, 1)]
    assert [(w.request_id, w.tenant) for w in view.waiting] == [("w0", "acme"), ("w1", "beta"), ("w2", "gamma")]
    full = frame(view, [WorkerInfo("a", "mixed", "m", 256, 16, 2048)], {}, now=21.0)
    seen = as_seen_by(full, "beta")
    assert [(w["request_id"], w["tenant"], w["waiting_s"]) for w in seen["waiting"]] == \
        [("", OTHERS, 11.0), ("w1", "beta", 10.0), ("", OTHERS, 9.0)]
    assert seen["tenants"] == [{"tenant": "beta", "weight": 1.0, "num_running": 0, "num_waiting": 1},
                               {"tenant": OTHERS, "weight": 3.0, "num_running": 1, "num_waiting": 2}]
    assert as_seen_by(full, "") is full  # the operator's keys see everything
    assert full["waiting"][0]["request_id"] == "w0"  # and the shared frame was not changed


async def test_the_scheduler_writes_its_view_only_while_a_gateway_wants_it(redis_server):
    client = connect_async(redis_server)
    try:
        service = SchedulerService(client, KEYS, PolicyLimits(max_num_seqs=8, max_num_batched_tokens=BUDGET))
        await service.refresh_workers(time.monotonic())
        pipe = client.pipeline(transaction=False)
        assert service.maybe_write_view(pipe, time.monotonic()) is None and not pipe.command_stack
        await client.set(KEYS.stack_view_wanted(), b"1", px=3000)
        await service.refresh_workers(time.monotonic())
        assert service.cluster.watched  # and steps are sampled for it
        assert service.maybe_write_view(pipe, now := time.monotonic()) == 2.0  # idle: the slower rate
        assert service.maybe_write_view(pipe, now + 0.1) == pytest.approx(1.9)  # not due: nothing more queued
        await pipe.execute()
        view = StackView.from_wire(await client.get(KEYS.stack_view()))
        assert view.workers == [] and 0 < await client.pttl(KEYS.stack_view()) <= 5000
    finally:
        await client.aclose()


def test_the_frame_leaves_out_a_worker_whose_heartbeat_is_gone_and_times_the_waiting():
    steps = [StepSample(2, 14, 1, 0.012, 0.01, 0.013)]
    view = StackView(100.0, "80ms", 16, [WorkerView("alive", "prefill", steps=steps), WorkerView("dead", "mixed")],
                     1, [WaitingSequence("r1", "alive", 97.5, 300, 42)])
    workers = [WorkerInfo("alive", "prefill", "m", 8, 16, 512, threads=2), WorkerInfo("new", "decode", "m", 8, 16, 512)]
    out = frame(view, workers, {"tokens_per_s": 1.0}, now=100.25)
    assert [(w["worker_id"], w["adopted"]) for w in out["workers"]] == [("alive", True), ("new", False)]
    assert out["workers"][0]["steps"] == [{"decode_tokens": 2, "prefill_tokens": 14, "prefill_chunks": 1,
                                           "step_ms": 12.0, "predicted_ms": 10.0, "target_ms": 13.0}]
    assert out["workers"][0]["threads"] == 2
    assert out["waiting"] == [{"request_id": "r1", "worker_id": "alive", "waiting_s": 2.75, "prompt_tokens": 300,
                               "prefilled_tokens": 42, "tenant": ""}]
    assert out["view_age_s"] == 0.25 and "tenants" not in out
    assert frame(None, workers, {}, now=1.0)["view"] is False  # no view yet: the heartbeats alone


def test_percentiles_of_the_last_minute_come_from_the_bucket_differences():
    registry = CollectorRegistry()
    ttft = Histogram("ttft", "", buckets=(0.1, 0.2, 0.4), registry=registry)
    itl = Histogram("itl", "", buckets=(0.01, 0.02), registry=registry)
    for v in (0.15,) * 10:
        ttft.observe(v)  # before the window: not counted
    window = LatencyWindow(bucket_counts(ttft)[0], bucket_counts(itl)[0], window_s=60.0)
    window.add(Cumulative(0.0, bucket_counts(ttft)[1], bucket_counts(itl)[1], 100.0))
    for v in (0.05,) * 98 + (0.3, 0.3):
        ttft.observe(v)
    for v in (0.015,) * 10:
        itl.observe(v)
    window.add(Cumulative(10.0, bucket_counts(ttft)[1], bucket_counts(itl)[1], 600.0))
    s = window.summary()
    assert s["requests"] == 100 and s["tokens_per_s"] == 50.0 and s["window_s"] == 10.0
    assert s["ttft_p50_s"] == pytest.approx(0.05 * 50 / 49, rel=1e-6)  # interpolated inside (0, 0.1]
    assert 0.2 < s["ttft_p99_s"] <= 0.4
    assert s["itl_p50_s"] == pytest.approx(0.015)
    # a minute on, the old samples leave the window: only what came since counts
    window.add(Cumulative(75.0, bucket_counts(ttft)[1], bucket_counts(itl)[1], 600.0))
    assert window.summary()["requests"] == 0 and window.summary()["ttft_p50_s"] is None
    assert quantile((1.0, float("inf")), (0.0, 3.0), 0.5) == 1.0  # past the last bound: the last bound
