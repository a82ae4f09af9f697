"""The native LoRA op (kernels/native/lora.cpp, AVX2 + FMA, AVX512 vectors with `wide`) against the torch
reference (kernels/reference.py), a row's bits whatever shares its call (other rows, other adapters, the
thread count), the rows it leaves alone, its errors, and the dispatch that chooses it.

Tolerance: the op and the reference sum the same float32 products in different orders (FMA vector lanes
against torch's matmuls), then round to the output's dtype: float32 outputs agree to float32 rounding of
the products' sum, bf16 outputs to one bf16 step of the result.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import cpu_isa
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.linears import LORA
from native_ops import load_or_skip, torch_threads

# a fused q/k/v-like linear: three modules of different widths, an input not a multiple of the vectors
IN, OUTS = 200, (96, 40, 40)
COLS = [0, *itertools.accumulate(OUTS)]


@pytest.fixture(scope="module")
def op():
    return load_or_skip("lora").lora_add.default


def _adapters(dtype, ranks=(8, 4, 0), seed=0):
    """Per adapter (A [3 r, IN], B [r, out]); r = 0: one that leaves this linear alone."""
    g = torch.Generator().manual_seed(seed)
    a = [(torch.randn(3 * r, IN, generator=g) * 0.2).to(dtype) if r else torch.empty(0, 0, dtype=dtype)
         for r in ranks]
    b = [(torch.randn(r, COLS[-1], generator=g) * 0.2).to(dtype) if r else torch.empty(0, 0, dtype=dtype)
         for r in ranks]
    return a, b


def _inputs(dtype, rows=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=g).to(dtype), torch.randn(rows, COLS[-1], generator=g).to(dtype)


WIDTHS = [False] + ([True] if cpu_isa.supports("avx512-bf16") else [])


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("act,weight", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                        (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_the_op_matches_the_reference_and_leaves_other_rows_alone(op, act, weight, wide):
    x, y = _inputs(act)
    a, b = _adapters(weight)
    rows, ends = torch.tensor([3, 7, 1, 15, 19, 2, 4, 5, 6, 8, 9, 10, 23]), [5, 9, 13]
    got, want = y.clone(), y.clone()
    assert op(got, x, rows, ends, a, b, COLS, wide)
    ref.lora_add(want, x, rows, ends, a, b, COLS)
    touched = rows[:9].tolist()  # the third adapter (r = 0) adds nothing
    others = [i for i in range(y.shape[0]) if i not in touched]
    assert torch.equal(got[others], y[others])
    assert not torch.equal(got[touched], y[touched])
    if act == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 step apart
        step = want.float().abs().clamp_min(1e-3) * 2.0 ** -7
        assert bool(((got.float() - want.float()).abs() <= step).all())


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_what_shares_the_call(op, dtype, wide):
    x, y = _inputs(dtype, rows=600)  # enough rows of work that the call splits them over threads
    a, b = _adapters(dtype, ranks=(16, 4, 0))
    alone = y.clone()
    assert op(alone, x, torch.tensor([0]), [1], a[:1], b[:1], COLS, wide)
    rows = torch.randperm(600, generator=torch.Generator().manual_seed(2))
    rows = torch.cat([torch.tensor([0]), rows[rows != 0]])
    for threads in (1, 2):
        with torch_threads(threads):
            for ends in ([1], [200, 400, 600], [597, 599, 600]):
                got = y.clone()
                k = len(ends)
                assert op(got, x, rows[:ends[-1]], ends, a[:k], b[:k], COLS, wide)
                assert torch.equal(got[0], alone[0]), (threads, ends)


def test_the_op_declines_what_it_does_not_take_and_checks_shapes(op):
    x, y = _inputs(torch.float16)
    a, b = _adapters(torch.float16)
    assert not op(y, x, torch.tensor([0]), [1], a[:1], b[:1], COLS, False)  # float16: the caller runs torch
    x, y = _inputs(torch.float32)
    a, b = _adapters(torch.float32)
    with pytest.raises(RuntimeError, match="outside y"):
        op(y, x, torch.tensor([99]), [1], a[:1], b[:1], COLS, False)
    with pytest.raises(RuntimeError, match=r"\[modules \* r, in\]"):
        op(y, x, torch.tensor([0]), [1], [a[0][:, :10].contiguous()], b[:1], COLS, False)
    with pytest.raises(RuntimeError, match="bound the modules"):
        op(y, x, torch.tensor([0]), [1], a[:1], b[:1], [0, 96, 136], False)


def test_the_dispatch_runs_the_native_op(fresh_dispatch):
    load_or_skip("lora")
    x, y = _inputs(torch.bfloat16)
    a, b = _adapters(torch.bfloat16)
    rows, ends = torch.tensor([1, 2, 3]), [2, 3, 3]
    native_out = kernels.lora_add(y.clone(), x, rows, ends, a, b, COLS)
    assert fresh_dispatch.get(LORA) is not None
    fresh_dispatch.pin(LORA, None, None)  # torch: the reference's tiles
    torch_out = kernels.lora_add(y.clone(), x, rows, ends, a, b, COLS)
    assert torch.equal(torch_out, ref.lora_add(y.clone(), x, rows, ends, a, b, COLS))
    assert not torch.equal(native_out, y)
