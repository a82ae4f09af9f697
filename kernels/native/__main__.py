"""`python -m phaseserve.kernels.native`: compile and load, ahead of use, every native op this machine's CPU runs (none
on arm64, on a CPU below every op's level, or without a compiler), and say which. Never fails for an op
that cannot run here: the worker takes the torch path for it, and compiles at start what a different CPU
runs (the Docker image's build step; kernels/native/__init__.py)."""

from __future__ import annotations

import sys

from phaseserve.kernels import cpu_isa, native


def main() -> int:
    ops = native.runnable()
    loaded = [op for op in ops if native.load(op) is not None]
    print(f"phaseserve.kernels.native: CPU level {cpu_isa.level()}; built {', '.join(loaded) or 'none'}"
          f" of {', '.join(native.names())}")
    return 0 if loaded == ops else 1  # an op this CPU runs that failed to build is a broken build


if __name__ == "__main__":
    sys.exit(main())
