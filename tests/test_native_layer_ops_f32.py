"""The native float32 layer ops (kernels/native/layer_ops_f32.cpp: rms_norm with and without the residual add,
silu_and_mul, rotary + KV-cache write, argmax, for AVX2 + FMA) against the torch reference, their batch and
thread invariance, their errors, and the dispatch that chooses them.

Tolerance: none. Every op is bit-identical to the reference: the same separate fp32 operations, rms_norm's squares
summed in the order of torch's vectorized CPU sum, silu's exp as torch's loop computes it (Sleef's expf in whole
vector steps, the C library's past them). So an fp32 model gives the same logits with these ops as with torch
(asserted at the end), and the fp32 tests that compare with the torch reference for equality hold with them. The
argument checks it shares with layer_ops.cpp: test_native_layer_ops_twins.py."""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
import phaseserve.kernels.native as native
from phaseserve.kernels import cpu_isa
from phaseserve.kernels import reference as ref
from phaseserve.kernels.dispatch.choices import implementation, torch_vector_floats
from phaseserve.kernels.dispatch.layer_ops import LAYER_OPS, LayerOps, native_layer_ops
from model_factory import make_model
from native_ops import load_or_skip, torch_threads
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner

TOKENS = [1, 3, 16, 130]


@pytest.fixture(scope="module")
def ops():
    return load_or_skip("layer_ops_f32")


def _silu(ops, x):
    return ops.silu_and_mul(x, torch_vector_floats())


def _norm_case(g, tokens, hidden, scale=3.0):
    x = torch.randn(tokens, hidden, generator=g) * scale
    return x, torch.randn(tokens, hidden, generator=g), torch.randn(hidden, generator=g) * 0.2 + 1


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("hidden", [64, 576, 2048, 8192, 100, 5])  # 8192: torch's cascade sum levels; tails
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_equals_reference_bit_for_bit(ops, hidden, tokens):
    g = torch.Generator().manual_seed(hidden * 1000 + tokens)
    x, residual, weight = _norm_case(g, tokens, hidden)
    out, h = ops.add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_h = ref.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == torch.float32 and torch.equal(out, expected) and torch.equal(h, expected_h)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)[0])


@pytest.mark.parametrize("hidden", [576, 1024, 100])
def test_rms_norm_sums_in_torchs_order(ops, hidden):
    """Another summation order moves the statistic by an ulp now and then: thousands of rows with outlier
    channels make it show."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(4096, hidden, generator=g) * torch.rand(4096, 1, generator=g) * 4
    x[:, :: max(1, hidden // 7)] *= 30
    residual, weight = torch.randn(4096, hidden, generator=g), torch.randn(hidden, generator=g) * 0.2 + 1
    assert torch.equal(ops.add_rms_norm(x, residual, weight, 1e-5)[0], ref.rms_norm(x, weight, 1e-5, residual)[0])
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)[0])


def test_rms_norm_wide_ranges_zero_rows_and_leading_dims(ops):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 576, generator=g) * torch.tensor([1e-20, 1e-3, 1.0, 1e3, 1e18, 0.0])[:, None]
    weight = torch.randn(576, generator=g)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)[0])
    assert torch.equal(ops.add_rms_norm(x, -x, weight, 1e-6)[0], ref.rms_norm(x, weight, 1e-6, -x)[0])
    x3, r3 = x.view(2, 3, 576), torch.randn(2, 3, 576, generator=g)
    out, h = ops.add_rms_norm(x3, r3, weight, 1e-5)
    assert out.shape == h.shape == (2, 3, 576)
    assert torch.equal(out, ref.rms_norm(x3, weight, 1e-5, r3)[0]) and torch.equal(h, x3 + r3)


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("inter", [64, 576, 1536, 2816, 100, 40, 17, 5])  # tails past torch's vector steps
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_equals_reference_bit_for_bit(ops, inter, tokens):
    g = torch.Generator().manual_seed(inter * 1000 + tokens)
    x = torch.randn(tokens, 2 * inter, generator=g) * 6
    out = _silu(ops, x)
    assert out.shape == (tokens, inter) and torch.equal(out, ref.silu_and_mul(x))


def test_silu_over_a_million_gates_and_the_extremes(ops):
    """Gates over the whole range exp reaches (overflow, underflow, +-0, +-inf), in the vector steps and in
    the tail; NaN stays NaN."""
    g = torch.Generator().manual_seed(1)
    gates = torch.cat((torch.randn(1 << 20, generator=g) * 30, torch.linspace(-120, 120, 4001),
                       torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 88.7, -88.7, 103.9, -103.9, 1e-40])))
    for width in (1024, 1000):  # all in whole steps; and a tail of 8 every row
        rows = gates[: gates.numel() // width * width].view(-1, width)
        x = torch.cat((rows, torch.randn(rows.shape, generator=g)), dim=1)
        assert torch.equal(_silu(ops, x), ref.silu_and_mul(x))
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    assert _silu(ops, x)[0, 0].isnan() and torch.equal(_silu(ops, x)[0, 1:], ref.silu_and_mul(x)[0, 1:])


# --------------------------------------------------------------------------- rotary + KV write


def _cos_sin(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotary_case(g, tokens, hq, hkv, d, rotary_dim=None, nb=40, bs=16):
    """q, k, v as views of one qkv GEMM output (as the model passes them), scattered slots with some -1."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 2
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    if tokens > 1:
        slots[torch.randperm(tokens, generator=g)[: max(1, tokens // 5)]] = -1
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    return qkv, q, k, v, positions, _cos_sin(4096, rotary_dim or d), k_cache, v_cache, slots


def _check_rotary(ops, q, k, v, positions, cos_sin, k_cache, v_cache, slots):
    eq, ek = ref.rotary_embedding(positions, q, k, cos_sin)
    ekc, evc = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(ek, v, ekc, evc, slots)
    v_before = v.clone()
    assert ops.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots) is True
    assert torch.equal(q, eq) and torch.equal(k, ek) and torch.equal(v, v_before)  # q, k rotated in place
    assert torch.equal(k_cache, ekc) and torch.equal(v_cache, evc)


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, None), (64, None), (128, None), (64, 32), (80, 80), (96, 48),
                                                 (20, 20)])
@pytest.mark.parametrize("hq,hkv", [(8, 4), (9, 3), (16, 1)])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rotary_and_write_kv_equals_reference_bit_for_bit(ops, head_dim, rotary_dim, hq, hkv, tokens):
    g = torch.Generator().manual_seed(head_dim * 10000 + hq * 100 + hkv * 10 + tokens)
    _, *case = _rotary_case(g, tokens, hq, hkv, head_dim, rotary_dim)
    _check_rotary(ops, *case)


def test_rotary_takes_int32_indices_and_declines_what_it_does_not_take(ops):
    g = torch.Generator().manual_seed(10)
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 9, 8, 2, 64)
    before = [t.clone() for t in (qkv, k_cache, v_cache)]
    declined = [
        (positions.int(), q, k, v, cos_sin, k_cache, v_cache, slots),  # index dtypes differ
        (positions, q.bfloat16(), k, v, cos_sin, k_cache, v_cache, slots),
        (positions, q, k, v, cos_sin, k_cache.bfloat16(), v_cache, slots),
        (positions, q.transpose(1, 2), k, v, cos_sin, k_cache, v_cache, slots),  # head_dim not dense
    ]
    for args in declined:
        assert ops.rotary_and_write_kv(*args) is False
    assert all(torch.equal(a, b) for a, b in zip((qkv, k_cache, v_cache), before))
    eq, ek = ref.rotary_embedding(positions, q, k, cos_sin)
    expected = [k_cache.clone(), v_cache.clone()]
    ref.write_kv_cache(ek, v, *expected, slots)
    assert ops.rotary_and_write_kv(positions.int(), q, k, v, cos_sin, k_cache, v_cache, slots.int())
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


# --------------------------------------------------------------------------- argmax


@pytest.mark.parametrize("vocab", [1, 7, 8, 31, 32, 33, 1000, 32003, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_equals_torch(ops, vocab, rows):
    g = torch.Generator().manual_seed(vocab * 31 + rows)
    logits = (torch.randn(rows, vocab, generator=g) * 8).round()  # few distinct values: many ties
    got = ops.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, ref.argmax(logits))


def test_argmax_ties_infinities_zeros_and_nans(ops):
    """First index on ties wherever the maxima sit (lanes, accumulators, the tail), -0 == +0, all -inf,
    +inf, and NaN (the first NaN is torch's maximum), in the vector part and in the tail."""
    V = 1003  # 1000 in whole steps of 32, a tail of 3
    rows = []
    for positions in ([5, 40, 100], [1002], [64, 65], [0, 1002], [17, 81, 145, 209], [999, 1001]):
        r = torch.zeros(V)
        r[positions] = 3.0
        rows.append(r)
    rows.append(torch.full((V,), -float("inf")))
    signed = torch.full((V,), -1.0)
    signed[[300, 20]] = torch.tensor([0.0, -0.0])
    rows.append(signed)
    inf = torch.zeros(V)
    inf[[700, 7]] = float("inf")
    rows.append(inf)
    for nan_at in ([500], [980, 3], [1001]):
        r = torch.randn(V)
        r[10] = float("inf")
        r[nan_at] = float("nan")
        rows.append(r)
    logits = torch.stack(rows)
    expected = ref.argmax(logits)
    assert torch.equal(ops.argmax(logits), expected)
    assert expected.tolist() == [5, 1002, 64, 0, 17, 999, 0, 20, 7, 500, 3, 1001]  # the cases say what they are


# --------------------------------------------------------------------------- invariance


def test_a_row_alone_equals_the_row_in_a_batch_at_1_and_2torch_threads(ops):
    g = torch.Generator().manual_seed(21)
    x, residual, weight = _norm_case(g, 130, 2048)
    gate_up = torch.randn(130, 2 * 2816, generator=g) * 4
    logits = torch.randn(130, 4000, generator=g)
    results = {}
    for n in (1, 2):
        with torch_threads(n):
            results[n] = (*ops.add_rms_norm(x, residual, weight, 1e-5), ops.rms_norm(x, weight, 1e-5),
                          _silu(ops, gate_up), ops.argmax(logits))
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[2]))
    norm, h, plain, act, top = results[1]
    for i in (0, 57, 129):
        alone = ops.add_rms_norm(x[i:i + 1], residual[i:i + 1], weight, 1e-5)
        assert torch.equal(alone[0][0], norm[i]) and torch.equal(alone[1][0], h[i])
        assert torch.equal(ops.rms_norm(x[i:i + 1], weight, 1e-5)[0], plain[i])
        assert torch.equal(_silu(ops, gate_up[i:i + 1])[0], act[i])
        assert ops.argmax(logits[i:i + 1]).item() == top[i].item()


# --------------------------------------------------------------------------- dispatch


def test_float32_layer_ops_dispatch_natively_and_give_the_reference_bits(ops, monkeypatch, fresh_dispatch):
    """Where this process may run AVX2 code the fp32 layer ops run natively (fails if torch would run), and
    the dispatch's results equal the reference's."""
    g = torch.Generator().manual_seed(2)
    x, residual, weight = _norm_case(g, 5, 64)
    qkv, q, k, v, positions, cos_sin, k_cache, v_cache, slots = _rotary_case(g, 5, 4, 2, 64)
    expected = (ref.rms_norm(x, weight, 1e-5, residual), ref.silu_and_mul(x), ref.argmax(x),
                ref.rotary_and_write_kv(positions, q.clone(), k.clone(), v, cos_sin, ekc := k_cache.clone(),
                                        evc := v_cache.clone(), slots))

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch layer op ran")

    for name in ("rms_norm", "silu_and_mul", "rotary_and_write_kv", "argmax"):
        monkeypatch.setattr(ref, name, torch_path)
    norm, res = kernels.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(norm, expected[0][0]) and torch.equal(res, expected[0][1])
    assert torch.equal(kernels.silu_and_mul(x), expected[1]) and torch.equal(kernels.argmax(x), expected[2])
    qo, ko = kernels.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert qo is q and ko is k  # rotated in place
    assert torch.equal(qo, expected[3][0]) and torch.equal(ko, expected[3][1])
    assert torch.equal(k_cache, ekc) and torch.equal(v_cache, evc)
    assert implementation("layer_ops_f32") == "native avx2"


def test_below_avx2_float32_layer_ops_take_torch(monkeypatch, fresh_dispatch):
    monkeypatch.setenv(cpu_isa.ENV_CAP, "baseline")
    monkeypatch.setattr(native, "_loaded", {})
    assert native_layer_ops(torch.float32) is None
    g = torch.Generator().manual_seed(4)
    x, residual, weight = _norm_case(g, 3, 64)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, residual)[0], ref.rms_norm(x, weight, 1e-5, residual)[0])


def _logits(runner: ModelRunner, seqs: list[list[int]], schedule: list[list[int]]) -> torch.Tensor:
    """Every row's logits, teacher-forced: per sequence, the chunk sizes of successive packed steps."""
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


def test_fp32_model_logits_equal_with_native_and_torch_layer_ops(tmp_path, ops, fresh_dispatch):
    """An fp32 model's logits over prefill and decode steps are identical with the native layer ops and with
    torch's (the attention the same in both runs)."""
    path = make_model(tmp_path, "llama_gqa_llama3")
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 30)]
    schedule = [[33, 1, 1, 1, 1, 1, 1, 1], [7, 7, 16]]
    got = {}
    for impl in ("native", "torch"):
        fresh_dispatch.pin(LAYER_OPS, torch.float32, LayerOps(ops, torch.float32) if impl == "native" else None)
        got[impl] = _logits(ModelRunner(path, dtype="float32", num_blocks=64), seqs, schedule)
    assert got["native"].shape[0] == 40 + 30
    assert torch.equal(got["native"], got["torch"])
