"""Process helpers: children that die with their parent (optionally on given CPUs), stopping them, and keeping
a service's start-up heap out of the garbage collector's way."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn: the kernel sends `sig` to this child when its parent dies (Linux), so a
    launcher killed with SIGKILL leaves no orphans. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)


def child_setup(cpus: list[int] | None = None, death_signal: int = signal.SIGTERM):
    """preexec_fn of a service: die with the parent (by `death_signal`: a worker's is SIGINT, which stops it
    at once where SIGTERM would drain it), and run on `cpus` when given."""

    def setup() -> None:
        die_with_parent(death_signal)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return setup


def parse_cpus(text: str | None) -> list[int] | None:
    """"1", "0,2", "2-3" or "3, 2,3" -> sorted CPU ids; None or "" -> None (anywhere).
    Raises ValueError for anything else."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        if not part.strip():
            continue
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"not a list of CPU numbers or ranges: {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"not a list of CPU numbers or ranges: {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return sorted(cpus)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def freeze_startup_heap() -> None:
    """Call once a service has started: every object alive now (modules, the model, the tokenizer, the
    app) lives as long as the process, yet each full collection of the garbage collector walks them all
    again (in a worker a stall of the model mid-run, in a gateway of its event loop). gc.freeze() moves them to a generation no collection visits; objects made later are
    collected as before."""
    gc.collect()
    gc.freeze()
