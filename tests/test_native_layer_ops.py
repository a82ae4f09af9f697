"""The native CPU layer ops (kernels/native/layer_ops.cpp: rms_norm with and without the residual add,
silu_and_mul, rotary + KV-cache write, argmax of bf16 logits) against the torch reference, their batch and
thread invariance, their errors, and the dispatch that chooses them.

Tolerance: none. Every op is bit-identical to the reference: it rounds to bf16 exactly where torch does, keeps
torch's separate fp32 products and sums, sums rms_norm's squares in the order of torch's vectorized CPU sum, and
computes silu's exp as Sleef's expf (which torch's vectorized silu calls) - silu is checked on every one of the 65536
bf16 values. So a bf16 model gives the same logits with the native ops as with torch (asserted at the end). The
argument checks it shares with layer_ops_f32.cpp: test_native_layer_ops_twins.py."""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.layer_ops import LAYER_OPS, LayerOps, native_layer_ops
from model_factory import make_model
from native_ops import load_or_skip, torch_threads
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner

HIDDEN = [64, 576, 1024, 2048]
TOKENS = [1, 3, 16, 130]



@pytest.fixture(scope="module")
def ops():
    """The native ops: this test machine has AVX512-BF16, so they must load."""
    return load_or_skip("layer_ops")


# --------------------------------------------------------------------------- rms_norm


def _norm_case(g, tokens, hidden, scale=3.0):
    x = (torch.randn(tokens, hidden, generator=g) * scale).bfloat16()
    residual = torch.randn(tokens, hidden, generator=g).bfloat16()
    weight = (torch.randn(hidden, generator=g) * 0.2 + 1).bfloat16()
    return x, residual, weight


@pytest.mark.parametrize("hidden", HIDDEN + [8192, 100, 5])  # 8192: torch's cascade sum levels; 100, 5: tails
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_equals_reference_bit_for_bit(ops, hidden, tokens):
    g = torch.Generator().manual_seed(hidden * 1000 + tokens)
    x, residual, weight = _norm_case(g, tokens, hidden)
    out, h = ops.add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_h = ref.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert torch.equal(h, expected_h)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)[0])


@pytest.mark.parametrize("hidden", [576, 1024, 100])
def test_rms_norm_sums_in_torchs_order(ops, hidden):
    """A different summation order moves the statistic by an ulp, which flips an output's bf16 rounding only
    now and then: thousands of rows with outlier channels (as real residual streams have) make it show.
    (torch sums with its AVX2 kernel, 8 lanes, even on an AVX512 CPU: a 16-lane order failed this.)"""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(4096, hidden, generator=g) * torch.rand(4096, 1, generator=g) * 4
    x[:, :: max(1, hidden // 7)] *= 30
    x, residual = x.bfloat16(), torch.randn(4096, hidden, generator=g).bfloat16()
    weight = (torch.randn(hidden, generator=g) * 0.2 + 1).bfloat16()
    assert torch.equal(ops.add_rms_norm(x, residual, weight, 1e-5)[0], ref.rms_norm(x, weight, 1e-5, residual)[0])
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)[0])


def test_rms_norm_wide_ranges_and_zero_rows(ops):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 576, generator=g) * torch.tensor([1e-20, 1e-3, 1.0, 1e3, 1e18, 0.0])[:, None]
    x = x.bfloat16()
    weight = torch.randn(576, generator=g).bfloat16()
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)[0])
    assert torch.equal(ops.add_rms_norm(x, -x, weight, 1e-6)[0], ref.rms_norm(x, weight, 1e-6, -x)[0])


def test_rms_norm_keeps_leading_dims(ops):
    g = torch.Generator().manual_seed(12)
    x, residual, weight = _norm_case(g, 6, 64)
    x3, r3 = x.view(2, 3, 64), residual.view(2, 3, 64)
    out, h = ops.add_rms_norm(x3, r3, weight, 1e-5)
    assert out.shape == h.shape == (2, 3, 64)
    assert torch.equal(out, ref.rms_norm(x3, weight, 1e-5, r3)[0]) and torch.equal(h, x3 + r3)


# --------------------------------------------------------------------------- silu_and_mul


def test_silu_equals_torch_on_every_bf16_value(ops):
    """silu(gate) rounded to bf16 depends on 16 bits only: all 65536 gates, then * up by a spread of ups."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for up in (torch.ones(65536), torch.randn(65536, generator=torch.Generator().manual_seed(0)) * 5):
        x = torch.cat((gates, up.bfloat16())).view(1, -1)
        got, expected = ops.silu_and_mul(x), ref.silu_and_mul(x)
        same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
        assert bool(same.all()), gates[~same[0]][:10]


@pytest.mark.parametrize("inter", [64, 576, 1536, 2816, 100, 5])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_equals_reference_bit_for_bit(ops, inter, tokens):
    g = torch.Generator().manual_seed(inter * 1000 + tokens)
    x = (torch.randn(tokens, 2 * inter, generator=g) * 4).bfloat16()
    out = ops.silu_and_mul(x)
    assert out.shape == (tokens, inter) and torch.equal(out, ref.silu_and_mul(x))


# --------------------------------------------------------------------------- rotary + KV write


def _cos_sin(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotary_case(g, tokens, hq, hkv, d, rotary_dim=None, nb=40, bs=16):
    """q, k, v as views of one qkv GEMM output (as the model passes them), positions up to 4095, scattered
    slots with some -1 (padding), random caches."""
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 2).bfloat16()
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    positions[0] = 4095
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    if tokens > 1:
        slots[torch.randperm(tokens, generator=g)[: max(1, tokens // 5)]] = -1
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    return qkv, q, k, v, positions, _cos_sin(4096, rotary_dim or d), k_cache, v_cache, slots


def _check_rotary(ops, qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots):
    eq, ek = ref.rotary_embedding(positions, q, k, cos_sin)
    ekc, evc = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(ek, v, ekc, evc, slots)
    v_before = v.clone()
    assert ops.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots) is True
    assert torch.equal(q, eq) and torch.equal(k, ek)  # rotated in place, in the qkv buffer
    assert torch.equal(v, v_before)
    assert torch.equal(k_cache, ekc) and torch.equal(v_cache, evc)  # written slots, and the rest untouched


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (9, 3), (8, 1), (16, 2)])  # GQA 1, 2, 3, 8, 8
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_and_write_kv_equals_reference_bit_for_bit(ops, head_dim, hq, hkv, tokens):
    g = torch.Generator().manual_seed(head_dim * 10000 + hq * 100 + hkv * 10 + tokens)
    _check_rotary(ops, *_rotary_case(g, tokens, hq, hkv, head_dim))


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 32), (128, 64), (80, 80), (96, 48)])
def test_rotary_partial_and_ragged_head_dims(ops, head_dim, rotary_dim):
    # rotary over the first rotary_dim features only; halves that are not a multiple of 16 (masked tails)
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    _check_rotary(ops, *_rotary_case(g, 7, 6, 2, head_dim, rotary_dim))


def test_rotary_on_separate_tensors_and_all_slots_skipped(ops):
    g = torch.Generator().manual_seed(5)
    _, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 5, 8, 2, 64)
    q, k, v = q.clone(), k.clone(), v.clone()
    _check_rotary(ops, None, q, k, v, positions, cos_sin, k_cache, v_cache, torch.full((5,), -1))
    _check_rotary(ops, None, q, k, v, positions, cos_sin, k_cache, v_cache, slots)


# --------------------------------------------------------------------------- invariance


def test_a_row_alone_equals_the_row_in_a_batch_at_1_and_2torch_threads(ops):
    """Shapes big enough that 2 threads split the rows: every result is bit-identical to the row alone,
    with either thread count."""
    g = torch.Generator().manual_seed(21)
    x, residual, weight = _norm_case(g, 130, 2048)
    gate_up = (torch.randn(130, 2 * 2816, generator=g) * 4).bfloat16()
    case = _rotary_case(g, 130, 16, 8, 128)
    results = {}
    for n in (1, 2):
        with torch_threads(n):
            rot = [t.clone() for t in case]
            qkv, q, k, v = rot[0], *(t.view(130, -1, 128) for t in rot[0].split((2048, 1024, 1024), dim=-1))
            ops.rotary_and_write_kv(rot[4], q, k, v, rot[5], rot[6], rot[7], rot[8])
            results[n] = (ops.add_rms_norm(x, residual, weight, 1e-5), ops.rms_norm(x, weight, 1e-5),
                          ops.silu_and_mul(gate_up), qkv, rot[6], rot[7])
    norm, plain, act, qkv, kc, vc = results[1]
    other = results[2]
    assert torch.equal(norm[0], other[0][0]) and torch.equal(norm[1], other[0][1])
    assert torch.equal(plain, other[1]) and torch.equal(act, other[2])
    assert torch.equal(qkv, other[3]) and torch.equal(kc, other[4]) and torch.equal(vc, other[5])
    for i in (0, 57, 129):
        alone = ops.add_rms_norm(x[i:i + 1], residual[i:i + 1], weight, 1e-5)
        assert torch.equal(alone[0][0], norm[0][i]) and torch.equal(alone[1][0], norm[1][i])
        assert torch.equal(ops.rms_norm(x[i:i + 1], weight, 1e-5)[0], plain[i])
        assert torch.equal(ops.silu_and_mul(gate_up[i:i + 1])[0], act[i])
        one = [t.clone() for t in case]
        row = one[0][i:i + 1]
        q, k, v = (t.view(1, -1, 128) for t in row.split((2048, 1024, 1024), dim=-1))
        ops.rotary_and_write_kv(one[4][i:i + 1], q, k, v, one[5], one[6], one[7], one[8][i:i + 1])
        assert torch.equal(row[0], qkv[i])


# --------------------------------------------------------------------------- argmax


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 64, 65, 1000, 32003, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_equals_torch_on_the_fp32_copy(ops, vocab, rows):
    g = torch.Generator().manual_seed(vocab * 31 + rows)
    # few distinct bf16 values (x8, rounded): many ties for the first index to settle
    logits = (torch.randn(rows, vocab, generator=g) * 8).round().bfloat16()
    got = ops.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.float().argmax(dim=-1))


def test_argmax_ties_infinities_zeros_and_nans(ops):
    """First index on ties wherever the maxima sit (lanes, accumulators, the tail), -0 == +0, all -inf,
    +inf, and NaN (the first NaN is torch's maximum)."""
    V = 1000
    rows = []
    for positions in ([5, 40, 100], [999], [64, 65], [0, 999], [17, 81, 145, 209], [992, 995]):
        r = torch.zeros(V)
        r[positions] = 3.0
        rows.append(r)
    rows.append(torch.full((V,), -float("inf")))
    rows.append(torch.full((V,), 2.5))
    signed = torch.full((V,), -1.0)
    signed[[300, 20]] = torch.tensor([0.0, -0.0])  # -0 at 20 comes first: tied with +0
    rows.append(signed)
    inf = torch.zeros(V)
    inf[[700, 7]] = float("inf")
    rows.append(inf)
    late_finite = torch.full((V,), -float("inf"))
    late_finite[998] = -1e30
    rows.append(late_finite)
    for nan_at in ([500], [980, 3], [999]):
        r = torch.randn(V)
        r[10] = float("inf")
        r[nan_at] = float("nan")
        rows.append(r)
    logits = torch.stack(rows).bfloat16()
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(ops.argmax(logits), expected)
    assert expected.tolist()[:6] == [5, 999, 64, 0, 17, 992]  # the cases are what they say
    assert expected.tolist()[6:] == [0, 0, 20, 7, 998, 500, 3, 999]


def test_argmax_strided_rows_alone_and_at_1_and_2torch_threads(ops):
    g = torch.Generator().manual_seed(12)
    wide = (torch.randn(16, 49200, generator=g) * 4).bfloat16()
    logits = wide[:, :49152]  # rows with a stride
    expected = logits.float().argmax(dim=-1)
    for n in (1, 2):
        with torch_threads(n):
            assert torch.equal(ops.argmax(logits), expected)
    for i in (0, 9, 15):
        assert ops.argmax(logits[i:i + 1]).item() == expected[i].item()
    assert ops.argmax(logits[:0]).shape == (0,)


def test_rotary_declines_what_it_does_not_take_and_touches_nothing(ops):
    """Other dtypes and layouts return False with every tensor as it was: the dispatch then runs torch."""
    g = torch.Generator().manual_seed(9)
    case = _rotary_case(g, 4, 4, 2, 64)
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = case
    before = [t.clone() for t in case]
    declined = [
        (positions.int(), q, k, v, cos_sin, k_cache, v_cache, slots),  # index dtypes differ
        (positions, q, k, v, cos_sin.bfloat16(), k_cache, v_cache, slots),
        (positions, q, k, v, cos_sin, k_cache.float(), v_cache, slots),
        (positions, q.float(), k, v, cos_sin, k_cache, v_cache, slots),
        (positions, q.transpose(1, 2), k, v, cos_sin, k_cache, v_cache, slots),  # head_dim not dense
        (positions.float(), q, k, v, cos_sin, k_cache, v_cache, slots.float()),
    ]
    for args in declined:
        assert ops.rotary_and_write_kv(*args) is False
    assert all(torch.equal(a, b) for a, b in zip(case, before))


def test_rotary_takes_int32_positions_and_slots(ops):
    g = torch.Generator().manual_seed(10)
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 9, 8, 2, 64)
    eq, ek = ref.rotary_embedding(positions, q, k, cos_sin)  # the reference takes int64 only
    expected = [k_cache.clone(), v_cache.clone()]
    ref.write_kv_cache(ek, v, *expected, slots)
    assert ops.rotary_and_write_kv(positions.int(), q, k, v, cos_sin, k_cache, v_cache, slots.int())
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


# --------------------------------------------------------------------------- dispatch


def test_this_machine_never_falls_back_silently(monkeypatch, fresh_dispatch):
    """On a CPU with AVX512-BF16 the bf16 layer ops must run natively: fails if they would take torch."""
    load_or_skip("layer_ops")  # skipped, saying why, below the op's CPU level

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch layer op ran")

    for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache", "rotary_and_write_kv", "argmax"):
        monkeypatch.setattr(ref, name, torch_path)
    g = torch.Generator().manual_seed(1)
    x, residual, weight = _norm_case(g, 4, 576)
    assert kernels.rms_norm(x, weight, 1e-5)[1] is None
    assert kernels.rms_norm(x, weight, 1e-5, residual)[1].shape == x.shape
    assert kernels.silu_and_mul(x).shape == (4, 288)
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 4, 9, 3, 64)
    before = qkv.clone()
    qo, ko = kernels.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert qo is q and ko is k and not torch.equal(qkv, before)  # rotated in place
    assert torch.equal(kernels.argmax(x), x.float().argmax(dim=-1))


def test_dispatch_off_switch_runs_torch(monkeypatch, fresh_dispatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native_layer_ops(torch.bfloat16) is None
    g = torch.Generator().manual_seed(4)
    x, residual, weight = _norm_case(g, 3, 64)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, residual)[0], ref.rms_norm(x, weight, 1e-5, residual)[0])


def test_dispatch_takes_strided_and_int32_inputs(ops, fresh_dispatch):
    g = torch.Generator().manual_seed(6)
    x, residual, weight = _norm_case(g, 6, 128)
    wide = torch.cat((x, x), dim=1)[:, :128]  # rows with a stride, not contiguous
    assert torch.equal(kernels.rms_norm(wide, weight, 1e-5, residual)[0], ref.rms_norm(x, weight, 1e-5, residual)[0])
    assert torch.equal(kernels.silu_and_mul(wide), ref.silu_and_mul(x))
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 5, 4, 2, 64)
    eq, ek = ref.rotary_embedding(positions, q, k, cos_sin)
    ekc, evc = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(ek, v, ekc, evc, slots)
    qo, ko = kernels.rotary_and_write_kv(positions.int(), q, k, v, cos_sin, k_cache, v_cache, slots.int())
    assert torch.equal(qo, eq) and torch.equal(ko, ek) and torch.equal(k_cache, ekc) and torch.equal(v_cache, evc)


def _logits(runner: ModelRunner, seqs: list[list[int]], schedule: list[list[int]]) -> torch.Tensor:
    """Every row's logits, teacher-forced: per sequence, the chunk sizes of successive packed steps (1 = a
    decode-shaped step), as tests/test_model_logits.py runs them."""
    runner.execute(StepPlan(0, "w", [SeqStart(f"s{i}", "g", ids, SamplingParams()) for i, ids in enumerate(seqs)]))
    bs, pos, out = runner.block_size, [0] * len(seqs), []
    for step in range(max(len(s) for s in schedule)):
        chunks = []
        for i, sizes in enumerate(schedule):
            if step < len(sizes):
                end = pos[i] + sizes[step]
                chunks.append(ScheduledChunk(f"s{i}", pos[i], sizes[step], list(range(i * 32, i * 32 + -(-end // bs)))))
                pos[i] = end
        inp, _ = runner.packer.pack(chunks)
        inp.logits_indices = torch.arange(inp.input_ids.shape[0])
        out.append(runner.model.forward(inp, runner.kv))
    return torch.cat(out)


def test_bf16_model_logits_equal_with_native_and_torch_layer_ops(tmp_path, ops, monkeypatch, fresh_dispatch):
    """A bf16 model's logits over prefill and decode steps are identical with the native layer ops and with
    torch (the ops are bit-identical, so nothing downstream may differ either)."""
    path = make_model(tmp_path, "llama_gqa_llama3", dtype="bfloat16")
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 30)]
    schedule = [[33, 1, 1, 1, 1, 1, 1, 1], [7, 7, 16]]  # prefill chunks, then decodes beside them
    got = {}
    for impl in ("native", "torch"):
        fresh_dispatch.pin(LAYER_OPS, torch.bfloat16, LayerOps(ops, torch.bfloat16) if impl == "native" else None)
        runner = ModelRunner(path, dtype="bfloat16", num_blocks=64)
        got[impl] = _logits(runner, seqs, schedule)
    assert got["native"].shape[0] == 40 + 30
    assert torch.equal(got["native"], got["torch"])
