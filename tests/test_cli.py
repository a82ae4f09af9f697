"""The `phaseserve` command itself: every service's --help shows the defaults, and a closed pipe is quiet."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phaseserve.settings import settings_for

ROOT = Path(__file__).resolve().parent.parent


def phaseserve(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("PHASESERVE_") or k == "PHASESERVE_CACHE_DIR"}
    return subprocess.Popen([sys.executable, "-m", "phaseserve.stack.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.parametrize("service", ["up", "gateway", "scheduler", "worker"])
def test_help_shows_every_default(service):
    p = phaseserve(service, "--help")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    # option -> its whole entry, whitespace-normalized (argparse wraps and indents the help)
    lines = {" ".join(block.split()).split()[0]: " ".join(block.split())
             for block in re.split(r"\n  (?=-)", out.decode())[1:]}
    for s in settings_for(service):
        if s.default is None:
            continue
        shown = str(s.default).lower() if isinstance(s.default, bool) else str(s.default)
        assert f"default: {shown}]" in lines[s.flag], lines[s.flag]
    if service == "up":
        assert "default: 600.0" in lines["--startup-timeout"]


def test_a_reader_that_closes_the_pipe_ends_it_quietly():
    """`phaseserve settings | head`: the reader goes away before the table is written; no traceback."""
    p = phaseserve("settings")
    p.stdout.close()  # the reader is gone before a byte is written
    code = p.wait(timeout=60)
    err = p.stderr.read().decode()
    p.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 141  # as a shell shows a process ended by SIGPIPE


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace of its own (unshare) needs root")
def test_a_worker_stopped_in_its_first_seconds_as_pid_1_exits(tmp_path):
    """As a container's first process (PID 1 of its namespace), a signal with no handler is ignored: a worker
    told to stop while it still imports, resolves its model or times its threads must exit all the same."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), PHASESERVE_CACHE_DIR=str(tmp_path))  # no cached thread choice
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                             "phaseserve.stack.cli", "worker", "--model", "bundled", "--redis-url",
                             "redis://127.0.0.1:1/0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")

        def pid_1_inside() -> int | None:
            """unshare's child once it runs as PID 1 of the new namespace (NSpid: <ours> 1)."""
            for pid in children.read_text().split():
                try:
                    nspid = Path(f"/proc/{pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
                except (OSError, IndexError):
                    continue
                if len(nspid) == 2 and nspid[1] == "1":
                    return int(pid)
            return None

        deadline = time.monotonic() + 10
        while (worker := pid_1_inside()) is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        time.sleep(1.0)  # starting: importing, resolving the model, timing its threads
        os.kill(worker, signal.SIGTERM)
        assert proc.wait(timeout=15) == 128 + signal.SIGTERM, proc.stdout.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
