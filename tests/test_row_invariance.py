"""Every op on a CPU model's path gives a row the same bits at every row count (1 to 300) and on 1 and 2
threads: the quantized and the bf16 linears, the layer ops (norms, SiLU-and-mul, rotary), argmax. A regime
that switches on the number of rows (a prefill kernel beside a decode one) would show here as a row count
whose rows differ from the same rows computed among more. Run through the dispatch point, in each dtype
whose native ops this CPU runs (kernels/cpu_isa.py): what a worker runs."""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import cpu_isa, native
from phaseserve.kernels.dispatch.linears import BF16_GEMM
from phaseserve.kernels.quant import quantize
from native_ops import amx_or_skip, load_or_skip, torch_threads
from phaseserve.workers.linear import Linear

MAX_ROWS = 300
# the ops a worker would choose, not what an earlier test in the process left chosen
pytestmark = pytest.mark.usefixtures("fresh_dispatch")
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in (torch.bfloat16, torch.float32)]


def _level_or_skip(dtype: torch.dtype) -> None:
    level = next(lv for lv, dt in native.LEVEL_DTYPE.items() if dt == dtype)
    if not cpu_isa.supports(level):
        pytest.skip(f"{dtype} runs native ops from {level}; this CPU runs {cpu_isa.level()}: the op never runs here")


def _assert_row_invariant(fn, x: torch.Tensor) -> None:
    """fn(x[:T]) equals the first T rows of fn(x) for every T, on 1 and 2 threads, and the threads agree."""
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            full = fn(x)
            for t in range(1, x.shape[0] + 1):
                got = fn(x[:t])
                assert torch.equal(got, full[:t]), f"{t} rows on {threads} threads differ from the same rows among {x.shape[0]}"
        results.append(full)
    assert torch.equal(results[0], results[1]), "1 and 2 threads differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear(dtype, kind):
    _level_or_skip(dtype)
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(96, 256, generator=g) * 0.05, kind)
    packed = kernels.pack_quantized(qw, dtype)
    x = torch.randn(MAX_ROWS, 256, generator=g).to(dtype)
    _assert_row_invariant(lambda a: kernels.quant_linear(a, packed), x)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_fmas_give_the_dots_bits(kind):
    """quant_gemm.cpp sums k-pairs with vdpbf16ps or, where that is the slower multiply (Intel), with two
    fp32 FMAs in its order: each way row invariant, and where this CPU runs the FMAs, vdpbf16ps's bits."""
    ops = load_or_skip("quant_gemm")
    g = torch.Generator().manual_seed(5)
    packed = kernels.pack_quantized(quantize(torch.randn(96, 256, generator=g) * 0.05, kind), torch.bfloat16)
    x = torch.randn(MAX_ROWS, 256, generator=g).bfloat16()
    by = {dots: (lambda a, dots=dots: ops.quant_linear(a, packed.data, packed.bits, dots)) for dots in (0, 1)}
    for fn in by.values():
        _assert_row_invariant(fn, x)
    if ops.fp32_dots():
        for rows in (1, 2, 7, 48, MAX_ROWS):
            assert torch.equal(by[1](x[:rows]), by[0](x[:rows])), f"{rows} rows: the FMAs differ from vdpbf16ps"


def test_bf16_linear():
    _level_or_skip(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(100, 192, generator=g) * 0.05).bfloat16()
    b = torch.randn(100, generator=g).bfloat16()
    packed = kernels.pack_bf16_linear(w)
    assert packed is not None
    x = torch.randn(MAX_ROWS, 192, generator=g).bfloat16()
    _assert_row_invariant(lambda a: kernels.bf16_linear(a, packed, b), x)


@pytest.mark.parametrize("amx", [pytest.param(0, id="vdpbf16ps"), pytest.param(1, id="amx")])
def test_bf16_linear_each_multiply(amx):
    """bf16_gemm.cpp's two multiplies, each forced through its amx argument: vdpbf16ps (CPUs without AMX)
    and AMX tiles (what a CPU with AMX-BF16 runs at every row count). K odd and not a multiple of 32 (a
    partial k-tile), N not a multiple of 16 (a partial group and an odd group count), enough groups for
    several chunks, which 2 threads split, and K wide enough that the longest calls' activations pass 1 MB
    (AMX's larger chunks from 225 rows on); with a bias."""
    ops = load_or_skip("bf16_gemm")
    if amx:
        amx_or_skip(ops)
    g = torch.Generator().manual_seed(9)
    n, k = 790, 2333
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = kernels.pack_bf16_linear(w)
    x = torch.randn(MAX_ROWS, k, generator=g).bfloat16()
    _assert_row_invariant(lambda a: ops.bf16_linear(a, packed.data, b, n, amx), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_ops(dtype):
    _level_or_skip(dtype)
    g = torch.Generator().manual_seed(5)
    hidden = 576
    w = (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    x = (torch.randn(MAX_ROWS, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(MAX_ROWS, hidden, generator=g).to(dtype)
    _assert_row_invariant(lambda a: kernels.rms_norm(a, w, 1e-5)[0], x)
    _assert_row_invariant(lambda a: torch.cat(kernels.rms_norm(a, w, 1e-5, res[:a.shape[0]].clone()), 1), x)
    _assert_row_invariant(lambda a: kernels.silu_and_mul(a), x)
    _assert_row_invariant(lambda a: kernels.argmax(a), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_kv_write(dtype):
    _level_or_skip(dtype)
    g = torch.Generator().manual_seed(6)
    hq, hkv, d = 9, 3, 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(4096).float()[:, None] * inv[None]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], 1)
    qkv = torch.randn(MAX_ROWS, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (MAX_ROWS,), generator=g)

    def rotate(a: torch.Tensor) -> torch.Tensor:
        t = a.shape[0]
        a = a.clone()
        q, k, v = a.view(t, -1, d).split([hq, hkv, hkv], 1)
        k_cache = torch.zeros(t, 1, hkv, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q, k = kernels.rotary_and_write_kv(positions[:t], q, k, v, cos_sin, k_cache, v_cache, torch.arange(t))
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), k_cache.view(t, -1)], 1)

    _assert_row_invariant(rotate, qkv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_onednn_packed_linear(monkeypatch, dtype):
    """A dense linear where no native GEMM takes it (float32 weights; bf16 without the native op): oneDNN's
    packed matmul, whose one-row kernel (a matrix-vector product) sums in another order than its GEMM."""
    kernels.CHOICES.pin(BF16_GEMM, None, None)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(320, 128, generator=g) * 0.05).to(dtype)
    b = torch.randn(320, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.packed == (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    x = torch.randn(MAX_ROWS, 128, generator=g).to(dtype)
    _assert_row_invariant(lin, x)


def test_sampling():
    """kernels.sample: a row's token whatever the other rows filter (top-k, top-p, min-p or nothing: the
    sort is skipped when no row filters, and top-k/top-p may filter from a prefix of the sorted logits)."""
    g = torch.Generator().manual_seed(8)
    rows, vocab = 120, 1500  # over 1024: the sorted-prefix filter applies
    logits = torch.randn(rows, vocab, generator=g) * 4
    temperature = torch.where(torch.rand(rows, generator=g) < 0.2, 0.0, 0.5 + torch.rand(rows, generator=g))
    top_k = torch.where(torch.rand(rows, generator=g) < 0.7, 0, torch.randint(1, 3000, (rows,), generator=g))
    top_p = torch.where(torch.rand(rows, generator=g) < 0.7, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=g))
    min_p = torch.where(torch.rand(rows, generator=g) < 0.8, 0.0, 0.1 * torch.rand(rows, generator=g))
    top_k[:40], top_p[:40], min_p[:40] = 0, 1.0, 0.0  # the first prefixes filter nothing
    noise = -torch.rand(rows, vocab, generator=g).log()
    x = torch.arange(rows)
    _assert_row_invariant(lambda i: kernels.sample(logits[i], temperature[i], top_k[i], top_p[i], min_p[i], noise[i]), x)
