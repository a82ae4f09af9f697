"""The native CPU decode attention (kernels/native/decode_attention.cpp) against the torch reference and an
fp64 computation, its batch invariance, its errors, and the dispatch that chooses it.

Tolerance: the native op scores with bf16 products summed in fp32, keeps the softmax in fp32 and rounds
only the probabilities (to bf16, for the p.V dot products) and the output; the torch path also rounds the
scores to bf16 before its softmax. Both sit within a few bf16 steps of the exact (fp64) result for outputs
of magnitude ~1: asserted as |native - exact| <= 1e-2 and <= |torch - exact| + 4e-3 (max over a case),
and |native - torch| <= |torch - exact| + 1e-2 (with sharply peaked scores, ~+-50, the torch path's bf16
scores are off by up to 0.25 before the exp, so it is the less exact one).
"""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels import reference as ref
from model_factory import make_model
from native_ops import load_or_skip
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from runner_driver import run
from phaseserve.workers.runner import ModelRunner



@pytest.fixture(scope="module")
def ops():
    """The native ops: this test machine has AVX512-BF16, so they must load (compiled once per CI run)."""
    return load_or_skip("decode_attention")


def test_this_machine_never_falls_back_silently(monkeypatch):
    """On a CPU with AVX512-BF16 a bf16 decode must run natively: fails if it would silently take torch."""
    load_or_skip("decode_attention")  # skipped, saying why, below the op's CPU level
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    assert kernels.decode_reads_own_lengths("cpu", torch.bfloat16, 8, 4, 64)

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch decode path ran")

    monkeypatch.setattr(ref, "paged_attention", torch_path)
    q, k, v, tables, lens = _case(torch.Generator().manual_seed(0), [5, 40], 8, 4, 64, 16)
    out = kernels.paged_attention(q, k, v, tables, lens, torch.tensor([0, 1, 2], dtype=torch.int32), 0.125, 1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


def _case(g, lens, hq, hkv, d, bs, pad_blocks=0, q_scale=1.0):
    """Random bf16 caches with each sequence's blocks scattered; block tables padded with `pad_blocks`
    extra columns of ids far out of range (never read)."""
    need = [-(-n // bs) for n in lens]
    width = max(need) + pad_blocks
    nb = sum(need) + 3
    k = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    ids = torch.randperm(nb, generator=g)
    tables = torch.full((len(lens), width), 1 << 30, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    q = (torch.randn(len(lens), hq, d, generator=g) * q_scale).bfloat16()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _exact(q, k, v, tables, lens, scale):
    """fp64 attention of each sequence over its own positions."""
    B, hq, d = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    out = []
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        slots = tables[b, pos // bs].long() * bs + pos % bs
        keys = k.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        values = v.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,khd->hk", q[b].double(), keys) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", p, values))
    return torch.stack(out)


def _check(ops, q, k, v, tables, lens, scale):
    got = ops.decode_attention(q, k, v, tables, lens, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    exact = _exact(q, k, v, tables, lens, scale)
    # the torch path pads every row to the longest; its tables must point at real blocks there
    torch_tables = tables.clone().masked_fill_(tables >= k.shape[0], 0)
    theirs = ref._decode_attention(q, k, v, torch_tables, lens, scale)
    native_err = (got.double() - exact).abs().max().item()
    torch_err = (theirs.double() - exact).abs().max().item()
    assert native_err <= 1e-2 and native_err <= torch_err + 4e-3, (native_err, torch_err)
    # and the two paths agree as closely as the torch path's own error allows
    assert (got.double() - theirs.double()).abs().max().item() <= torch_err + 1e-2


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (9, 3), (8, 1), (16, 2)])  # GQA 1, 2, 3, 8, 8
def test_native_matches_reference_over_shapes(ops, head_dim, hq, hkv):
    # lengths: one token, partial and whole blocks, and across the 512-token partitions
    g = torch.Generator().manual_seed(head_dim * 100 + hq * 10 + hkv)
    lens = [1, 15, 16, 17, 100, 511, 512, 513, 1100]
    _check(ops, *_case(g, lens, hq, hkv, head_dim, 16, pad_blocks=3), head_dim ** -0.5)


@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_native_any_block_size(ops, block_size):
    g = torch.Generator().manual_seed(block_size)
    _check(ops, *_case(g, [1, 6, 33, 300, 700], 8, 4, 64, block_size, pad_blocks=1), 0.125)


def test_native_long_contexts_and_peaked_scores(ops):
    # 4096 positions (8 partitions) and scores spread widely (q x 8): the running max moves a lot
    g = torch.Generator().manual_seed(4096)
    _check(ops, *_case(g, [4096, 3000, 4095], 9, 3, 64, 16), 0.125)
    _check(ops, *_case(g, [4096, 1023, 2], 8, 4, 128, 16, q_scale=8.0), 128 ** -0.5)


def test_native_is_batch_and_thread_invariant(ops):
    """A sequence's result is bit-identical alone, in any batch, at any position and with 1 or 2 threads:
    how a sequence is split into partitions depends only on its length. Alone on 2 threads the op splits
    its work items over KV heads (a batch this size does not): the same arithmetic, so the same bits."""
    g = torch.Generator().manual_seed(7)
    lens = [3, 700, 1500, 64, 4000, 513]
    q, k, v, tables, seq_lens = _case(g, lens, 8, 4, 64, 16, pad_blocks=2)
    threads = torch.get_num_threads()
    try:
        batched = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            batched[n] = ops.decode_attention(q, k, v, tables, seq_lens, 0.125)
        assert torch.equal(batched[1], batched[2])
        for n in (2, 1):
            torch.set_num_threads(n)
            for i in range(len(lens)):
                alone = ops.decode_attention(q[i:i + 1], k, v, tables[i:i + 1, :-(-lens[i] // 16)], seq_lens[i:i + 1],
                                             0.125)
                assert torch.equal(alone[0], batched[1][i]), (n, i)
        order = torch.tensor([4, 0, 5, 2, 1, 3])
        shuffled = ops.decode_attention(q[order], k, v, tables[order], seq_lens[order], 0.125)
        assert torch.equal(shuffled, batched[1][order])
    finally:
        torch.set_num_threads(threads)


def test_native_takes_q_as_a_view_of_the_qkv_rows(ops):
    # the model passes q as a strided view into its fused qkv output (rotary's output buffer)
    g = torch.Generator().manual_seed(1)
    q, k, v, tables, lens = _case(g, [20, 50], 8, 4, 64, 16)
    wide = torch.cat((q, torch.randn(2, 4, 64, generator=g).bfloat16()), dim=1)  # [B, Hq + Hkv, D]
    view = wide[:, :8]
    assert not view.is_contiguous()
    assert torch.equal(ops.decode_attention(view, k, v, tables, lens, 0.125),
                       ops.decode_attention(q, k, v, tables, lens, 0.125))


def test_native_rejects_bad_input_with_clear_errors(ops):
    g = torch.Generator().manual_seed(2)
    q, k, v, tables, lens = _case(g, [20, 50], 8, 4, 64, 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.decode_attention(q.float(), k, v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.decode_attention(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(),
                             tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.decode_attention(q, k, v, tables.masked_fill(tables == tables[1, 0], 1 << 20), lens, 0.125)
    with pytest.raises(RuntimeError, match="outside"):
        ops.decode_attention(q, k, v, tables, lens + 1000, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.decode_attention(q, k, v, tables.long(), lens, 0.125)


# fp32 at head_dim 64 runs attention_f32.cpp (tests/test_native_attention_f32.py); at 96 neither op applies
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 96), (torch.bfloat16, 16), (torch.bfloat16, 96)])
def test_dispatch_takes_torch_where_native_does_not_apply(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k, v, tables, lens = _case(g, [5, 30], 8, 4, head_dim, 16)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    tables.masked_fill_(tables >= k.shape[0], 0)  # the torch path reads the padding columns (masked)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert not kernels.decode_reads_own_lengths("cpu", dtype, 8, 4, head_dim)
    assert torch.equal(kernels.paged_attention(q, k, v, tables, lens, qsl, 0.1, 1),
                       ref.paged_attention(q, k, v, tables, lens, qsl, 0.1, 1))


def test_native_off_switch(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.load("decode_attention") is None


def test_runner_attends_all_native_decodes_in_one_call_each_as_alone(tmp_path, ops):
    """With the native kernel the runner gives a step's decodes one call, unsorted (no length buckets),
    and each sequence's greedy tokens equal a run of it alone (bf16, head_dim 32: the native path)."""
    path = make_model(tmp_path, "llama_linear_head_dim", dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (9, 300, 12, 5)]
    runner = ModelRunner(path, dtype="bfloat16", num_blocks=128)
    assert not runner.packer.bucket_decodes
    together = run(runner, prompts, greedy, chunk_size=512)
    alone_runner = ModelRunner(path, dtype="bfloat16", num_blocks=128)
    for seq, prompt in zip(together, prompts):
        assert seq.outputs == run(alone_runner, [prompt], greedy, chunk_size=512)[0].outputs
    starts = [SeqStart(f"s{i}", "g", p, greedy) for i, p in enumerate(prompts)]
    tables = [list(range(i * 32, i * 32 + 32)) for i in range(len(prompts))]
    runner.execute(StepPlan(0, "w", starts, [ScheduledChunk(f"s{i}", 0, len(p), tables[i])
                                             for i, p in enumerate(prompts)]))
    inp, ordered = runner.packer.pack([ScheduledChunk(f"s{i}", len(p), 1, tables[i]) for i, p in enumerate(prompts)])
    assert [c.seq_id for c in ordered] == ["s0", "s1", "s2", "s3"]
    assert [g.block_tables.shape for g in inp.groups] == [(4, -(-301 // runner.block_size))]


def test_a_native_op_that_fails_to_build_leaves_the_torch_path(monkeypatch, tmp_path):
    """A compiler error is logged and load() returns None (no exception): callers fall back to torch."""
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    monkeypatch.setitem(native.REQUIRES, "broken", "baseline")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("broken") is None
    with pytest.raises(ValueError, match="no native op source"):
        native.load("missing")
