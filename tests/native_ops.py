"""Loading a native op in its tests. On a CPU with AVX512-BF16 the op must load: a silent fallback to torch
fails the test. A CPU without it skips the op's tests, since the op never runs there."""

import platform

import pytest

from kernels import native


def cpu_has_avx512_bf16() -> bool:
    if platform.system() != "Linux":
        return False
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)


def load_or_skip(name: str):
    """The loaded ops of kernels/native/<name>.cpp (compiled once per CI run)."""
    loaded = native.load(name)
    if loaded is None and not cpu_has_avx512_bf16():
        pytest.skip("this CPU lacks AVX512-BF16: the native op is never used here")
    assert loaded is not None, f"the native op {name} failed to load on a CPU that supports it"
    return loaded
