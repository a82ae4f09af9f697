"""The worker's automatic thread count (phaseserve/cpus.py): the rule over measured step times, the
measurement itself on a real model (timed in a child process, cached per model and machine), and the
worker applying and logging it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from structlog.testing import capture_logs

from model_factory import make_model
from phaseserve import cpus


def test_every_core_only_when_its_step_beats_one_fewer_plus_the_service():
    # bundled model here: 2.4 ms on 1 thread, 2.0 on 2; the rest of the service ~3.4 ms a step
    assert cpus.choose_threads({1: 2.4e-3, 2: 2.0e-3}, cores=2, service_s=3.4e-3).threads == 1
    # SmolLM2-135M here: 20 ms on 1 thread, 11 on 2 -- the second core pays for the service's share of it
    choice = cpus.choose_threads({1: 20e-3, 2: 11e-3}, cores=2, service_s=3.4e-3)
    assert choice.threads == 2
    assert "1 thread 20.0 ms, 2 threads 11.0 ms" in choice.reason and "3.4 ms" in choice.reason
    # a second thread that gains less than the service costs is not worth it
    assert cpus.choose_threads({1: 20e-3, 2: 18e-3}, cores=2, service_s=3.4e-3).threads == 1
    # a slow machine: the same model, everything 3x slower, still gains from the second core
    assert cpus.choose_threads({1: 60e-3, 2: 33e-3}, cores=2, service_s=10e-3).threads == 2
    # four cores: three threads and a core for the service, unless the fourth pays for it
    assert cpus.choose_threads({3: 10e-3, 4: 9e-3}, cores=4, service_s=3e-3).threads == 3
    assert cpus.choose_threads({3: 40e-3, 4: 30e-3}, cores=4, service_s=3e-3).threads == 4


def test_setting_one_core_and_an_unloadable_folder_need_no_timing(tmp_path):
    assert cpus.thread_choice(3, str(tmp_path), cores=2).threads == 3  # --num-threads wins
    assert cpus.thread_choice(0, str(tmp_path), cores=1).threads == 1
    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)
    choice = cpus.thread_choice(0, str(tmp_path), cores=4)  # nothing to load: the size rule
    assert choice.threads == 3 and "by size" in choice.reason


def test_service_cpu_scales_with_how_fast_the_machine_runs_python():
    s = cpus.service_cpu_per_step(16)
    # this machine (shared, so within a wide band) is the reference: ~3.4 ms a step at 16 decodes
    assert 1e-3 < s < 20e-3
    assert cpus.service_cpu_per_step(32) == pytest.approx(2 * s, rel=0.5)


def test_threads_are_timed_once_per_model_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpus, "BUSY_MACHINE_CORES", float("inf"))  # a shared test machine: cache regardless
    model = make_model(tmp_path, "llama", "bfloat16")
    step_s, others = cpus.probe(str(model), [1, 2])
    assert set(step_s) == {1, 2} and all(0 < t < 5 for t in step_s.values()) and others >= 0

    first = cpus.thread_choice(0, str(model), cores=2)
    assert first.threads in (1, 2) and "decode step at batch 16" in first.reason
    cache = json.loads((tmp_path / "cache" / "threads.json").read_text())
    (entry,) = cache.values()
    assert entry["threads"] == first.threads
    # the launcher and then its worker ask: the second answer is read, not timed again
    entry["threads"] = 3 - first.threads
    (tmp_path / "cache" / "threads.json").write_text(json.dumps(cache))
    again = cpus.thread_choice(0, str(model), cores=2)
    assert again.threads == 3 - first.threads and "measured 20" in again.reason
    assert cpus.worker_threads(0, str(model), cores=2) == again.threads  # the launcher's call
    # an answer timed while other processes were busy is kept only for a while: past it, timed again
    entry.update(threads=99, expires_at=time.time() - 1)
    (tmp_path / "cache" / "threads.json").write_text(json.dumps(cache))
    assert cpus.thread_choice(0, str(model), cores=2).threads in (1, 2)


def test_the_worker_sets_and_logs_the_choice(tmp_path, monkeypatch):
    from workers.service import set_threads

    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_model(tmp_path, "llama", "bfloat16")
    before = torch.get_num_threads()
    try:
        with capture_logs() as logs:
            n = set_threads(0, str(model))
        assert torch.get_num_threads() == n >= 1
        (line,) = [e for e in logs if e["event"] == "worker threads"]
        assert line["threads"] == n and line["reason"]
        with capture_logs() as logs:
            assert set_threads(1, str(model)) == 1 == torch.get_num_threads()
        assert "set" in next(e for e in logs if e["event"] == "worker threads")["reason"]
    finally:
        torch.set_num_threads(before)
