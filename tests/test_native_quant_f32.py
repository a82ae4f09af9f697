"""kernels/native/quant_gemm_f32.cpp: the quantized matmul for float32 activations on AVX2 + FMA, against the torch
reference (kernels/reference.py: dequantize, then F.linear) and the exact product; each row's result bit-identical
whatever the other rows of the call and the thread count; and the dispatch that sends a float32 model's quantized
linears to it on an AVX2 process. What it shares with quant_gemm_i8.cpp is tested in test_native_quant_avx2_twins.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phaseserve.kernels import native_quant_f32, reference
from phaseserve.kernels.quant import QuantizedWeight, from_gguf, quantize
from native_ops import load_or_skip

ROOT = Path(__file__).resolve().parent.parent
# every row-count regime: the register tiles (1, 2, 4 rows + remainders), the unpacked-chunk path, its
# 6-row tiles and their remainders, and the bf16 op's old switch at 96
SWEEP = (1, 2, 3, 7, 16, 95, 96, 97, 128, 300)


@pytest.fixture(scope="module")
def ops():
    return load_or_skip("quant_gemm_f32")


def weight(out_f, in_f, seed=0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


def gguf_weight(ggml_type: str, out_f: int, in_f: int, seed=0) -> QuantizedWeight:
    """A weight as a GGUF file stores it (gguf-py's own quantizer), split into our format byte for byte."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    raw = gguf_quantize(weight(out_f, in_f, seed).numpy(), GGMLQuantizationType[ggml_type])
    return from_gguf(ggml_type, torch.from_numpy(raw), (out_f, in_f))


def rows(t: int, in_f: int, seed=1) -> torch.Tensor:
    return torch.randn(t, in_f, generator=torch.Generator().manual_seed(seed))


def native(ops, x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    p = native_quant_f32.pack(qw)
    return ops.quant_linear(x.contiguous() if x.stride(-1) != 1 else x, p.data, p.bits, p.shape[0])


def assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight) -> None:
    exact = x.double() @ qw.dequantize(torch.float64).T
    scale = exact.abs().max()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    # fp32 accumulation over K: a few units of fp32 rounding of the largest output
    assert (got.double() - exact).abs().max() <= 2 ** -19 * scale
    assert (got - reference.quant_linear(x, qw)).abs().max() <= 2 ** -18 * scale


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_at_load_matches_reference(ops, kind):
    qw = quantize(weight(96, 256), kind)
    x = rows(9, 256)
    assert_close_to_reference(native(ops, x, qw), x, qw)


# ---------------------------------------------------------------------- dispatch in a float32 model

DISPATCH = """
import json, sys
import torch
from phaseserve import kernels
from phaseserve.kernels import native
from phaseserve.kernels.native_quant_f32 import PackedQuantF32Weight
from phaseserve.workers.runner import ModelRunner
sys.path.insert(0, "tests")
from test_model_logits import run_schedule

folder, seq = sys.argv[1], json.loads(sys.argv[2])
# quantization auto; the activations as they are (auto's int8 at this level: tests/test_native_quant_i8.py)
kept = ModelRunner(folder, dtype="float32", num_blocks=64, activation_quant="none")
m = kept.model
linears = [m.lm_head] + [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
dense = ModelRunner(folder, dtype="float32", num_blocks=64, quantization="none")
got = run_schedule(kept, [seq], [[17, 1, 1, 1]])[0]
ref = run_schedule(dense, [seq], [[17, 1, 1, 1]])[0]
print(json.dumps({
    "kinds": sorted({getattr(lin, "kind", "dense") for lin in linears}),
    "packed_f32": all(isinstance(lin.weight, PackedQuantF32Weight) for lin in linears),
    "kernel": kernels.native_quant_kernel(torch.float32),
    "bf16_op_loaded": native.load("quant_gemm") is not None,
    "max_diff": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
}))
"""


def test_float32_model_on_an_avx2_process_runs_the_op(tmp_path):
    """A GGUF (Q4_1 linears, Q8_0 tied embedding) served in float32 by a process capped to AVX2, float32
    activations as they are (--activation-quant none): `auto` keeps every linear quantized in the f32 op's layout (the lm_head int8), the bf16 op is not even loaded, the
    log names the kernel, and the logits are those of the same weights dequantized to float32 (`none`)."""
    load_or_skip("quant_gemm_f32")
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
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kinds"] == ["int4", "int8"] and result["packed_f32"]
    assert result["kernel"] == "native avx2" and not result["bf16_op_loaded"]
    assert "matmul='native avx2'" in proc.stdout + proc.stderr
    assert result["max_diff"] <= 1e-4 * result["scale"]


# ---------------------------------------------------------------------- bf16-stored weights, float32 activations


def bf16_weight(out_f, in_f, seed=0) -> torch.Tensor:
    return weight(out_f, in_f, seed).bfloat16().float()  # a bf16 checkpoint's weight, served in float32


@pytest.mark.parametrize("shape", [(64, 128), (13, 96), (77, 160)])
def test_bf16_weight_linear_matches_float32(ops, shape):
    w = bf16_weight(*shape)
    x = rows(33, shape[1])
    p = native_quant_f32.pack_bf16(w)
    assert p.nbytes() == -(-shape[0] // 8) * 8 * shape[1] * 2  # bf16: half of float32
    got = ops.bf16_linear(x, p.data, shape[0])
    exact = x.double() @ w.double().T
    assert (got.double() - exact).abs().max() <= 2 ** -19 * exact.abs().max()


def test_bf16_weight_rows_bit_identical_whatever_the_batch_and_threads(ops):
    w = bf16_weight(200, 192)
    p = native_quant_f32.pack_bf16(w)
    x = rows(max(SWEEP), 192, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ops.bf16_linear(x[i:i + 1], p.data, 200) for i in range(x.shape[0])])
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for t in SWEEP:
                assert torch.equal(ops.bf16_linear(x[:t], p.data, 200), alone[:t]), f"{t} rows, {n_threads} threads"
    finally:
        torch.set_num_threads(threads)


BF16_CHECKPOINT = """
import json, os, sys
import torch
from phaseserve.workers.runner import ModelRunner
sys.path.insert(0, "tests")
from test_model_logits import run_schedule

folder, seq = sys.argv[1], json.loads(sys.argv[2])
native = ModelRunner(folder, dtype="float32", num_blocks=64)
layers = native.model.layers
os.environ["PHASESERVE_CPU_ISA"] = "auto"  # this CPU's own level: float32 linears take oneDNN
onednn = ModelRunner(folder, dtype="float32", num_blocks=64)
got = run_schedule(native, [seq], [[17, 1, 1, 1]])[0]
ref = run_schedule(onednn, [seq], [[17, 1, 1, 1]])[0]
print(json.dumps({
    "native": [lin.native_f32 is not None for lin in (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down)],
    "onednn": onednn.model.layers[0].qkv.native_f32 is None,
    "max_diff": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
}))
"""


def test_bf16_checkpoint_in_float32_on_an_avx2_process_keeps_bf16_weights(tmp_path):
    """A bf16 checkpoint served in float32 by an AVX2 process: every linear whose input dim is a multiple of 32
    keeps its weight as bf16 for the native op, with the logits of the float32 oneDNN path."""
    load_or_skip("quant_gemm_f32")
    from model_factory import make_model

    folder = make_model(tmp_path, "llama", dtype="bfloat16")
    seq = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    env = {**os.environ, "PHASESERVE_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", BF16_CHECKPOINT, str(folder), json.dumps(seq)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    config = json.loads((folder / "config.json").read_text())
    dims = [config["hidden_size"]] * 3 + [config["intermediate_size"]]  # inputs of qkv, o, gate_up, down
    assert result["native"] == [d % 32 == 0 for d in dims] and any(result["native"])
    assert result["onednn"]
    assert result["max_diff"] <= 1e-4 * result["scale"]
