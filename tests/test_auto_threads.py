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
    # a tiny model: a second thread gains less than the rest of the service costs a step
    assert cpus.choose_threads({1: 2.4e-3, 2: 2.0e-3}, cores=2, service_s=3.4e-3).threads == 1
    # a larger model: the second core pays for the service's share of it
    choice = cpus.choose_threads({1: 20e-3, 2: 11e-3}, cores=2, service_s=3.4e-3)
    assert choice.threads == 2
    assert "1 thread 20.0 ms, 2 threads 11.0 ms" in choice.reason and "3.4 ms" in choice.reason
    # a second thread that gains less than the service costs is not worth it
    assert cpus.choose_threads({1: 20e-3, 2: 18e-3}, cores=2, service_s=3.4e-3).threads == 1
    # a slower machine: the same model, everything slower in proportion, still gains from the second core
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


def test_service_cpu_scales_with_batch_and_with_how_fast_the_machine_runs_python(monkeypatch):
    assert cpus.python_work_s(rounds=1) > 0
    # a machine running Python as fast as the reference one: the reference CPU per token, per decode
    monkeypatch.setattr(cpus, "python_work_s", lambda rounds=5: cpus.PYTHON_WORK_REFERENCE_S)
    assert cpus.service_cpu_per_step(16) == pytest.approx(16 * cpus.SERVICE_CPU_PER_TOKEN_S)
    assert cpus.service_cpu_per_step(32) == pytest.approx(2 * cpus.service_cpu_per_step(16))
    # one running it half as fast spends twice the CPU on the same work
    monkeypatch.setattr(cpus, "python_work_s", lambda rounds=5: 2 * cpus.PYTHON_WORK_REFERENCE_S)
    assert cpus.service_cpu_per_step(16) == pytest.approx(32 * cpus.SERVICE_CPU_PER_TOKEN_S)


def test_threads_are_timed_once_per_model_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpus, "BUSY_MACHINE_CORES", float("inf"))  # whatever else runs: a quiet timing
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
    monkeypatch.setattr(cpus, "probe", lambda *a: pytest.fail("timed again"))
    again = cpus.thread_choice(0, str(model), cores=2)
    assert again.threads == 3 - first.threads and "measured 20" in again.reason
    assert cpus.worker_threads(0, str(model), cores=2) == again.threads  # the launcher's call
    # an entry from a version that let busy answers expire: kept
    entry.update(expires_at=time.time() - 1)
    (tmp_path / "cache" / "threads.json").write_text(json.dumps(cache))
    assert cpus.thread_choice(0, str(model), cores=2).threads == 3 - first.threads


def test_a_timing_on_a_busy_machine_is_redone_on_the_first_quiet_start_only(tmp_path, monkeypatch):
    """Contended threads time slower: an answer timed while other processes were busy must not hold the worker
    on a quiet machine, and a machine still busy must not pay the timing again on every start."""
    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpus, "BUSY_MACHINE_CORES", -1.0)  # as if other processes were busy
    model = make_model(tmp_path, "llama", "bfloat16")
    busy = cpus.thread_choice(0, str(model), cores=2)
    assert busy.threads in (1, 2) and "timed again on the first quiet start" in busy.reason
    (entry,) = json.loads((tmp_path / "cache" / "threads.json").read_text()).values()
    assert entry["busy"] is True and entry["threads"] == busy.threads

    real_probe = cpus.probe
    monkeypatch.setattr(cpus, "probe", lambda *a: pytest.fail("timed again on a machine still busy"))
    still_busy = cpus.thread_choice(0, str(model), cores=2)
    assert still_busy.threads == busy.threads and "still busy" in still_busy.reason

    monkeypatch.setattr(cpus, "probe", real_probe)
    monkeypatch.setattr(cpus, "BUSY_MACHINE_CORES", float("inf"))  # quiet now: timed again, and kept
    quiet = cpus.thread_choice(0, str(model), cores=2)
    assert "other processes" not in quiet.reason and "busy" not in quiet.reason
    (entry,) = json.loads((tmp_path / "cache" / "threads.json").read_text()).values()
    assert entry["threads"] == quiet.threads and entry["busy"] is False


def test_a_model_that_cannot_be_timed_in_time_is_chosen_by_size_once(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_model(tmp_path, "llama", "bfloat16")
    calls = []

    def overrun(model_dir, counts):
        calls.append(counts)
        raise subprocess.TimeoutExpired("thread_probe", cpus.PROBE_TIMEOUT_S)

    monkeypatch.setattr(cpus, "probe", overrun)
    first = cpus.thread_choice(0, str(model), cores=4)
    assert first.threads == 3 and "by size" in first.reason and calls == [[3, 4]]
    assert cpus.thread_choice(0, str(model), cores=4).threads == 3 and len(calls) == 1  # cached, not retried


def test_the_timing_stops_at_its_budget(tmp_path, monkeypatch):
    """At least one round of every thread count, and no further round once the budget is spent."""
    from phaseserve.workers import runner as runner_module
    from phaseserve.workers.thread_probe import measure_step_times

    model = make_model(tmp_path, "llama", "bfloat16")
    steps = []
    execute = runner_module.ModelRunner.execute
    monkeypatch.setattr(runner_module.ModelRunner, "execute", lambda self, plan: steps.append(1) or execute(self, plan))
    before = torch.get_num_threads()
    try:
        times = measure_step_times(str(model), [1, 2], budget_s=0.0, steps=3)
        assert set(times) == {1, 2} and len(steps) == 1 + 2 * (3 + 1)  # the prompts, then one round
        steps.clear()
        measure_step_times(str(model), [1, 2], budget_s=float("inf"), steps=3, max_rounds=2)
        assert len(steps) == 1 + 2 * 2 * (3 + 1)
    finally:
        torch.set_num_threads(before)


def test_the_worker_sets_and_logs_the_choice(tmp_path, monkeypatch):
    from phaseserve.workers.service import set_threads

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


def test_a_cpu_level_cap_has_a_thread_choice_of_its_own(tmp_path, monkeypatch):
    """Capped to a lower level the worker runs other kernels (and float32): the native level's timing is not
    its answer, and the uncapped key stays what it was."""
    model = make_model(tmp_path, "llama", "bfloat16")
    files = cpus.model_files(str(model))
    monkeypatch.delenv("PHASESERVE_CPU_ISA", raising=False)
    native = cpus.cache_key(str(model), files, 2)
    monkeypatch.setenv("PHASESERVE_CPU_ISA", "avx2")
    capped = cpus.cache_key(str(model), files, 2)
    assert capped != native and "level cap avx2" in capped and "level cap" not in native
    monkeypatch.setenv("PHASESERVE_CPU_ISA", "auto")
    assert cpus.cache_key(str(model), files, 2) == native

