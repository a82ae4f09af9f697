"""bench/proc_cpu.py: CPU seconds of a process tree over a measured run, by role, per token and per step."""

import subprocess
import sys
import time

from bench.proc_cpu import CLIENT, ProcessTreeCPU, cpu_seconds, format_cpu, process_tree, role_of, steps_taken
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import FIELD, Keys

BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}: pass\ntime.sleep(30)"


def spawn_tree(busy_s: float) -> subprocess.Popen:
    """A `-m workers.relay`-named parent would need the module: a plain parent with a busy child instead."""
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {BUSY.format(s=busy_s)!r}]); " \
            "import time; time.sleep(30)"
    return subprocess.Popen([sys.executable, "-c", child])


def test_tree_roles_and_cpu_of_a_busy_child():
    root = spawn_tree(0.4)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(root.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = process_tree(root.pid)
        assert tree[0] == root.pid and len(tree) == 2
        child = tree[1]
        assert role_of(child) == "python3" or role_of(child).startswith("python")
        with ProcessTreeCPU(root.pid) as probe:
            time.sleep(0.8)  # the child burns its 0.4 s meanwhile, the parent sleeps
        by = probe.by_role()
        assert 0.25 <= sum(v for k, v in by.items() if k != CLIENT) <= 0.6
        assert by[CLIENT] < 0.2  # this process mostly slept
        report = probe.report(output_tokens=500)
        assert report["steps"] is None and "per_step_ms" not in report  # no Redis in this tree
        assert abs(report["per_1k_tokens_s"]["server"] - 2 * report["by_process_s"]["server"]) < 1e-3
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


def test_steps_are_the_results_streams_entries_added():
    redis = EmbeddedRedis().start()
    try:
        with ProcessTreeCPU(redis.proc.pid) as probe:
            import redis as redis_py

            client = redis_py.Redis.from_url(redis.url)
            for _ in range(7):
                client.xadd(Keys("ps").results, {FIELD: b"x"})
            client.xtrim(Keys("ps").results, maxlen=2)  # trimmed entries still count as steps taken
        assert probe.steps == 7
        assert steps_taken((redis.host, redis.port)) == 7
        report = probe.report(output_tokens=70)
        assert set(report["per_step_ms"]) >= {"redis-server", CLIENT, "server"}
    finally:
        redis.stop()
