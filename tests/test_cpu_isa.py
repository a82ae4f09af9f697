"""The CPU level the native ops and dtype `auto` go by, and PHASESERVE_CPU_ISA's cap on it."""

import pytest

from phaseserve.kernels import cpu_isa


def test_levels_from_cpuinfo_flags():
    zen4 = {"fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    assert cpu_isa.level_of_flags(zen4) == "avx512-bf16"
    assert cpu_isa.level_of_flags(zen4 - {"avx512_bf16"}) == "avx2"  # Skylake-X: AVX-512 without bf16
    assert cpu_isa.level_of_flags({"sse4_2", "avx", "avx2", "fma"}) == "avx2"
    assert cpu_isa.level_of_flags({"sse4_2", "avx", "avx2"}) == "baseline"  # no FMA
    assert cpu_isa.level_of_flags(set()) == "baseline"


def test_cap_lowers_the_level_and_never_raises_it(monkeypatch):
    monkeypatch.setattr(cpu_isa, "detected", lambda: "avx2")
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512-bf16")
    assert cpu_isa.level() == "avx2"
    monkeypatch.setenv(cpu_isa.ENV_CAP, "baseline")
    assert cpu_isa.level() == "baseline" and not cpu_isa.supports("avx2") and cpu_isa.supports("baseline")
    monkeypatch.setenv(cpu_isa.ENV_CAP, "auto")
    assert cpu_isa.level() == "avx2" and cpu_isa.supports("avx2") and not cpu_isa.supports("avx512-bf16")
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx9000")
    with pytest.raises(ValueError, match="PHASESERVE_CPU_ISA"):
        cpu_isa.level()


def test_a_capped_process_does_not_even_compile_the_ops_above_its_level(monkeypatch):
    from phaseserve.kernels import native

    monkeypatch.setenv(cpu_isa.ENV_CAP, "baseline")
    monkeypatch.setattr(native, "_loaded", {})
    compiled = []
    monkeypatch.setattr(native, "build", lambda module, *a, **k: compiled.append(module))
    assert native.load("decode_attention") is None
    assert compiled == []
