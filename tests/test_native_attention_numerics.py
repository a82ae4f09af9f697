"""One numerics of the native bf16 attention (kernels/native/decode_attention.cpp and extend_attention.cpp): a
query row (one query head at one position) gets the same bits from the decode op and from the extend op, in
a chunk of any size at any place, alone or batched with other sequences, on 1 and 2 threads. A position's
logits can then not depend on which path computed it (a recompute, a prefix another request prefilled, k+1
rows verified in one pass)."""

from __future__ import annotations

import pytest
import torch

from native_ops import load_or_skip, torch_threads

# query heads, KV heads, head_dim (groups 3, 1, 4, 16, 2)
SHAPES = [(9, 3, 64), (8, 8, 32), (4, 1, 128), (32, 2, 128), (4, 2, 64)]


@pytest.fixture(scope="module")
def ops():
    return load_or_skip("decode_attention"), load_or_skip("extend_attention")


def _cache(g, lens, hkv, d, bs):
    """Random bf16 caches holding each sequence's blocks scattered."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    k = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    ids = torch.randperm(nb, generator=g)
    tables = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    return k, v, tables


def _qsl(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def _lens(*n):
    return torch.tensor(n, dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_a_row_has_the_same_bits_from_decode_and_from_any_chunk(ops, hq, hkv, d):
    """Every position's output: the prefill of the whole sequence in one chunk, in chunks of 1, 3, 16, 64
    and 200 (so each row sits at every place of some chunk), and a decode of that position (one batched
    decode call holding every position as its own sequence) - all bit-identical, on 1 and 2 threads."""
    decode, extend = ops
    L, bs = 1100, 16
    g = torch.Generator().manual_seed(hq + d)
    k, v, tables = _cache(g, [L], hkv, d, bs)
    q = (torch.randn(L, hq, d, generator=g) * 2).bfloat16()
    scale = d ** -0.5
    lens = torch.arange(1, L + 1, dtype=torch.int32)
    with torch_threads(1):
        decoded = decode.decode_attention(q, k, v, tables.expand(L, -1).contiguous(), lens, scale)
    for threads in (1, 2):
        with torch_threads(threads):
            whole = extend.extend_attention(q, k, v, tables, _lens(L), _qsl([L]), scale)
            assert torch.equal(whole, decoded), f"one chunk, {threads} threads"
            again = decode.decode_attention(q, k, v, tables.expand(L, -1).contiguous(), lens, scale)
            assert torch.equal(again, decoded), f"decode on {threads} threads"
            for size in (1, 3, 16, 64, 200):
                rows = [extend.extend_attention(q[s:min(L, s + size)], k, v, tables, _lens(min(L, s + size)),
                                                _qsl([min(L, s + size) - s]), scale) for s in range(0, L, size)]
                assert torch.equal(torch.cat(rows), decoded), f"chunks of {size}, {threads} threads"


def test_rows_have_the_same_bits_alone_batched_and_on_any_thread_count(ops):
    """Several sequences' chunks in one extend call (decodes among them) against each alone and against the
    decode op, on 1 and 2 threads."""
    decode, extend = ops
    hq, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(5)
    lens = [700, 1, 513, 40, 1500, 1030]
    new = [200, 1, 513, 7, 1, 4]
    k, v, tables = _cache(g, lens, hkv, d, bs)
    q = torch.randn(sum(new), hq, d, generator=g).bfloat16()
    lt, qsl = torch.tensor(lens, dtype=torch.int32), _qsl(new)
    with torch_threads(1):
        one = extend.extend_attention(q, k, v, tables, lt, qsl, 0.125)
    with torch_threads(2):
        two = extend.extend_attention(q, k, v, tables, lt, qsl, 0.125)
    assert torch.equal(one, two)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        alone = extend.extend_attention(q[s:e], k, v, tables[i:i + 1], lt[i:i + 1], _qsl([e - s]), 0.125)
        assert torch.equal(alone, one[s:e]), f"sequence {i}"
        # each row of the chunk as a decode at its own position
        rows = torch.arange(lens[i] - (e - s) + 1, lens[i] + 1, dtype=torch.int32)
        for threads in (1, 2):
            with torch_threads(threads):
                dec = decode.decode_attention(q[s:e], k, v, tables[i:i + 1].expand(e - s, -1).contiguous(),
                                              rows, 0.125)
            assert torch.equal(dec, one[s:e]), f"sequence {i} decoded, {threads} threads"
