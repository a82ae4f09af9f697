"""What the bf16 and float32 layer ops (kernels/native/layer_ops.cpp, layer_ops_f32.cpp) share, tested once for
each: the argument checks of kernels/native/op_args.h, with the same clear error in either dtype. Their
arithmetic, which differs, is in test_native_layer_ops.py and test_native_layer_ops_f32.py."""

import pytest
import torch

import test_native_layer_ops as bf16
import test_native_layer_ops_f32 as f32
from phaseserve.kernels.dispatch.layer_ops import LayerOps
from native_ops import load_or_skip

# per twin: its op file, its dtype, and its test file's case builders (inputs in that dtype)
TWINS = {"layer_ops": (torch.bfloat16, bf16), "layer_ops_f32": (torch.float32, f32)}


@pytest.mark.parametrize("op", TWINS)
def test_bad_input_gets_clear_errors(op):
    ops = load_or_skip(op)
    dtype, cases = TWINS[op]
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    x, residual, weight = cases._norm_case(g, 3, 64)
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(RuntimeError, match=f"x must be a {dtype_name} CPU tensor"):
        ops.rms_norm(x.to(other), weight, 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[64\]"):
        ops.rms_norm(x, weight[:32], 1e-5)
    with pytest.raises(RuntimeError, match="residual shape"):
        ops.add_rms_norm(x, residual[:2], weight, 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        LayerOps(ops, dtype).silu_and_mul(x[:, :63])
    with pytest.raises(RuntimeError, match=f"logits must be a {dtype_name} CPU tensor"):
        ops.argmax(x.to(other))
    with pytest.raises(RuntimeError, match="rows, vocab"):
        ops.argmax(x[0])
    _, q, k, v, positions, cos_sin, k_cache, v_cache, slots = cases._rotary_case(g, 4, 4, 2, 64)
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        ops.rotary_and_write_kv(positions + 4096, q, k, v, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots + 10 ** 6)
    with pytest.raises(RuntimeError, match="disagree"):
        ops.rotary_and_write_kv(positions, q, k[:2], v, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="disagree"):
        ops.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache[..., :32].contiguous(), v_cache, slots)
    assert not ops.rotary_and_write_kv(positions, q.to(other), k, v, cos_sin, k_cache, v_cache, slots)  # declined
