"""What this CPU computes natively, as one of three levels that the native ops and dtype `auto` go by.

- ``avx512-bf16``: AVX-512 (F, BW, VL, DQ) with BF16 dot products (Zen 4, Sapphire Rapids and later): bf16
  activations run natively, so `auto` serves bf16.
- ``avx2``: AVX2 with FMA (x86-64-v3: most laptops, many cloud instances and older servers): bf16 arithmetic is
  emulated there (torch's bf16 matmul is far slower than fp32), so `auto` serves float32 activations, with the
  weights still kept quantized where a native kernel reads them.
- ``baseline``: anything else (older x86-64, arm64, other systems): torch runs every op.

PHASESERVE_CPU_ISA caps the level (``avx2`` on an AVX-512 machine runs what an AVX2-only machine runs: the tests
and benchmarks of that path use it); it never raises the level above what the CPU reports.
"""

from __future__ import annotations

import functools
import os
import platform

LEVELS = ("baseline", "avx2", "avx512-bf16")  # ascending: a level runs every op of the levels below it
ENV_CAP = "PHASESERVE_CPU_ISA"

_AVX512_BF16_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
_AVX2_FLAGS = {"avx2", "fma"}


def level_of_flags(flags: set[str]) -> str:
    """The level a CPU with these /proc/cpuinfo flags runs."""
    if _AVX512_BF16_FLAGS <= flags:
        return "avx512-bf16"
    if _AVX2_FLAGS <= flags:
        return "avx2"
    return "baseline"


@functools.cache
def flags() -> frozenset[str]:
    """The feature flags this CPU reports in /proc/cpuinfo (Linux on x86-64; none elsewhere)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detected() -> str:
    """The level this CPU reports (Linux on x86-64; ``baseline`` elsewhere)."""
    return level_of_flags(flags())


def cap() -> str | None:
    """The level PHASESERVE_CPU_ISA caps this process to, or None (unset or ``auto``)."""
    value = os.environ.get(ENV_CAP, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV_CAP}={value!r}: expected auto or one of {', '.join(LEVELS)}")
    return value


def level() -> str:
    """The level this process runs at: what the CPU reports, capped by PHASESERVE_CPU_ISA."""
    found, limit = detected(), cap()
    if limit is None:
        return found
    return min(found, limit, key=LEVELS.index)


def supports(required: str) -> bool:
    """True when this process may run code that needs `required` (one of LEVELS)."""
    return LEVELS.index(level()) >= LEVELS.index(required)
