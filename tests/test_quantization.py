"""Weight-only quantization: the block-32 int8/int4 format (kernels/quant.py), GGUF Q8_0/Q4_0/Q4_1
mapped without a round trip, quant_linear (native AVX512-BF16 op, the float32 AVX2 op's dispatch (its own
tests: tests/test_native_quant_f32.py), Triton under the interpreter) against
the torch reference, --quantization choosing each linear's form, and whole models that run quantized.

TRITON_INTERPRET is set before anything imports triton (as tests/test_triton_kernels.py explains)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from phaseserve import kernels  # noqa: E402
from phaseserve.kernels import cpu_isa, reference  # noqa: E402
from phaseserve.kernels.native_quant import PackedQuantWeight  # noqa: E402
from phaseserve.kernels.native_quant_f32 import PackedQuantF32Weight  # noqa: E402
from phaseserve.kernels.quant import BLOCK, QuantizationError, QuantizedWeight, from_gguf, quantize  # noqa: E402
from model_factory import make_model  # noqa: E402
from native_ops import cpu_has_avx512_bf16, load_or_skip  # noqa: E402
from test_model_logits import run_schedule  # noqa: E402
from phaseserve.workers.linear import Linear, QuantizedLinear  # noqa: E402
from phaseserve.workers.loader import load_checkpoint  # noqa: E402
from phaseserve.workers.quantization import Quantization  # noqa: E402
from phaseserve.workers.runner import ModelRunner  # noqa: E402

ROWS = (1, 5, 16, 33, 100)
GGUF_KINDS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


@dataclass
class GGUFBlocks:
    """A GGUF block-quantized weight as workers/gguf_weights.QuantizedTensor hands it over
    (same fields), built from real gguf-py quantization."""

    ggml_type: str
    raw: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self, dtype) -> torch.Tensor:
        values = gguf_dequantize(self.raw.numpy(), GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(values).reshape(self.shape).to(dtype)


def gguf_blocks(w: torch.Tensor, ggml_type: str) -> GGUFBlocks:
    raw = gguf_quantize(w.float().numpy(), GGMLQuantizationType[ggml_type])
    return GGUFBlocks(ggml_type, torch.from_numpy(raw), tuple(w.shape))


def weight(out_f=80, in_f=96, seed=0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---------------------------------------------------------------------- the format


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_round_trip_within_half_a_step(kind):
    w = weight(64, 256)
    qw = quantize(w, kind)
    blocks = w.view(64, -1, BLOCK)
    err = (qw.dequantize().view(64, -1, BLOCK) - blocks).abs().amax(-1)
    # half a quantization step (d) per block, plus fp16 rounding of d / m (a few 1e-3 of a step)
    assert (err <= 0.51 * qw.scales.float()).all()
    # and the step is what the kind promises: absmax / 127 (int8), range / 15 (int4)
    span = blocks.abs().amax(-1) / 127 if kind == "int8" else (blocks.amax(-1) - blocks.amin(-1)) / 15
    torch.testing.assert_close(qw.scales.float(), span, rtol=1e-3, atol=0)
    assert qw.nbytes() < w.numel() * (1.2 if kind == "int8" else 0.7)


def test_quantize_rejects_bad_shapes():
    with pytest.raises(QuantizationError, match="multiple of 32"):
        quantize(torch.randn(16, 40), "int4")
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantize(torch.randn(16, 64), "int3")
    with pytest.raises(QuantizationError, match="no int8/int4 mapping"):
        from_gguf("Q6_K", torch.zeros(16, 210, dtype=torch.uint8), (16, 256))


@pytest.mark.parametrize("ggml_type", list(GGUF_KINDS))
def test_gguf_blocks_map_exactly(ggml_type):
    """Split byte for byte: dequantizing our form gives gguf-py's values exactly."""
    g = gguf_blocks(weight(48, 128), ggml_type)
    qw = from_gguf(g.ggml_type, g.raw, g.shape)
    assert qw.kind == GGUF_KINDS[ggml_type]
    assert torch.equal(qw.dequantize(torch.float32), g.dequantize(torch.float32))
    with pytest.raises(QuantizationError, match="needs raw uint8"):
        from_gguf(ggml_type, g.raw[:, :-1], g.shape)


# ---------------------------------------------------------------------- quant_linear


def exact_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return x.double() @ qw.dequantize(torch.float64).T


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", ROWS)
def test_quant_linear_matches_reference(kind, rows):
    """The dispatched op (native here) against the torch reference (dequantize, then F.linear) and
    the exact product: both within bf16 rounding of the output."""
    qw = quantize(weight(80, 96, seed=rows), kind)  # 80 outputs: 5 groups of 16 (a partial 4-group tile)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = kernels.pack_quantized(qw, torch.bfloat16)
    got = kernels.quant_linear(x, packed).double()
    ref = reference.quant_linear(x, qw).double()
    exact = exact_linear(x, qw)
    scale = exact.abs().max()
    assert got.shape == (rows, 80)
    assert (got - exact).abs().max() <= 2 ** -7 * scale  # output rounding (2^-9) + accumulation
    assert (got - ref).abs().max() <= 2 ** -6 * scale  # the reference also rounds the weights to bf16


@pytest.mark.parametrize("dots", [0, 1], ids=["bf16-dots", "fp32-dots"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_native_quant_linear_either_dots_is_exact_to_rounding(kind, dots):
    """Both arithmetics of the native op (the one this CPU does not run included), at decode and prefill
    row counts, within bf16 rounding of the exact product."""
    ops = load_or_skip("quant_gemm")
    qw = quantize(weight(80, 96, seed=dots), kind)
    packed = kernels.pack_quantized(qw, torch.bfloat16)
    x = torch.randn(100, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    for rows in (1, 3, 16, 100):
        got = ops.quant_linear(x[:rows], packed.data, packed.bits, dots).double()
        exact = exact_linear(x[:rows], qw)
        assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max()


def test_quant_linear_reads_strided_rows():
    qw = quantize(weight(32, 64), "int4")
    big = torch.randn(7, 128).bfloat16()
    x = big[:, 32:96]  # rows 128 apart, not contiguous
    got = kernels.quant_linear(x, kernels.pack_quantized(qw, torch.bfloat16)).double()
    assert (got - exact_linear(x, qw)).abs().max() <= 2 ** -7 * exact_linear(x, qw).abs().max()


def test_native_op_runs_on_this_cpu():
    """This CPU reports AVX512-BF16: the quantized matmul must be the native op, not a silent torch fallback."""
    load_or_skip("quant_gemm")  # skipped, saying why, below the op's CPU level
    assert kernels.native_quant_available(torch.bfloat16)
    packed = kernels.pack_quantized(quantize(weight(), "int4"), torch.bfloat16)
    assert isinstance(packed, PackedQuantWeight)
    assert isinstance(QuantizedLinear(quantize(weight(), "int8"), dtype=torch.bfloat16).weight, PackedQuantWeight)


def test_fp32_activations_take_the_avx2_op_where_it_runs():
    """float32 activations: the AVX2 op's layout where this CPU runs it (the avx2 level or above), else the
    QuantizedWeight and the torch reference; the same product either way."""
    qw = quantize(weight(), "int8")
    packed = kernels.pack_quantized(qw, torch.float32)
    assert isinstance(packed, PackedQuantF32Weight) == cpu_isa.supports("avx2")
    assert kernels.native_quant_available(torch.float32) == cpu_isa.supports("avx2")
    assert kernels.native_quant_available(torch.float16) is False
    x = torch.randn(3, 96)
    torch.testing.assert_close(kernels.quant_linear(x, packed), x @ qw.dequantize().T)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_triton_quant_linear_interpreted(kind):
    from phaseserve.kernels import triton_ops

    qw = quantize(weight(80, 64), kind)  # 80 outputs: a masked second column tile of 64
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))  # fp32: exact in the interpreter
    torch.testing.assert_close(triton_ops.quant_linear(x, qw), reference.quant_linear(x, qw), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- --quantization


def kernel_dtype() -> torch.dtype:
    """The activations' dtype a native quantized matmul runs for on this process (bf16 on AVX512-BF16, else
    float32 on AVX2): where `auto` keeps GGUF blocks."""
    return torch.bfloat16 if cpu_has_avx512_bf16() else torch.float32


@pytest.mark.skipif(not cpu_isa.supports("avx2"), reason="no native quantized matmul below AVX2")
def test_modes_choose_each_weights_form():
    dense = weight().bfloat16()
    q4_1 = gguf_blocks(weight(), "Q4_1")
    q8_0 = gguf_blocks(weight(), "Q8_0")
    auto = Quantization("auto", kernel_dtype(), torch.device("cpu"))
    assert isinstance(auto.linear([dense]), Linear)  # a float checkpoint is served as trained
    kept = auto.linear([q4_1])
    assert isinstance(kept, QuantizedLinear) and kept.kind == "int4"
    # bf16 without AVX512-BF16: no fast kernel reads the blocks, so auto dequantizes them
    bf16_auto = Quantization("auto", torch.bfloat16, torch.device("cpu")).linear([q4_1])
    assert isinstance(bf16_auto, QuantizedLinear) == cpu_has_avx512_bf16()
    assert isinstance(Quantization("none", torch.bfloat16, torch.device("cpu")).linear([q4_1]), Linear)
    int8 = Quantization("int8", torch.bfloat16, torch.device("cpu"))
    assert int8.linear([dense]).kind == "int8"
    assert int8.linear([q4_1]).kind == "int8"  # requantized: the user asked for int8
    assert isinstance(int8.linear([torch.randn(32, 40).bfloat16()]), Linear)  # 40 inputs: no 32-blocks
    fused = auto.linear([q4_1, q8_0])  # mixed GGUF types in one fused linear: dense
    assert isinstance(fused, Linear) and fused.out_features == 160
    with pytest.raises(QuantizationError, match="unknown quantization"):
        Quantization("fp8", torch.bfloat16, torch.device("cpu"))


def test_kept_gguf_weight_multiplies_as_stored():
    """auto keeps Q4_1 blocks as stored: the linear equals gguf-py's dequantized weight times x."""
    g = gguf_blocks(weight(96, 128), "Q4_1")
    lin = Quantization("auto", torch.bfloat16, torch.device("cpu")).linear([g])
    x = torch.randn(4, 128).bfloat16()
    exact = x.double() @ g.dequantize(torch.float64).T
    assert (lin(x).double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()


# ---------------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("models"), "llama_gqa_llama3")


SEQ = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
SCHEDULE = [[33, 1, 1, 1, 1, 1, 1, 1]]  # a prefill then decodes


def fake_quantized_runner(path, kind: str) -> ModelRunner:
    """The unquantized model with every linear replaced by its dequantized int8/int4 weight in bf16:
    the numbers a quantized model computes with, multiplied by the plain bf16 path."""
    runner = ModelRunner(path, dtype="bfloat16", num_blocks=64, quantization="none")
    _, w, _ = load_checkpoint(path, "bfloat16")

    def fake(*names):
        return Linear(torch.cat([quantize(w[n], kind).dequantize(torch.bfloat16) for n in names]))

    for i, layer in enumerate(runner.model.layers):
        p = f"model.layers.{i}."
        layer.qkv = fake(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
        layer.o = fake(p + "self_attn.o_proj.weight")
        layer.gate_up = fake(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        layer.down = fake(p + "mlp.down_proj.weight")
    runner.model.lm_head = fake("lm_head.weight")
    return runner


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_logits(model_path, kind):
    """A quantized model computes what its quantized numbers say (within bf16 noise of the same
    numbers run through the bf16 path) and stays near the unquantized model: int8 within 5% of the
    largest logit, int4 (random weights quantize badly: 16 levels for a Gaussian) within 50%, with
    most greedy tokens unchanged."""
    runner = ModelRunner(model_path, dtype="bfloat16", num_blocks=64, quantization=kind)
    assert isinstance(runner.model.layers[0].gate_up, QuantizedLinear)
    assert isinstance(runner.model.lm_head, QuantizedLinear)
    got = run_schedule(runner, [SEQ], SCHEDULE)[0]
    same_numbers = run_schedule(fake_quantized_runner(model_path, kind), [SEQ], SCHEDULE)[0]
    plain = run_schedule(ModelRunner(model_path, dtype="bfloat16", num_blocks=64, quantization="none"),
                         [SEQ], SCHEDULE)[0]
    scale = plain.abs().max()
    assert (got - same_numbers).abs().max() <= 0.03 * scale
    assert (got - plain).abs().max() <= (0.05 if kind == "int8" else 0.5) * scale
    agree = (got.argmax(-1) == plain.argmax(-1)).float().mean().item()
    assert agree >= (0.95 if kind == "int8" else 0.6)


def test_quantized_model_generates(model_path):
    """Greedy generation through the runner (prefill chunks, decodes, sampling, KV cache) with int4
    weights: every step's token is the argmax the fake-quantized bf16 model gives the same prefix
    (teacher-forced), or within its bf16 noise of it."""
    from runner_driver import run
    from phaseserve.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runner = ModelRunner(model_path, dtype="bfloat16", num_blocks=64, quantization="int4")
    out = run(runner, [SEQ[:20]], params, chunk_size=8)[0].outputs
    assert len(out) == 12 and all(0 <= t < 320 for t in out)
    seq = SEQ[:20] + out
    logits = run_schedule(fake_quantized_runner(model_path, "int4"), [seq[:-1]], [[len(seq) - 1]])[0][19:]
    chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert ((logits.max(-1).values - chosen) <= 0.03 * logits.abs().max()).all()


def test_quantization_setting(monkeypatch):
    from phaseserve import settings

    assert settings.parse("worker", ["--redis-url", "redis://x"]).quantization == "auto"
    assert settings.parse("up", ["--quantization", "int4"]).quantization == "int4"
    monkeypatch.setenv("PHASESERVE_QUANTIZATION", "int8")
    assert settings.parse("worker", []).quantization == "int8"
    with pytest.raises(SystemExit):
        settings.parse("worker", ["--quantization", "int3"])


@pytest.mark.skipif(not cpu_isa.supports("avx2"), reason="no native quantized matmul below AVX2")
def test_gguf_model_keeps_its_blocks(tmp_path):
    """A GGUF with Q4_1 linears and a Q8_0 (tied) embedding, served with --quantization auto in the dtype a
    native kernel runs for here (bf16 on AVX512-BF16, float32 on AVX2): the linears stay int4, the lm_head
    and the lookup table int8, straight from the file's blocks, and the logits are those of the same
    weights dequantized to that dtype (`none`)."""
    dtype = str(kernel_dtype()).removeprefix("torch.")
    from gguf_factory import write_gguf
    from phaseserve.models.gguf_files import write_model_folder

    path = write_gguf(tmp_path / "q.gguf", make_model(tmp_path, "tied"),
                      types=lambda name: "Q8_0" if name.startswith("token_embd") else "Q4_1")
    folder = write_model_folder(path, tmp_path / "q-folder")
    # auto weights; float32 activations as they are (the avx2 level's `auto` quantizes them to int8: that op's
    # own test is tests/test_native_quant_i8.py), so the logits are the dequantized weights' up to sum order
    kept = ModelRunner(folder, dtype=dtype, num_blocks=64, activation_quant="none")
    m = kept.model
    assert {layer.gate_up.kind for layer in m.layers} == {"int4"} and m.layers[0].qkv.kind == "int4"
    assert m.lm_head.kind == "int8" and isinstance(m.embed, QuantizedWeight) and m.embed.kind == "int8"
    dense = ModelRunner(folder, dtype=dtype, num_blocks=64, quantization="none")
    assert isinstance(dense.model.layers[0].gate_up, Linear)
    got = run_schedule(kept, [SEQ], SCHEDULE)[0]
    ref = run_schedule(dense, [SEQ], SCHEDULE)[0]
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()
