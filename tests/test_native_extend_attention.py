"""The native CPU prefill ("extend") attention (kernels/native/extend_attention.cpp) against the torch reference
and an fp64 computation, its invariance to batch, threads and chunking, its errors, and the dispatch that
chooses it.

Tolerance, as for the native decode attention (tests/test_native_attention.py): the native op sums bf16
products in fp32 and keeps the softmax in fp32, rounding only the probabilities (to bf16, for the P.V dot
products) and the output; the torch path also rounds the scores and q * scale to bf16. So the two differ in
the last bits. Asserted per case (max over every output): |native - exact| <= 1e-2 x max(1, max |exact|)
(sharply peaked scores give outputs of single V entries, up to ~4, where a bf16 probability near 1 is off by
up to 2^-9 of it) and <= |torch - exact| + 4e-3, and |native - torch| <= |torch - exact| + 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.attention import EXTEND_ATTENTION
from native_ops import load_or_skip


@pytest.fixture(scope="module")
def ops():
    """The native ops: this test machine has AVX512-BF16, so they must load (compiled once per CI run)."""
    return load_or_skip("extend_attention")


def _case(g, prefixes, chunks, hq, hkv, d, bs=16, pad_blocks=0, q_scale=1.0):
    """Sequence i has prefixes[i] cached tokens and chunks[i] new queries (their K/V already in the cache);
    random bf16 caches, each sequence's blocks scattered; block tables padded with `pad_blocks` extra
    columns of ids far out of range (never read). Returns q, k, v, tables, seq_lens, query_start_loc."""
    lens = [p + n for p, n in zip(prefixes, chunks)]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    k = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    ids = torch.randperm(nb, generator=g)
    tables = torch.full((len(lens), max(need) + pad_blocks), 1 << 30, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    q = (torch.randn(sum(chunks), hq, d, generator=g) * q_scale).bfloat16()
    qsl = torch.tensor([0] + list(chunks)).cumsum(0).to(torch.int32)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), qsl


def _exact(q, k, v, tables, lens, qsl, scale):
    """fp64 causal attention of each chunk's queries over their sequence's positions."""
    hq, d = q.shape[1:]
    bs, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(lens)):
        s, e, ctx = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        if s == e:
            continue
        pos = torch.arange(ctx)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        keys = k.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        values = v.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), keys) * scale
        qpos = torch.arange(ctx - (e - s), ctx)
        scores.masked_fill_(pos.view(1, 1, -1) > qpos.view(1, -1, 1), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def _check(ops, q, k, v, tables, lens, qsl, scale):
    got = ops.extend_attention(q, k, v, tables, lens, qsl, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    exact = _exact(q, k, v, tables, lens, qsl, scale)
    theirs = ref.paged_attention(q, k, v, tables, lens, qsl, scale, int((qsl[1:] - qsl[:-1]).max()))
    native_err = (got.double() - exact).abs().max().item()
    torch_err = (theirs.double() - exact).abs().max().item()
    magnitude = max(1.0, exact.abs().max().item())
    assert native_err <= 1e-2 * magnitude and native_err <= torch_err + 4e-3, (native_err, torch_err, magnitude)
    assert (got.double() - theirs.double()).abs().max().item() <= torch_err + 1e-2


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (9, 3), (8, 1), (16, 2)])  # GQA 1, 2, 3, 8, 8
def test_native_matches_reference_over_shapes(ops, head_dim, hq, hkv):
    # one call, several sequences: no prefix, a partial block, whole blocks, across the 128-key blocks
    g = torch.Generator().manual_seed(head_dim * 100 + hq * 10 + hkv)
    prefixes = [0, 0, 15, 16, 100, 300]
    chunks = [1, 37, 2, 16, 129, 70]
    _check(ops, *_case(g, prefixes, chunks, hq, hkv, head_dim, pad_blocks=2), head_dim ** -0.5)


def test_native_every_chunk_size_up_to_256(ops):
    g = torch.Generator().manual_seed(256)
    chunks = [1, 2, 3, 4, 5, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 255, 256]
    prefixes = [(37 * i) % 300 for i in range(len(chunks))]
    _check(ops, *_case(g, prefixes, chunks, 8, 4, 64), 0.125)


def test_native_long_prefixes_and_peaked_scores(ops):
    # prefixes up to ~2,048 cached tokens; scores spread widely (q x 8): the running max moves a lot
    g = torch.Generator().manual_seed(2048)
    _check(ops, *_case(g, [2047, 1792, 1000], [1, 256, 48], 9, 3, 64), 0.125)
    _check(ops, *_case(g, [1900, 513], [148, 20], 8, 4, 128, q_scale=8.0), 128 ** -0.5)


@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_native_any_block_size(ops, block_size):
    g = torch.Generator().manual_seed(block_size)
    _check(ops, *_case(g, [0, 6, 33, 250], [9, 40, 1, 100], 8, 4, 64, bs=block_size, pad_blocks=1), 0.125)


def test_native_skips_sequences_without_queries(ops):
    g = torch.Generator().manual_seed(3)
    _check(ops, *_case(g, [10, 40, 0], [5, 0, 20], 8, 4, 32), 32 ** -0.5)


def test_native_is_batch_thread_and_chunk_invariant(ops):
    """A query's result is bit-identical alone, in any batch, at any position in it, with 1 or 2 threads,
    and whichever chunk it arrives in: key blocks sit at absolute positions and a block past a query leaves
    it untouched."""
    g = torch.Generator().manual_seed(7)
    prefixes, chunks = [0, 700, 5, 1500, 64], [300, 33, 1, 90, 200]
    q, k, v, tables, lens, qsl = _case(g, prefixes, chunks, 8, 4, 64, pad_blocks=2)
    threads = torch.get_num_threads()
    try:
        batched = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            batched[n] = ops.extend_attention(q, k, v, tables, lens, qsl, 0.125)
        assert torch.equal(batched[1], batched[2])
        for i in range(len(chunks)):
            s, e = int(qsl[i]), int(qsl[i + 1])
            alone = ops.extend_attention(q[s:e], k, v, tables[i:i + 1], lens[i:i + 1],
                                         torch.tensor([0, e - s], dtype=torch.int32), 0.125)
            assert torch.equal(alone, batched[2][s:e]), i
        # the first sequence's 300 queries as chunks of 100 + 1 + 199 (each over the cache up to its end)
        pieces = [(0, 100), (100, 101), (101, 300)]
        for a, b in pieces:
            part = ops.extend_attention(q[a:b], k, v, tables[:1], torch.tensor([b], dtype=torch.int32),
                                        torch.tensor([0, b - a], dtype=torch.int32), 0.125)
            assert torch.equal(part, batched[1][a:b]), (a, b)
    finally:
        torch.set_num_threads(threads)


def test_native_takes_q_as_a_view_of_the_qkv_rows(ops):
    g = torch.Generator().manual_seed(1)
    q, k, v, tables, lens, qsl = _case(g, [20, 50], [30, 7], 8, 4, 64)
    wide = torch.cat((q, torch.randn(q.shape[0], 8, 64, generator=g).bfloat16()), dim=1)  # [T, Hq + 2 Hkv, D]
    view = wide[:, :8]
    assert not view.is_contiguous()
    assert torch.equal(ops.extend_attention(view, k, v, tables, lens, qsl, 0.125),
                       ops.extend_attention(q, k, v, tables, lens, qsl, 0.125))


def test_native_rejects_bad_input_with_clear_errors(ops):
    g = torch.Generator().manual_seed(2)
    q, k, v, tables, lens, qsl = _case(g, [20, 50], [4, 6], 8, 4, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.extend_attention(q.float(), k, v, tables, lens, qsl, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.extend_attention(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(),
                             tables, lens, qsl, 0.125)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.extend_attention(q, k, v, tables.masked_fill(tables == tables[1, 0], 1 << 20), lens, qsl, 0.125)
    with pytest.raises(RuntimeError, match="outside"):
        ops.extend_attention(q, k, v, tables, lens + 1000, qsl, 0.125)
    with pytest.raises(RuntimeError, match="outside"):
        ops.extend_attention(q, k, v, tables, torch.tensor([3, 56], dtype=torch.int32), qsl, 0.125)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ops.extend_attention(q, k, v, tables, lens, qsl + 1, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.extend_attention(q, k, v, tables, lens, qsl.long(), 0.125)


def test_this_machine_never_falls_back_silently(monkeypatch):
    """On a CPU with AVX512-BF16 a bf16 prefill chunk must run natively: fails if it would silently take
    torch."""
    load_or_skip("extend_attention")  # skipped, saying why, below the op's CPU level
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch prefill path ran")

    monkeypatch.setattr(ref, "paged_attention", torch_path)
    q, k, v, tables, lens, qsl = _case(torch.Generator().manual_seed(0), [0, 40], [12, 30], 8, 4, 64)
    out = kernels.paged_attention(q, k, v, tables, lens, qsl, 0.125, 30)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


# fp32 at head_dim 64 runs attention_f32.cpp (tests/test_native_attention_f32.py); at 96 neither op applies
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 96), (torch.bfloat16, 16), (torch.bfloat16, 96)])
def test_dispatch_takes_torch_where_native_does_not_apply(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k, v, tables, lens, qsl = _case(g, [5, 30], [10, 3], 8, 4, head_dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    assert torch.equal(kernels.paged_attention(q, k, v, tables, lens, qsl, 0.1, 10),
                       ref.paged_attention(q, k, v, tables, lens, qsl, 0.1, 10))


def test_native_off_switch(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.load("extend_attention") is None


def test_runner_prefills_natively_and_chunking_does_not_change_greedy_tokens(tmp_path, ops, fresh_dispatch):
    """bf16, head_dim 32: the runner's prefill chunks take the native op, and a prompt's greedy tokens and
    their logprobs are the same, bit for bit, prefilled in one chunk or in chunks of 48 over a growing
    cached prefix (beside another sequence): the op's rows do not depend on the chunking."""
    from model_factory import make_model
    from phaseserve.params import SamplingParams
    from runner_driver import run
    from phaseserve.workers.runner import ModelRunner

    calls = []
    extend = ops.extend_attention
    counted = type("Ops", (), {"extend_attention": staticmethod(lambda *a: calls.append(a[0].shape[0]) or extend(*a))})
    path = make_model(tmp_path, "llama_linear_head_dim", dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompts = [list(range(3, 203)), list(range(7, 47))]
    runner = ModelRunner(path, dtype="bfloat16", num_blocks=256)
    cfg = runner.model.cfg  # the model's prefill attention: the native op, its calls counted
    fresh_dispatch.pin(EXTEND_ATTENTION, (torch.bfloat16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), counted)
    outputs = {size: [(s.outputs, s.logprobs) for s in run(runner, prompts, greedy, chunk_size=size)]
               for size in (256, 48)}
    assert calls and max(calls) > 48
    assert outputs[256][0][1], "no logprobs came back"
    assert outputs[48] == outputs[256]
