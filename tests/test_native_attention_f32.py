"""The native float32 attention (kernels/native/attention_f32.cpp: decode and extend over the paged fp32 KV
cache, for AVX2 + FMA) against the torch reference, its one numerics (a query row gets the same bits from
either op, in any chunk, alone or batched, on any thread count), its errors, and the dispatch that chooses it.

Tolerance against the reference: both are fp32 and differ only in the order of their sums (scores over the
head dim, softmax sums and p.V over up to 1500 keys, partitions of 512 keys folded) and in exp (a degree-6
polynomial, relative error < 2e-7, against torch's): for outputs of magnitude ~1 that is a few ulps times
the square root of the terms, asserted as atol 2e-5, rtol 1e-5. Between the native paths: none (torch.equal).
"""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels import cpu_isa
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.attention import native_decode
from phaseserve.kernels.dispatch.choices import implementation
from native_ops import load_or_skip, torch_threads

# query heads, KV heads, head_dim (groups 3, 1, 4, 16, 2)
SHAPES = [(9, 3, 64), (8, 8, 32), (4, 1, 128), (32, 2, 128), (4, 2, 16)]
LENGTHS = [1, 15, 16, 17, 511, 512, 513, 1500]


@pytest.fixture(scope="module")
def ops():
    return load_or_skip("attention_f32")


def _cache(g, lens, hkv, d, bs, pad_blocks=0):
    """Random fp32 caches holding each sequence's blocks scattered; tables padded with ids far out of range
    (never read)."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    k = torch.randn(nb, bs, hkv, d, generator=g)
    v = torch.randn(nb, bs, hkv, d, generator=g)
    ids = torch.randperm(nb, generator=g)
    tables = torch.full((len(lens), max(need) + pad_blocks), 1 << 30, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    return k, v, tables


def _qsl(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("bs", [16, 5])
def test_decode_matches_the_reference(ops, hq, hkv, d, bs):
    g = torch.Generator().manual_seed(hq * d + bs)
    k, v, tables = _cache(g, LENGTHS, hkv, d, bs, pad_blocks=2)
    q = torch.randn(len(LENGTHS), hq, d, generator=g)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    got = ops.decode_attention(q, k, v, tables, lens, d ** -0.5)
    in_range = torch.where(tables < k.shape[0], tables, 0)  # the torch path gathers whole rows of the tables
    expected = ref.paged_attention(q, k, v, in_range, lens, _qsl([1] * len(LENGTHS)), d ** -0.5, 1)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("bs", [16, 32])
def test_extend_matches_the_reference(ops, hq, hkv, d, bs):
    g = torch.Generator().manual_seed(hq * d + bs + 1)
    new = [1, 15, 16, 3, 300, 512, 100, 1500]  # chunk sizes, the last ones of each sequence's LENGTHS
    k, v, tables = _cache(g, LENGTHS, hkv, d, bs)
    q = torch.randn(sum(new), hq, d, generator=g) * 2
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    got = ops.extend_attention(q, k, v, tables, lens, _qsl(new), d ** -0.5)
    expected = ref.paged_attention(q, k, v, tables, lens, _qsl(new), d ** -0.5, max(new))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def _sequence(seed, length, hq, hkv, d, bs):
    """One sequence's queries at every position [length, hq, d] and its cache."""
    g = torch.Generator().manual_seed(seed)
    k, v, tables = _cache(g, [length], hkv, d, bs)
    return torch.randn(length, hq, d, generator=g) * 2, k, v, tables


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_a_row_has_the_same_bits_from_decode_and_from_any_chunk(ops, hq, hkv, d):
    """Every position's output: the prefill of the whole sequence in one chunk, in chunks of 1, 3, 16 and
    64 (so each row sits at every place of some chunk), and a decode of that position (one batched decode
    call holding every position as its own sequence) - all bit-identical."""
    L, bs = 1100, 16
    q, k, v, tables = _sequence(hq + d, L, hq, hkv, d, bs)
    scale = d ** -0.5
    whole = ops.extend_attention(q, k, v, tables, torch.tensor([L], dtype=torch.int32), _qsl([L]), scale)
    for size in (1, 3, 16, 64):
        rows = []
        for s in range(0, L, size):
            e = min(L, s + size)
            rows.append(ops.extend_attention(q[s:e], k, v, tables, torch.tensor([e], dtype=torch.int32),
                                             _qsl([e - s]), scale))
        assert torch.equal(torch.cat(rows), whole), f"chunks of {size}"
    lens = torch.arange(1, L + 1, dtype=torch.int32)
    decoded = ops.decode_attention(q, k, v, tables.expand(L, -1).contiguous(), lens, scale)
    assert torch.equal(decoded, whole)


def test_rows_have_the_same_bits_alone_batched_and_on_any_thread_count(ops):
    """Several sequences' chunks in one call (a decode among them) against each alone, on 1 and 2 threads."""
    hq, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(5)
    lens = [700, 1, 513, 40, 1500]
    new = [200, 1, 513, 7, 1]
    k, v, tables = _cache(g, lens, hkv, d, bs)
    q = torch.randn(sum(new), hq, d, generator=g)
    lt, qsl = torch.tensor(lens, dtype=torch.int32), _qsl(new)
    with torch_threads(1):
        one = ops.extend_attention(q, k, v, tables, lt, qsl, 0.125)
    with torch_threads(2):
        two = ops.extend_attention(q, k, v, tables, lt, qsl, 0.125)
    assert torch.equal(one, two)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        alone = ops.extend_attention(q[s:e], k, v, tables[i:i + 1], lt[i:i + 1], _qsl([e - s]), 0.125)
        assert torch.equal(alone, one[s:e]), f"sequence {i}"
    # the decodes (one new query each) through the decode op: alone, batched, 1 and 2 threads
    rows = [i for i, n in enumerate(new) if n == 1]
    idx = torch.tensor([int(qsl[i]) for i in rows])
    for threads in (1, 2):
        with torch_threads(threads):
            batched = ops.decode_attention(q[idx], k, v, tables[rows], lt[rows], 0.125)
        assert torch.equal(batched, one[idx])
        for j, i in enumerate(rows):
            with torch_threads(threads):
                alone = ops.decode_attention(q[idx[j:j + 1]], k, v, tables[i:i + 1], lt[i:i + 1], 0.125)
            assert torch.equal(alone[0], one[idx[j]])


def test_errors_are_clear(ops):
    g = torch.Generator().manual_seed(1)
    k, v, tables = _cache(g, [20], 2, 64, 16)
    q = torch.randn(1, 4, 64, generator=g)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.decode_attention(q.bfloat16(), k, v, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64 or 128"):
        ops.decode_attention(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), tables,
                             lens, 0.1)
    with pytest.raises(RuntimeError, match="outside"):
        ops.decode_attention(q, k, v, tables, torch.tensor([40], dtype=torch.int32), 0.1)
    bad = tables.clone()
    bad[0, 1] = 99
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.extend_attention(q, k, v, bad, lens, _qsl([1]), 0.1)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ops.extend_attention(q, k, v, tables, lens, _qsl([2]), 0.1)


def test_float32_attention_dispatches_to_the_avx2_op(ops, fresh_dispatch, monkeypatch):
    """Where this process may run AVX2 code, fp32 attention (decode and prefill) runs natively: fails if it
    would silently take torch."""
    def torch_path(*args, **kwargs):
        raise AssertionError("the torch attention path ran")

    monkeypatch.setattr(ref, "paged_attention", torch_path)
    g = torch.Generator().manual_seed(2)
    k, v, tables = _cache(g, [5, 40], 4, 64, 16)
    lens = torch.tensor([5, 40], dtype=torch.int32)
    q = torch.randn(2, 8, 64, generator=g)
    out = kernels.paged_attention(q, k, v, tables, lens, _qsl([1, 1]), 0.125, 1)
    assert torch.equal(out, ops.decode_attention(q, k, v, tables, lens, 0.125))
    q = torch.randn(6, 8, 64, generator=g)
    out = kernels.paged_attention(q, k, v, tables, lens, _qsl([2, 4]), 0.125, 4)
    assert torch.equal(out, ops.extend_attention(q, k, v, tables, lens, _qsl([2, 4]), 0.125))
    assert kernels.decode_reads_own_lengths("cpu", torch.float32, 8, 4, 64)
    assert implementation("attention_f32") == "native avx2"


def test_below_avx2_float32_attention_takes_torch(fresh_dispatch, monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_CAP, "baseline")
    monkeypatch.setattr(native, "_loaded", {})
    assert native_decode(torch.float32, 8, 4, 64) is None
    assert not kernels.decode_reads_own_lengths("cpu", torch.float32, 8, 4, 64)
