"""kernels/native/quant_gemm_i8.cpp: the quantized matmul that quantizes float32 activations to int8 per 32-element
block and multiplies in integers (AVX2 + FMA), against the torch reference (kernels/reference.py: the same activation
bits, exact integer block products); each row's result bit-identical whatever the other rows of the call and the
thread count; and --activation-quant choosing it in a float32 model. What it shares with quant_gemm_f32.cpp is tested
in test_native_quant_avx2_twins.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import cpu_isa, native_quant_i8, reference
from phaseserve.kernels.native_quant_i8 import PackedQuantI8Weight
from phaseserve.kernels.quant import QuantizedWeight, quantize
from native_ops import load_or_skip
from test_native_quant_f32 import rows, weight
from phaseserve.workers.quantization import Quantization, resolve_activations

ROOT = Path(__file__).resolve().parent.parent
# row counts: each tile shape (4-row tiles, and 1, 2 or 3 rows left over) at small and large counts
SWEEP = (1, 2, 3, 4, 5, 6, 7, 16, 63, 64, 65, 97, 128, 255, 300)


@pytest.fixture(scope="module")
def ops():
    return load_or_skip("quant_gemm_i8")


def native(ops, x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    p = native_quant_i8.pack(qw)
    return ops.quant_linear(x, p.data, p.bits, p.shape[0])


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight) -> None:
    ref = reference.quant_linear_int8_activations(x, qw)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # the reference sums the exact block products in float64; the op folds them in fp32, block by block
    assert (got - ref).abs().max() <= 2 ** -19 * ref.abs().max()


def test_activation_quantization_is_the_reference_bit_for_bit(ops):
    """Scales, int8 values and block sums equal the torch reference's: random rows, a zero block (scale 0,
    values 0), a block of one repeated value, and values that land on .5 after scaling (ties to even)."""
    x = rows(9, 256, seed=5) * 3
    x[1, 32:64] = 0
    x[2, :32] = -0.75
    x[3, 64:96] = torch.arange(32) - 15.5  # a = 16: x * 127/16 hits many half-way points
    q, d, s = torch.empty(9, 256, dtype=torch.int8), torch.empty(9, 8), torch.empty(9, 8)
    ops.quantize_activations(x, q, d, s)
    rq, rd, rs = reference.quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    assert torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8)) and d[1, 1] == 0
    assert q.abs().max() == 127


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_close_to_the_float_product(ops, kind):
    """Quantizing the activations moves the result by about what 8-bit rounding of x does: well under 2% of the
    largest output here, while the op is not the float32 product either (it does quantize)."""
    qw = quantize(weight(96, 256), kind)
    x = rows(9, 256)
    got = native(ops, x, qw).double()
    exact = x.double() @ qw.dequantize(torch.float64).T
    err = (got - exact).abs().max() / exact.abs().max()
    assert 1e-6 < err < 0.02


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_extreme_values_do_not_saturate(ops, kind):
    """The largest integer products the formats allow (int4 q = 15, int8 q = -128 and 127, activations at
    +-127 with the same or opposite sign): vpmaddubsw's int16 pairs and the int4 block's int16 sums hold
    them exactly."""
    out_f, in_f = 16, 64
    ones = torch.ones(out_f, in_f // 32, dtype=torch.float16)
    if kind == "int4":
        qw = QuantizedWeight("int4", torch.full((out_f, in_f // 2), 0xFF, dtype=torch.uint8), ones, ones * 0)
    else:
        q = torch.full((out_f, in_f), 127, dtype=torch.int8)
        q[::2] = -128
        qw = QuantizedWeight("int8", q, ones, None)
    x = torch.ones(4, in_f)
    x[1] = -1
    x[2, ::2] = -1
    assert_matches_reference(native(ops, x, qw), x, qw)


def test_pack_quantized_keeps_the_float32_op_unless_asked():
    qw = quantize(weight(16, 64), "int4")
    assert not isinstance(kernels.pack_quantized(qw, torch.float32), PackedQuantI8Weight)
    assert not isinstance(kernels.pack_quantized(qw, torch.bfloat16, "int8"), PackedQuantI8Weight)
    with pytest.raises(ValueError, match="none or int8"):
        kernels.pack_quantized(qw, torch.float32, "int4")


# ---------------------------------------------------------------------- --activation-quant in a float32 model


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_auto_is_int8_at_the_avx2_level_only(monkeypatch, level):
    """`auto` means int8 where float32 activations are the default (the avx2 level) and the op loads; none at
    the avx512-bf16 level (bf16 is the default there; float32 asked for keeps its numbers) and below AVX2.
    Each level as PHASESERVE_CPU_ISA caps this CPU to it (a level above this CPU's own cannot be had)."""
    monkeypatch.setenv(cpu_isa.ENV_CAP, level)
    if cpu_isa.level() != level:
        pytest.skip(f"this CPU does not run the {level} level")
    cpu = torch.device("cpu")
    want = "int8" if level == "avx2" and kernels.int8_activations_available(torch.float32) else "none"
    assert resolve_activations("auto", cpu, torch.float32) == want
    assert Quantization("auto", torch.float32, cpu, "auto").activation_quant == want
    assert resolve_activations("auto", cpu, torch.bfloat16) == "none"
    assert resolve_activations("none", cpu, torch.float32) == "none"
    if level == "avx2":  # the op runs on every CPU at or above this level
        assert want == "int8"

DISPATCH = """
import json, sys
import torch
from phaseserve.kernels.native_quant_f32 import PackedQuantF32Weight
from phaseserve.kernels.native_quant_i8 import PackedQuantI8Weight
from phaseserve.workers.runner import ModelRunner
sys.path.insert(0, "tests")
from test_model_logits import run_schedule

folder, seq = sys.argv[1], json.loads(sys.argv[2])
out = {}
logits = {}
for mode in ("int8", "none", "auto"):
    r = ModelRunner(folder, dtype="float32", num_blocks=64, activation_quant=mode)
    m = r.model
    linears = [m.lm_head] + [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    logits[mode] = run_schedule(r, [seq], [[17, 1, 1, 1]])[0]
    out[mode] = {"i8": all(isinstance(lin.weight, PackedQuantI8Weight) for lin in linears),
                 "f32": all(isinstance(lin.weight, PackedQuantF32Weight) for lin in linears),
                 "kernels": r.warm_up()}  # what the worker's heartbeat carries (WorkerInfo.kernels, /health)
bf16 = ModelRunner(folder, dtype="bfloat16", num_blocks=64, activation_quant="int8")
out["bf16"] = bf16.model.activation_quant
ref = logits["none"]
out["diff_int8"] = (logits["int8"] - ref).abs().max().item()
out["auto_is_int8"] = torch.equal(logits["auto"], logits["int8"])
out["scale"] = ref.abs().max().item()
print(json.dumps(out))
"""


def test_activation_quant_setting_chooses_the_op_on_an_avx2_process(tmp_path):
    """A GGUF (Q4_1 linears, Q8_0 tied embedding) served in float32 by a process capped to AVX2: int8 packs
    every quantized linear for the int8-activation op and reports it in the kernels (what /health shows);
    none keeps the float32 op; auto is int8 at this level (docs/decisions.md), the same logits bit for bit;
    bf16 activations ignore int8. int8's logits are close to none's but not equal."""
    load_or_skip("quant_gemm_i8")
    from gguf_factory import write_gguf
    from model_factory import make_model
    from phaseserve.models.gguf_files import write_model_folder

    path = write_gguf(tmp_path / "q.gguf", make_model(tmp_path, "tied"),
                      types=lambda name: "Q8_0" if name.startswith("token_embd") else "Q4_1")
    folder = write_model_folder(path, tmp_path / "q-folder")
    seq = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    env = {**os.environ, "PHASESERVE_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", DISPATCH, str(folder), json.dumps(seq)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["int8"]["i8"] and r["int8"]["kernels"]["quant_linear"] == "native avx2, int8 activations"
    assert r["none"]["f32"] and r["none"]["kernels"]["quant_linear"] == "native avx2"
    assert r["auto"]["i8"] and r["auto"]["kernels"]["quant_linear"] == "native avx2, int8 activations"
    assert r["auto_is_int8"]
    assert r["bf16"] == "none"
    assert 0 < r["diff_int8"] <= 0.05 * r["scale"]
