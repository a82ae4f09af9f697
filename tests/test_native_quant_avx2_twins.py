"""What the two quantized matmuls for float32 activations on AVX2 + FMA share, tested once for each:
kernels/native/quant_gemm_f32.cpp (float32 products) and quant_gemm_i8.cpp (the activations quantized to
int8 in the op). Against each op's torch reference, GGUF blocks as stored, a padded last output group, strided
rows, the same argument checks (kernels/native/op_args.h), and each row's result bit-identical whatever the
other rows of the call and the thread count. What only one of them does is in test_native_quant_f32.py and
test_native_quant_i8.py."""

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import native_quant_f32, native_quant_i8
from phaseserve.kernels.quant import QuantizedWeight, quantize
from native_ops import load_or_skip, torch_threads
import test_native_quant_f32 as f32
import test_native_quant_i8 as i8
from test_native_quant_f32 import gguf_weight, rows, weight


@dataclass(frozen=True)
class Twin:
    op: str  # kernels/native/<op>.cpp
    packer: object  # the module that packs a QuantizedWeight for it
    activations: str  # pack_quantized's activations= that chooses it
    assert_reference: Callable  # (got, x, qw): the op's result against its torch reference
    sweep: tuple[int, ...]  # row counts that reach each of its tile shapes and their remainders


TWINS = [Twin("quant_gemm_f32", native_quant_f32, "none", f32.assert_close_to_reference, f32.SWEEP),
         Twin("quant_gemm_i8", native_quant_i8, "int8", i8.assert_matches_reference, i8.SWEEP)]


@pytest.fixture(params=TWINS, ids=[t.op for t in TWINS])
def twin(request):
    load_or_skip(request.param.op)
    return request.param


def native(twin: Twin, x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    p = twin.packer.pack(qw)
    return load_or_skip(twin.op).quant_linear(x, p.data, p.bits, p.shape[0])


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(64, 128), (13, 96), (77, 160), (200, 32)])
@pytest.mark.parametrize("t", [1, 2, 3, 5, 33])
def test_matches_reference(twin, ggml_type, shape, t):
    """GGUF blocks as stored, output counts not a multiple of the 8-output group or of a tile, input dims of
    1 to 5 blocks."""
    qw = gguf_weight(ggml_type, *shape, seed=t)
    x = rows(t, shape[1])
    twin.assert_reference(native(twin, x, qw), x, qw)


def test_reads_strided_rows_and_dispatch(twin):
    qw = quantize(weight(40, 64), "int4")
    x = rows(7, 128)[:, 32:96]  # rows 128 apart, not contiguous
    assert not x.is_contiguous()
    got = native(twin, x, qw)
    assert torch.equal(got, native(twin, x.contiguous(), qw))
    twin.assert_reference(got, x, qw)
    packed = kernels.pack_quantized(qw, torch.float32, twin.activations)
    assert type(packed) is type(twin.packer.pack(qw))
    assert torch.equal(kernels.quant_linear(x.t().contiguous().t(), packed), got)  # columns strided: copied


def test_padded_group_writes_only_real_outputs(twin):
    """13 outputs: the last 8-output group holds 5 real ones; the op's output has 13 columns and the padding
    never shows (a row of zeros in x still gives exact zeros)."""
    qw = quantize(weight(13, 64), "int4")
    x = torch.cat([rows(3, 64), torch.zeros(1, 64)])
    got = native(twin, x, qw)
    assert got.shape == (4, 13) and torch.equal(got[3], torch.zeros(13))


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_rows_bit_identical_whatever_the_batch_and_threads(twin, ggml_type):
    """Each row's result equals, bit for bit, the same row computed alone on one thread: at every row count of
    the twin's sweep, starting at a different row so a row lands in another tile position, on 1 or 2
    threads."""
    qw = gguf_weight(ggml_type, 200, 192)  # 25 groups: uneven per thread and per tile
    x = rows(max(twin.sweep), 192, seed=3)
    with torch_threads(1):
        alone = torch.cat([native(twin, x[i:i + 1], qw) for i in range(x.shape[0])])
    twin.assert_reference(alone, x, qw)
    for n_threads in (1, 2):
        with torch_threads(n_threads):
            for t in twin.sweep:
                start = (7 * t) % (x.shape[0] - t + 1)
                got = native(twin, x[start:start + t], qw)
                assert torch.equal(got, alone[start:start + t]), f"{t} rows on {n_threads} threads"


def test_rejects_bad_inputs(twin):
    ops, p = load_or_skip(twin.op), twin.packer.pack(quantize(weight(16, 64), "int8"))
    with pytest.raises(RuntimeError, match="float32"):
        ops.quant_linear(rows(2, 64).bfloat16(), p.data, p.bits, 16)
    with pytest.raises(RuntimeError, match="features"):
        ops.quant_linear(rows(2, 96), p.data, p.bits, 16)
    with pytest.raises(RuntimeError, match="outputs"):
        ops.quant_linear(rows(2, 64), p.data, p.bits, 24)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.quant_linear(rows(2, 64), p.data, 5, 16)
    with pytest.raises(TypeError, match="float32 activations"):
        kernels.quant_linear(rows(2, 64).bfloat16(), p)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packing_is_a_reshuffle(twin, kind):
    """Same bytes per weight as the QuantizedWeight (64 outputs: no padded group)."""
    qw = quantize(weight(64, 128), kind)
    assert twin.packer.pack(qw).nbytes() == qw.nbytes()
