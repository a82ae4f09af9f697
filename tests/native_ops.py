"""Loading a native op in its tests. Where this CPU runs the op's level (kernels/cpu_isa.py) the op must load:
a silent fallback to torch fails the test. Below that level the op's tests are skipped, saying why: the op
never runs there. Also: torch_threads, for the tests that compare thread counts."""

import contextlib

import pytest
import torch

from kernels import cpu_isa, native


def cpu_has_avx512_bf16() -> bool:
    """True where this process may run the bf16 ops (the CPU has AVX512-BF16 and PHASESERVE_CPU_ISA allows it)."""
    return cpu_isa.supports("avx512-bf16")


def load_or_skip(name: str):
    """The loaded ops of kernels/native/<name>.cpp (compiled once per CI run)."""
    loaded = native.load(name)
    required = native.REQUIRES[name]
    if loaded is None and not cpu_isa.supports(required):
        pytest.skip(f"{name} needs {required}; this CPU runs {cpu_isa.level()}: the op never runs here")
    assert loaded is not None, f"the native op {name} failed to load on a CPU that supports it"
    return loaded


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n for the block (the invariance tests compare 1 and N threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

