"""The `phaseserve` command itself: every service's --help shows the defaults, and a closed pipe is quiet."""

from __future__ import annotations

import os
import re
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
