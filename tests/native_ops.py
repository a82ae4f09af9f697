"""Loading a native op in its tests. Where this CPU runs the op's level (kernels/cpu_isa.py) the op must load:
a silent fallback to torch fails the test. Below that level the op's tests are skipped, saying why: the op
never runs there (likewise bf16_gemm's AMX path: amx_or_skip). Also: torch_threads, for the tests that
compare thread counts."""

import contextlib

import pytest
import torch

from phaseserve.kernels import cpu_isa, native


def cpu_has_avx512_bf16() -> bool:
    """True where this process may run the bf16 ops (the CPU has AVX512-BF16 and PHASESERVE_CPU_ISA allows it)."""
    return cpu_isa.supports("avx512-bf16")


def cpu_has_amx_bf16() -> bool:
    """True where the CPU reports AMX tiles with bf16 dot products (/proc/cpuinfo: amx_tile, amx_bf16)."""
    return {"amx_tile", "amx_bf16"} <= cpu_isa.flags()


def amx_or_skip(ops) -> None:
    """Skip, saying why, on a CPU without AMX-BF16 (bf16_gemm's AMX path never runs there); where the CPU has
    it, the op must run it: a silent fallback to vdpbf16ps fails the test."""
    if not cpu_has_amx_bf16():
        pytest.skip("this CPU lacks AMX-BF16 (amx_tile, amx_bf16): bf16_gemm's AMX path never runs here")
    assert ops.amx(), "the CPU has AMX-BF16 but bf16_gemm does not run it (did Linux refuse the tile state?)"


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

