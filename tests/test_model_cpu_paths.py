"""The CPU fast paths give the same results as the plain computations they replace: prepacked
oneDNN linears, the top-k/top-p filter on a sorted prefix, decode attention in batches of
sequences, the per-step rotary factors, rotary over q and k in one pass, rms_norm without an fp32
copy, and the runner's trimmed block tables."""

import pytest
import torch
import torch.nn.functional as F

from phaseserve.kernels import cpu_isa, native, reference_sampling
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.linears import BF16_GEMM
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.linear import Linear
from runner_driver import run
from phaseserve.workers.input_packer import MIN_BUCKET_BLOCKS, decode_buckets
from phaseserve.workers.runner import ModelRunner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 64, 33, 100])  # 33, 100: padded to a multiple of ROW_QUANTUM
def test_packed_linear_matches_f_linear(fresh_dispatch, dtype, rows):
    """oneDNN's packed weight: fp32, and bf16 where the native GEMM does not run (forced off here; the
    native one is tested in test_native_bf16_gemm.py)."""
    fresh_dispatch.pin(BF16_GEMM, None, None)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    lin = Linear(w, b)
    # the fast path is really taken where oneDNN runs this dtype: fp32 everywhere, bf16 where its own check of
    # the CPU says it computes bf16 (AVX512-BF16, AMX); elsewhere the plain weight, exactly as F.linear
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert lin.packed == packs and (lin.weight.layout == torch._mkldnn) == packs
    tol = 0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=tol, rtol=tol)
    assert lin(x[:0]).shape == (0, 96)
    assert Linear(w, b, pack=False)(x).equal(F.linear(x, w, b))


def test_linear_row_counts_fall_into_few_shapes():
    # oneDNN compiles a primitive per row count: a step of any size up to 512 rows must reuse a few
    from phaseserve.workers.linear import ROW_QUANTUM, padded_rows

    shapes = {padded_rows(r) for r in range(1, 513)}
    assert len(shapes) <= ROW_QUANTUM + 512 // ROW_QUANTUM
    assert all(padded_rows(r) >= r and padded_rows(r) - r < ROW_QUANTUM for r in range(1, 513))
    assert [padded_rows(r) for r in (1, 2, 16, 17, 33, 512)] == [2, 2, 16, 32, 48, 512]  # one row: as two (one numerics)


def _sample_args(B, V, seed, top_k, top_p, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(B, V, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    temperature = torch.linspace(0.5, 1.5, B)
    return (logits, temperature, torch.tensor(top_k, dtype=torch.int32)[:B], torch.tensor(top_p)[:B],
            torch.zeros(B), noise)


@pytest.mark.parametrize("seed", range(4))
def test_sample_prefix_filter_equals_full_sort(monkeypatch, seed):
    """A vocab wider than the prefix: rows with small top-k, no top-k with top-p, and unfiltered rows."""
    monkeypatch.setattr(reference_sampling, "_SAMPLE_PREFIX", 64)
    args = _sample_args(6, 500, seed, [0, 5, 40, 0, 64, 0], [1.0, 1.0, 0.9, 0.5, 0.7, 0.3], scale=6.0)
    k = torch.tensor([500, 5, 40, 500, 64, 500])
    prefix = reference_sampling._top_k_top_p_prefix(args[0] / args[1].unsqueeze(1), k, args[3])
    assert prefix is not None  # the prefix path decides these rows
    expected = _sorted_sample(*args)
    assert torch.equal(ref.sample(*args), expected)


def test_sample_falls_back_to_full_sort_when_prefix_is_short(monkeypatch):
    monkeypatch.setattr(reference_sampling, "_SAMPLE_PREFIX", 8)
    # flat logits: top-p 0.95 needs far more than 8 tokens; top-k 100 does not fit either
    args = _sample_args(2, 300, 0, [0, 100], [0.95, 1.0], scale=0.1)
    assert reference_sampling._top_k_top_p_prefix(args[0], torch.tensor([300, 100]), args[3]) is None
    assert torch.equal(ref.sample(*args), _sorted_sample(*args))


def _sorted_sample(logits, temperature, top_k, top_p, min_p, noise):
    t = temperature.unsqueeze(1)
    V = logits.shape[1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V)).long()
    x = reference_sampling._top_k_top_p_sorted(logits / t, k, top_p)
    return (x.softmax(dim=1) / noise).argmax(dim=1)


def test_decode_attention_in_batches_equals_one_batch(monkeypatch):
    g = torch.Generator().manual_seed(0)
    B, H, KVH, D, bs = 7, 4, 2, 16, 4
    k_cache, v_cache = torch.randn(40, bs, KVH, D, generator=g), torch.randn(40, bs, KVH, D, generator=g)
    tables = torch.randperm(40, generator=g)[:B * 5].view(B, 5).int()
    seq_lens = torch.randint(1, 21, (B,), generator=g, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=g)
    whole = ref._decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    monkeypatch.setattr(ref, "_DECODE_GATHER_BYTES", 2 * 20 * KVH * D * 4 * 3)  # 3 sequences per batch
    torch.testing.assert_close(ref._decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25), whole)


def test_prefill_tiles_padded_for_the_primitive_cache_equal_exact_tiles(monkeypatch):
    # chunks of 2..70 queries over cached prefixes, none a multiple of the quanta: padded query rows
    # and masked extra keys (up to whole blocks, never past the sequence's own) change nothing
    g = torch.Generator().manual_seed(3)
    H, KVH, D, bs = 4, 2, 16, 8
    chunks = [(0, 2), (5, 19), (40, 33), (13, 70), (0, 1), (90, 1), (10, 300)]  # (cached, new); 300: 3 tiles
    nblk = [-(-(c + n) // bs) for c, n in chunks]
    k_cache, v_cache = torch.randn(sum(nblk), bs, KVH, D, generator=g), torch.randn(sum(nblk), bs, KVH, D, generator=g)
    tables = torch.zeros(len(chunks), max(nblk), dtype=torch.int32)
    ids = torch.randperm(sum(nblk), generator=g)
    for i, n in enumerate(nblk):
        tables[i, :n] = ids[sum(nblk[:i]):sum(nblk[:i]) + n]
    news = torch.tensor([n for _, n in chunks])
    qsl = torch.cat((torch.zeros(1, dtype=torch.int32), news.cumsum(0).int()))
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    q = torch.randn(int(news.sum()), H, D, generator=g)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, 0.25, int(news.max()))
    padded = ref.paged_attention(*args)
    monkeypatch.setattr(ref, "_QUERY_QUANTUM", 1)
    monkeypatch.setattr(ref, "_KEY_QUANTUM", 1)
    torch.testing.assert_close(padded, ref.paged_attention(*args))
    # and both equal plain causal attention, one query at a time
    for i, (cached, new) in enumerate(chunks):
        positions = torch.arange(cached + new)
        slots = tables[i, positions // bs].long() * bs + positions % bs
        keys = k_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)  # [ctx, H, D]
        values = v_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)
        for j in range(new):
            seen = cached + j + 1
            probs = (torch.einsum("hd,khd->hk", q[qsl[i] + j], keys[:seen]) * 0.25).softmax(-1)
            torch.testing.assert_close(padded[qsl[i] + j], torch.einsum("hk,khd->hd", probs, values[:seen]))


@pytest.mark.parametrize("shape", [(4, 128, 512), (16, 4, 2, 192), (3, 7, 1000)])
def test_bf16_softmax_equals_the_fp32_formula_bit_for_bit(shape):
    # attention takes its softmax straight on bf16 scores: it must round exactly as Hugging Face's
    # softmax(scores.float()).to(bf16) does, masked (-inf) columns and a wide range of scores included
    g = torch.Generator().manual_seed(len(shape))
    scores = (torch.randn(*shape, generator=g) * 6).bfloat16()
    scores[..., -37:] = float("-inf")
    assert ref._softmax(scores).equal(scores.float().softmax(dim=-1).to(torch.bfloat16))


def test_per_step_state_follows_in_place_edits_of_the_step_tensors():
    """Slot validity and the decode layout are computed once a step and reused by every layer: an edit
    of the same tensor object in place must not reuse a stale answer."""
    g = torch.Generator().manual_seed(0)
    KVH, D, bs = 2, 8, 4
    k, v = torch.randn(3, KVH, D, generator=g), torch.randn(3, KVH, D, generator=g)
    k_cache, v_cache = torch.zeros(6, bs, KVH, D), torch.zeros(6, bs, KVH, D)
    slots = torch.tensor([0, 5, 9])
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    slots[1] = -1  # now skipped
    k_cache.zero_()
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(-1, KVH, D)
    assert torch.equal(flat[0], k[0]) and torch.equal(flat[9], k[2]) and not flat[5].any()

    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([8, 3], dtype=torch.int32)
    q = torch.randn(2, 4, D, generator=g)
    k_cache, v_cache = torch.randn(6, bs, KVH, D, generator=g), torch.randn(6, bs, KVH, D, generator=g)
    ref._decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.5)
    seq_lens[1] = 7
    tables[0, 0] = 5
    got = ref._decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.5)
    assert torch.equal(got, ref._decode_attention(q, k_cache, v_cache, tables.clone(), seq_lens.clone(), 0.5))


def test_rotary_factors_follow_in_place_edits_of_positions():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(50, 8, generator=g)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    positions = torch.tensor([1, 2, 3])
    ref.rotary_embedding(positions, q, k, cache)
    positions.add_(10)
    got = ref.rotary_embedding(positions, q, k, cache)
    expected = ref.rotary_embedding(positions.clone(), q, k, cache)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,rotary_dim", [(1, 16), (6, 16), (6, 8)])
def test_rotary_on_views_of_one_qkv_row_equals_separate_tensors(dtype, tokens, rotary_dim):
    g = torch.Generator().manual_seed(tokens)
    H, KVH, D = 4, 2, 16
    qkv = torch.randn(tokens, (H + 2 * KVH) * D, generator=g).to(dtype)
    q, k, _ = qkv.split((H * D, KVH * D, KVH * D), dim=-1)
    q, k = q.view(tokens, H, D), k.view(tokens, KVH, D)
    cache, positions = torch.randn(50, rotary_dim, generator=g), torch.randint(0, 50, (tokens,), generator=g)
    assert ref._adjacent_heads(q, k) is not None and ref._adjacent_heads(k, q) is None
    before = qkv.clone()
    qo, ko = ref.rotary_embedding(positions, q, k, cache)
    eq, ek = ref.rotary_embedding(positions.clone(), q.clone(), k.clone(), cache)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    assert torch.equal(qkv, before)  # the inputs are left as they were
    assert not torch.equal(qo, q)


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_equals_the_transformers_formula_bit_for_bit(with_residual):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(7, 256, generator=g) * 4).bfloat16(), torch.randn(7, 256, generator=g).bfloat16()
    w = (torch.randn(256, generator=g) * 0.1 + 1).bfloat16()
    h = x + res if with_residual else x
    hf = h.float()  # transformers' LlamaRMSNorm: fp32 statistics, normalized value rounded to bf16, then * weight
    expected = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out, new_res = ref.rms_norm(x, w, 1e-6, res if with_residual else None)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert (new_res is None) != with_residual and (new_res is None or torch.equal(new_res, h))


def test_block_tables_are_cut_to_the_blocks_in_use(tmp_path):
    runner = ModelRunner(make_model(tmp_path, "llama"), dtype="float32", num_blocks=64)
    bs = runner.block_size
    runner.execute(StepPlan(0, "w", [SeqStart(s, "g", list(range(3, 3 + n)), SamplingParams())
                                     for s, n in (("a", 20), ("b", 5))]))
    # both sequences reserve 10 blocks; the step needs 2 (a: 20 tokens) and 1 (b: 5 tokens)
    chunks = [ScheduledChunk("a", 19, 1, list(range(10))), ScheduledChunk("b", 0, 5, list(range(10, 20)))]
    inp, ordered = runner.packer.pack(chunks)
    decode, prefill = inp.groups
    assert decode.block_tables.shape == (1, -(-20 // bs)) and prefill.block_tables.shape == (1, 1)
    assert inp.positions.tolist() == [19, 0, 1, 2, 3, 4]
    assert inp.slot_mapping.tolist() == [1 * bs + 3] + [10 * bs + i for i in range(5)]


def test_decode_buckets_split_only_where_padding_would_be_large():
    bs = 16
    blocks = lambda *n: [b * bs for b in n]  # noqa: E731 -- lengths of exactly n blocks
    assert decode_buckets([], bs) == []
    assert decode_buckets(blocks(1, 2, 5, 16), bs) == [(0, 4)]  # all within MIN_BUCKET_BLOCKS
    assert decode_buckets(blocks(13, 13, 14, 125), bs) == [(0, 3), (3, 4)]  # one long sequence alone
    assert decode_buckets(blocks(1, 16, 17, 34, 35, 128), bs) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    # every bucket's longest needs at most max(2 x its shortest, MIN_BUCKET_BLOCKS) blocks
    lengths = sorted(torch.randint(1, 4000, (200,), generator=torch.Generator().manual_seed(0)).tolist())
    ranges = decode_buckets(lengths, bs)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(ranges, ranges[1:]))
    for a, b in ranges:
        assert -(-lengths[b - 1] // bs) <= max(2 * -(-lengths[a] // bs), MIN_BUCKET_BLOCKS)


@pytest.mark.parametrize("decode_path", ["torch", "native"])
def test_long_and_short_decodes_in_one_step_equal_each_alone(tmp_path, monkeypatch, fresh_dispatch, decode_path):
    """A long sequence decoding beside short ones: every sequence's greedy tokens match a run of that
    sequence alone. The torch decode path (which pads each call to its longest context) attends the long one
    in its own bucket; the native one reads each sequence's own length and takes all in one call."""
    if decode_path == "torch":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    elif not cpu_isa.supports(native.REQUIRES["attention_f32"]):
        pytest.skip(f"the fp32 native attention needs {native.REQUIRES['attention_f32']}")
    path = make_model(tmp_path, "llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (9, 300, 12, 5)]
    together = run(ModelRunner(path, dtype="float32", num_blocks=128), prompts, greedy, chunk_size=512)
    runner = ModelRunner(path, dtype="float32", num_blocks=128)
    for seq, prompt in zip(together, prompts):
        alone = run(runner, [prompt], greedy, chunk_size=512)[0]
        assert seq.outputs == alone.outputs
    runner = ModelRunner(path, dtype="float32", num_blocks=128)
    bs = runner.block_size
    starts = [SeqStart(f"s{i}", "g", p, greedy) for i, p in enumerate(prompts)]
    tables = [list(range(i * 32, i * 32 + 32)) for i in range(len(prompts))]
    runner.execute(StepPlan(0, "w", starts, [ScheduledChunk(f"s{i}", 0, len(p), tables[i])
                                             for i, p in enumerate(prompts)]))
    inp, ordered = runner.packer.pack([ScheduledChunk(f"s{i}", len(p), 1, tables[i]) for i, p in enumerate(prompts)])
    if decode_path == "torch":  # the step's decodes really were split: 3 short ones together, the long one alone
        assert [c.seq_id for c in ordered] == ["s3", "s0", "s2", "s1"]
        assert [g.block_tables.shape for g in inp.groups] == [(3, 1), (1, -(-301 // bs))]
    else:
        assert [g.block_tables.shape for g in inp.groups] == [(4, -(-301 // bs))]
