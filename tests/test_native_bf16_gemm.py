"""The native bf16 GEMM (kernels/native/bf16_gemm.cpp) behind workers/linear.py's Linear for bf16 weights:
its results against an fp32 computation, its batch and thread invariance, its packing, its errors, and the
dispatch that chooses it. Its two multiplies (vdpbf16ps; AMX tiles, which a CPU with AMX-BF16 runs) are
each forced through the op's amx argument; the AMX ones skip, saying why, on a CPU without AMX.

Tolerance: the op multiplies bf16 pairs exactly, sums them in one fp32 accumulator in k order (AMX: in its
tdpbf16ps's order within each k-tile of 16 pairs, the k-tiles in order), adds the bias
and rounds once to bf16; the reference sums in fp32 in another order (x.float() @ w.float().T + b) and
rounds once. The two fp32 sums differ by at most K * 2^-24 * sum_k |x_k w_k| (sequential fp32 summation),
and each rounding to bf16 moves a value by at most half a bf16 step (2^-8 relative): asserted as
|native - reference| <= 2^-7 * |reference| + K * 2^-24 * (|x| @ |w|.T).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels.native_bf16 import PackedBf16Weight, pack
from native_ops import amx_or_skip, cpu_has_amx_bf16, load_or_skip
from phaseserve.workers.linear import Linear

# the 200M llama's four linears (qkv, o, gate_up, down), SmolLM2-like widths, and odd ones: N not a multiple
# of 16 or 64, K odd, N under one group
SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (1040, 576), (1000, 1536), (100, 77),
          (8, 30), (72, 1)]
MAX_ROWS = 40



@pytest.fixture(scope="module")
def ops():
    return load_or_skip("bf16_gemm")


@pytest.fixture(params=[pytest.param(0, id="vdpbf16ps"), pytest.param(1, id="amx")])
def multiply(request, ops):
    """The op's amx argument forcing one multiply: 0 vdpbf16ps, 1 AMX tiles (skipped where the CPU lacks AMX)."""
    if request.param:
        amx_or_skip(ops)
    return request.param


def _case(n: int, k: int, rows: int = MAX_ROWS, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + n * 31 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    return x, w, b


def _assert_close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
    bound = 2**-7 * ref.abs() + x.shape[1] * 2**-24 * (x.float().abs() @ w.float().abs().T)
    err = (got.float() - ref.bfloat16().float()).abs()
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert (err <= bound).all(), f"max error {err.max().item()} over bound at {(err - bound).argmax().item()}"


def test_this_machine_never_falls_back_silently(monkeypatch):
    """On a CPU with AVX512-BF16 a bf16 Linear must run the native GEMM: fails if it would take oneDNN."""
    load_or_skip("bf16_gemm")  # skipped, saying why, below the op's CPU level
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    x, w, b = _case(96, 64, rows=5)
    lin = Linear(w, b)
    assert isinstance(lin.native, PackedBf16Weight) and lin.weight is None and not lin.packed

    def onednn(*args, **kwargs):
        raise AssertionError("the oneDNN path ran")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", onednn)
    monkeypatch.setattr(F, "linear", onednn)
    _assert_close_to_fp32(lin(x), x, w, b)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_matches_fp32_for_every_row_count(ops, multiply, n, k, with_bias):
    x, w, b = _case(n, k)
    b = b if with_bias else None
    packed = pack(w)

    def linear(a):
        return ops.bf16_linear(a, packed.data, b, n, multiply)

    full = linear(x)
    _assert_close_to_fp32(full, x, w, b)
    # every tile plan and remainder: vdpbf16ps 1-6 rows one tile, 7+ tiles of up to 12; AMX a block of
    # one A tile up to 16 rows, two to 32, then blocks of 32 and a partial one
    for rows in range(1, MAX_ROWS):
        assert torch.equal(linear(x[:rows]), full[:rows]), rows


def test_dispatch_runs_amx_where_the_cpu_has_it(ops):
    """kernels.bf16_linear runs AMX tiles at every row count on a CPU with AMX-BF16, vdpbf16ps elsewhere: one
    arithmetic per machine (the two round differently in a few outputs)."""
    assert ops.amx() == cpu_has_amx_bf16()
    x, w, b = _case(1040, 576)
    packed = pack(w)
    here = int(ops.amx())
    for rows in (1, 5, 16, 17, 33, MAX_ROWS):
        assert torch.equal(kernels.bf16_linear(x[:rows], packed, b), ops.bf16_linear(x[:rows], packed.data, b, 1040, here))


def test_linear_uses_native_for_bf16_and_keeps_onednn_for_fp32(ops):
    x, w, b = _case(100, 80, rows=7)
    lin = Linear(w, b)
    assert lin.native is not None and lin.nbytes() == w.nbytes + b.nbytes
    _assert_close_to_fp32(lin(x), x, w, b)
    assert lin(x[:0]).shape == (0, 100)
    assert lin(x.T.contiguous().T).equal(lin(x))  # a column-major x (copied to dense rows first)
    fp32 = Linear(w.float(), b.float())
    assert fp32.native is None and fp32.packed
    torch.testing.assert_close(fp32(x.float()), F.linear(x.float(), w.float(), b.float()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(5632, 1024), (1024, 2816), (100, 77)])
def test_native_is_batch_and_thread_invariant(ops, multiply, n, k):
    """A row's result is bit-identical alone, in a batch of 16 or 40 (other tile plans) and with 1 or 2
    threads: each output's sum runs in k order whatever the tiles and threads."""
    x, w, b = _case(n, k)
    packed = pack(w)

    def linear(a):
        return ops.bf16_linear(a, packed.data, b, n, multiply)

    threads = torch.get_num_threads()
    try:
        results = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            results[t] = linear(x)
        torch.set_num_threads(1)
        batch16 = linear(x[:16])
        alone = torch.cat([linear(x[i:i + 1]) for i in range(MAX_ROWS)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[1], results[2])
    assert torch.equal(alone, results[1])
    assert torch.equal(batch16, alone[:16])


def test_rows_with_a_stride_and_views(ops):
    x, w, b = _case(96, 64, rows=12)
    packed = pack(w)
    wide = torch.cat([x, x], dim=1)  # rows of stride 128: the op reads x through its row stride
    assert torch.equal(kernels.bf16_linear(wide[:, :64], packed, b), kernels.bf16_linear(x, packed, b))


@pytest.mark.parametrize("n,k", [(100, 77), (16, 32), (8, 1)])
def test_pack_is_a_pure_reshuffle(n, k):
    _, w, _ = _case(n, k, rows=1)
    p = pack(w)
    assert p.data.shape == (-(-n // 16), -(-k // 2), 32) and p.data.dtype == torch.bfloat16
    assert torch.equal(p.unpack(), w)
    # lane 2i + s of pair j in group g holds output 16g + i at k = 2j + s
    assert p.data[0, 0, 2] == w[1, 0] and (k < 2 or p.data[0, 0, 1] == w[0, 1])


def test_native_rejects_bad_input_with_clear_errors(ops):
    x, w, b = _case(32, 64, rows=3)
    packed = pack(w)
    with pytest.raises(RuntimeError, match="x has 62 features, the weight 64"):
        kernels.bf16_linear(x[:, :62], packed, b)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        kernels.bf16_linear(x.float(), packed, b)
    with pytest.raises(RuntimeError, match="bias must be contiguous bfloat16"):
        kernels.bf16_linear(x, packed, b[:16])
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.bf16_linear(x[0], packed.data, None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.bf16_linear(x, packed.data, None, 48)
    with pytest.raises(RuntimeError, match="amx must be -1"):
        ops.bf16_linear(x, packed.data, None, 32, 2)
    if not ops.amx():
        with pytest.raises(RuntimeError, match="amx=1 on a CPU without AMX-BF16"):
            ops.bf16_linear(x, packed.data, None, 32, 1)


def test_native_off_switch_keeps_onednn(monkeypatch, fresh_dispatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    x, w, b = _case(96, 80, rows=5)
    lin = Linear(w, b)
    # oneDNN's packed weight where it computes bf16 itself (its own check of the CPU), else the plain one
    packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert lin.native is None and lin.packed == packs and (lin.weight.layout == torch._mkldnn) == packs
    assert torch.equal(lin(x), F.linear(x, w, b))
