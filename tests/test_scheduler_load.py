"""bench/scheduler_load.py: its fake worker answers plans as a real worker would, and a short run against a
real scheduler process completes requests with no errors (so the benchmark's figures mean something)."""

from __future__ import annotations

import asyncio

import psutil

from bench.scheduler_load import run_load
from bench.scheduler_load_fakes import FakeWorker, LoadConfig
from phaseserve.params import SamplingParams
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan


def test_fake_worker_samples_at_the_end_of_known_tokens_and_finishes_at_max_tokens():
    w = FakeWorker("w", LoadConfig("redis://unused", "t", 1))
    params = SamplingParams(max_tokens=2, temperature=0.0).validate()
    start = SeqStart("a", "gw", list(range(10)), params, [])
    result, by_gw = w.run(StepPlan(1, "w", [start], [ScheduledChunk("a", 0, 6, [0])], epoch=3))
    assert result.events == [] and by_gw == {}  # mid-prefill: nothing to sample
    result, by_gw = w.run(StepPlan(2, "w", [], [ScheduledChunk("a", 6, 4, [0])], epoch=3))
    assert [(e.offset, e.finish_reason) for e in result.events] == [(0, None)] and result.epoch == 3
    result, by_gw = w.run(StepPlan(3, "w", [], [ScheduledChunk("a", 10, 1, [0])], epoch=3))
    assert [(e.offset, e.finish_reason) for e in by_gw["gw"]] == [(1, "length")]
    result, _ = w.run(StepPlan(4, "w", [], [ScheduledChunk("a", 11, 1, [0])], epoch=3))
    assert result.events == []  # planned a step past its finish: skipped, as a worker does
    stale, _ = w.run(StepPlan(5, "w", [], [], epoch=2))
    assert stale is None  # an older scheduler's plan


def test_short_run_against_a_real_scheduler_completes_requests(tmp_path):
    with EmbeddedRedis() as server:  # its process too: the benchmark measures Redis's CPU
        cfg = LoadConfig(server.url, "loadtest", 2, prompt_tokens=8, output_tokens=4, seqs_per_worker=4)
        r = asyncio.run(run_load(cfg, psutil.Process(server.proc.pid), seconds=1.0, warmup=0.5, num_fleets=1,
                                 log_dir=tmp_path))
    assert r["errors"] == 0
    assert r["requests_per_s"] > 0 and r["steps_per_s"] >= r["requests_per_s"]
    assert r["cores"]["scheduler"] > 0
