"""kernels/native/decode_layer_f32.cpp: a decode step's decoder layer in one native call (float32 activations,
weights packed for int8 activations) gives the bits of the layer's ops run one by one (DecoderLayer.forward:
add_rms_norm, quant_linear, rotary_and_write_kv, paged_attention, silu_and_mul), outputs and KV cache, with and
without a residual, one to several sequences at contexts over one and two attention partitions, on 1 and 2
threads; a model's decode steps take it, mixed steps do not, and both give the same logits. At every CPU level
this host runs (the AVX2 ops serve float32 at either)."""

from __future__ import annotations

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import cpu_isa, reference
from model_factory import make_model
from native_ops import load_or_skip, torch_threads
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.model import AttentionGroup, StepInputs
from phaseserve.workers.runner import ModelRunner

# head_dim 32, 2 query heads per KV head; intermediate 160: five 32-wide blocks into the down projection
MODEL = dict(hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)
LEVELS = ("avx512-bf16", "avx2")


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch, fresh_dispatch):
    if not cpu_isa.supports(request.param):
        pytest.skip(f"the {request.param} level: this process runs {cpu_isa.level()}")
    monkeypatch.setenv(cpu_isa.ENV_CAP, request.param)
    load_or_skip("decode_layer_f32")
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("decode_layer"), "llama_gqa_llama3", dtype="float32", **MODEL)


def make_runner(model_dir, quantization: str) -> ModelRunner:
    return ModelRunner(model_dir, dtype="float32", num_blocks=256, quantization=quantization, activation_quant="int8")


def decode_inputs(lengths: list[int], bs: int, seed: int) -> StepInputs:
    """One decode per sequence at these context lengths (this step's token included), each on blocks of its
    own in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lengths) // bs)
    order = torch.randperm(per_seq * len(lengths), generator=g)
    tables = order.view(len(lengths), per_seq).to(torch.int32)
    pos = torch.tensor(lengths) - 1
    slots = tables[torch.arange(len(lengths)), pos // bs].long() * bs + pos % bs
    group = AttentionGroup(0, len(lengths), tables, torch.tensor(lengths, dtype=torch.int32),
                           torch.arange(len(lengths) + 1, dtype=torch.int32), 1)
    return StepInputs(torch.zeros(len(lengths), dtype=torch.int64), pos, slots, [group],
                      torch.arange(len(lengths)))


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("lengths", [[1], [37], [600, 5, 130], [512, 513, 1, 64, 300, 90, 17]])
def test_one_call_is_the_ops_one_by_one(level, model_dir, kind, lengths):
    runner = make_runner(model_dir, kind)
    m = runner.model
    layer = m.layers[1]
    assert layer.takes_decode_layer()
    inp = decode_inputs(lengths, runner.block_size, seed=len(lengths))
    g = torch.Generator().manual_seed(3)
    k0 = torch.randn(runner.kv.k[1].shape, generator=g)
    v0 = torch.randn(runner.kv.v[1].shape, generator=g)
    h = torch.randn(len(lengths), MODEL["hidden_size"], generator=g) * 4
    residual = torch.randn(len(lengths), MODEL["hidden_size"], generator=g)
    for threads in (1, 2):
        for res in (None, residual):
            with torch_threads(threads):
                k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
                want = layer.forward(h, res, inp, m.cos_sin_cache, k1, v1)
                got = layer.decode(h, res, inp, m.cos_sin_cache, k2, v2)
            for w, o in zip(want, got):
                assert o.dtype == torch.float32 and torch.equal(o, w), (threads, res is None)
            assert torch.equal(k2, k1) and torch.equal(v2, v1)
            assert not torch.equal(k2, k0)  # the step's keys were written
    # the comparison sees one rounding: the same layer with the norms rounded otherwise (summed in float64)
    # gives other bits
    def norm_in_float64(x, w, eps, r=None):
        out, h = reference.rms_norm(x.double(), w.double(), eps, None if r is None else r.double())
        return out.float(), None if h is None else h.float()

    saved = kernels.rms_norm
    kernels.rms_norm = norm_in_float64
    try:
        other = layer.forward(h, residual, inp, m.cos_sin_cache, k0.clone(), v0.clone())
    finally:
        kernels.rms_norm = saved
    assert not torch.equal(other[0], got[0])


def test_decode_steps_take_it_with_the_same_logits(level, model_dir, monkeypatch):
    """A runner's decode steps run every layer in one call (kernels.DecodeLayers: decode_layer per layer), its
    mixed steps one op at a time; a decode step's logits are the same either way."""
    runner = make_runner(model_dir, "int4")
    m = runner.model
    calls = []
    real = kernels.DecodeLayers.__call__
    monkeypatch.setattr(kernels.DecodeLayers, "__call__", lambda *a: calls.append(1) or real(*a))
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    table = list(range(8))
    prompt = list(range(3, 103))
    # a prefill beside another sequence's decode: a mixed step, one op at a time
    runner.execute(StepPlan(0, "w", [SeqStart("a", "g", prompt, greedy)], [ScheduledChunk("a", 0, 100, table)]))
    runner.execute(StepPlan(1, "w", [SeqStart("b", "g", prompt[:40], greedy)],
                            [ScheduledChunk("a", 100, 1, table), ScheduledChunk("b", 0, 40, list(range(8, 16)))]))
    assert calls == []
    decodes = [ScheduledChunk("a", 101, 1, table), ScheduledChunk("b", 40, 1, list(range(8, 16)))]
    runner.execute(StepPlan(2, "w", [], decodes))
    assert len(calls) == 1  # every layer in one call
    inp, _ = runner.packer.pack([ScheduledChunk("a", 102, 1, table), ScheduledChunk("b", 41, 1, list(range(8, 16)))])
    for threads in (1, 2):
        with torch_threads(threads):
            one_call = m.forward(inp, runner.kv)
            monkeypatch.setattr(m, "_layer_in_one_call", False)
            one_by_one = m.forward(inp, runner.kv)
            monkeypatch.setattr(m, "_layer_in_one_call", True)
        assert torch.equal(one_call, one_by_one)
