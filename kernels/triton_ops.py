"""Triton twins of kernels/reference.py: same signatures, same semantics. This file holds a layer's
elementwise ops and quant_linear, and exports paged_attention (kernels/triton_attention.py) and sample
(kernels/triton_sampling.py): the one Triton surface the dispatch calls.

Every kernel loads its inputs, computes in fp32 and stores in the dtype the
reference returns. All loads and stores are masked. One fixed launch config
per call (no autotune: it needs a driver), no libdevice.

Callers go through kernels/__init__.py, which sends CUDA tensors here. Tests
run these kernels on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseserve.kernels.triton_attention import paged_attention  # noqa: F401  (exported: see above)
from phaseserve.kernels.triton_common import INTERPRETED, as_heads, as_rows, pow2, warps
from phaseserve.kernels.triton_sampling import sample  # noqa: F401  (exported: see above)

_ELEMWISE_BLOCK = 1024
_MAX_FUSED_ROW = 65536


# --------------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_cols, x_stride, res_stride, out_stride, res_out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the stream dtype first, as torch's `x + residual` does
        h = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, h, mask=mask)
        x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    # the reference rounds the normalized value to the activation dtype before scaling
    if HAS_RESIDUAL:
        y = y.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    if n > _MAX_FUSED_ROW:
        raise ValueError(f"rms_norm: hidden size {n} exceeds the fused-row limit {_MAX_FUSED_ROW}")
    x2 = as_rows(x)
    stream_dtype = x.dtype
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        stream_dtype = torch.promote_types(x.dtype, residual.dtype)
        r2 = as_rows(residual)
        res_out = torch.empty(x2.shape, dtype=stream_dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused by the kernel (HAS_RESIDUAL=False)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    block = pow2(n)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            n, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps(block),
        )
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if residual is not None else None)


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, tok, src_st_t, src_st_h, dst_st_t, dst_st_h, n_heads, head_dim, half,
    cos, sin,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < half)
    src = src_ptr + tok * src_st_t + heads[:, None] * src_st_h
    dst = dst_ptr + tok * dst_st_t + heads[:, None] * dst_st_h
    x1 = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst + cols[None, :], o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + cols[None, :], o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if HAS_PASS:  # partial rotary: features past rotary_dim are copied unchanged
        pcols = 2 * half + tl.arange(0, BLOCK_PASS)
        pmask = (heads[:, None] < n_heads) & (pcols[None, :] < head_dim)
        xp = tl.load(src + pcols[None, :], mask=pmask, other=0.0)
        tl.store(dst + pcols[None, :], xp, mask=pmask)


@triton.jit
def _rotary_kernel(
    pos_ptr, cache_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr,
    cache_stride, q_st_t, q_st_h, k_st_t, k_st_h, qo_st_t, qo_st_h, ko_st_t, ko_st_h,
    n_q_heads, n_k_heads, head_dim, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    cos = tl.load(cache_ptr + pos * cache_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + half + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, tok, q_st_t, q_st_h, qo_st_t, qo_st_h, n_q_heads, head_dim, half,
                  cos, sin, BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS)
    _rotate_heads(k_ptr, ko_ptr, tok, k_st_t, k_st_h, ko_st_t, ko_st_h, n_k_heads, head_dim, half,
                  cos, sin, BLOCK_H, BLOCK_HALF, BLOCK_PASS, HAS_PASS)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q = as_heads(q, "q")
    k = as_heads(k, "k")
    T, H, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [{T}], got {tuple(positions.shape)}")
    rd = cos_sin_cache.shape[-1]
    if rd % 2 or rd > D or rd == 0:
        raise ValueError(f"rotary_dim {rd} must be even, positive and <= head_dim {D}")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = rd // 2
    block_h = pow2(max(H, k.shape[1]))
    block_half = pow2(half)
    if T > 0:
        _rotary_kernel[(T,)](
            positions.contiguous(), cache, q, k, qo, ko,
            cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            H, k.shape[1], D, half,
            BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=pow2(D - rd), HAS_PASS=rd < D,
            num_warps=warps(block_h * block_half * 2),
        )
    return qo, ko


# --------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu(gate) to the input dtype before the multiply; do the same
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = as_rows(x)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(pow2(inter), _ELEMWISE_BLOCK)
    if x2.shape[0] > 0 and inter > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=warps(block),
        )
    return out.view(*x.shape[:-1], inter)


# --------------------------------------------------------------------------- write_kv_cache


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    n_heads, head_dim, block_size, num_slots,
    k_st_t, k_st_h, v_st_t, v_st_h,
    kc_st_b, kc_st_s, kc_st_h, kc_st_d, vc_st_b, vc_st_s, vc_st_h, vc_st_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slots < 0 are padding; an out-of-range slot is dropped rather than
    # scribbling over memory past the cache
    valid = (slot >= 0) & (slot < num_slots)
    blk = slot // block_size
    off = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = valid & (heads < n_heads) & (dims < head_dim)
    k = tl.load(k_ptr + tok * k_st_t + heads * k_st_h + dims, mask=mask, other=0.0)
    v = tl.load(v_ptr + tok * v_st_t + heads * v_st_h + dims, mask=mask, other=0.0)
    tl.store(kc_ptr + blk * kc_st_b + off * kc_st_s + heads * kc_st_h + dims * kc_st_d,
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + blk * vc_st_b + off * vc_st_s + heads * vc_st_h + dims * vc_st_d,
             v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k = as_heads(k, "k")
    v = as_heads(v, "v")
    nb, bs, kvh, d = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k.shape[1:] != (kvh, d) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit cache heads ({kvh}, {d})")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    T = k.shape[0]
    if T == 0:
        return
    _write_kv_cache_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        kvh, d, bs, nb * bs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=pow2(kvh), BLOCK_D=pow2(d), num_warps=warps(kvh * d),
    )


def rotary_and_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the two kernels back to back: on a GPU neither is worth fusing (launches, not per-op host work)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


# --------------------------------------------------------------------------- quant_linear

_QUANT_BLOCK_T = 16  # tl.dot needs every dim >= 16
_QUANT_BLOCK_N = 64
_QBLOCK = 32  # weights per quantization block (kernels/quant.py)


@triton.jit
def _quant_linear_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, out_ptr, T, N, K, x_stride, out_stride,
    INT4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one [BLOCK_T, BLOCK_N] output tile; each step dequantizes one 32-weight block of BLOCK_N rows
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    kk = tl.arange(0, QBLOCK)
    row_ok = rows < T
    col_ok = cols < N
    nblocks = K // QBLOCK
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for b in range(0, nblocks):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + b * QBLOCK + kk[None, :],
                    mask=row_ok[:, None], other=0.0)
        if INT4:
            # element k of a block: byte k % 16, low nibble for k < 16, high for k >= 16
            byte = tl.load(q_ptr + cols[None, :] * (K // 2) + b * (QBLOCK // 2) + (kk[:, None] % (QBLOCK // 2)),
                           mask=col_ok[None, :], other=0).to(tl.int32)
            q = ((byte >> ((kk[:, None] // (QBLOCK // 2)) * 4)) & 0xF).to(tl.float32)
        else:
            q = tl.load(q_ptr + cols[None, :] * K + b * QBLOCK + kk[:, None], mask=col_ok[None, :],
                        other=0).to(tl.float32)
        d = tl.load(d_ptr + cols * nblocks + b, mask=col_ok, other=0.0).to(tl.float32)
        w = q * d[None, :]  # [QBLOCK, BLOCK_N]: the dequantized block, rounded once to x's dtype below
        if INT4:
            w += tl.load(m_ptr + cols * nblocks + b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if UPCAST:  # fp32 x, or bf16 in the interpreter (its bf16 dot is wrong): rounded operands, fp32 dot
            acc += tl.dot(x.to(tl.float32), w.to(x_ptr.dtype.element_ty).to(tl.float32),
                          input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, in] @ W.T for a kernels.quant.QuantizedWeight W: [T, out] in x's dtype."""
    out_f, in_f = weight.shape
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"quant_linear: x must be [T, {in_f}], got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((x.shape[0], out_f), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0 and out_f > 0:
        int4 = weight.kind == "int4"
        grid = (triton.cdiv(x.shape[0], _QUANT_BLOCK_T), triton.cdiv(out_f, _QUANT_BLOCK_N))
        _quant_linear_kernel[grid](
            x, weight.qdata, weight.scales, weight.mins if int4 else weight.scales, out, x.shape[0], out_f, in_f,
            x.stride(0), out.stride(0), INT4=int4, BLOCK_T=_QUANT_BLOCK_T, BLOCK_N=_QUANT_BLOCK_N,
            QBLOCK=_QBLOCK, UPCAST=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and INTERPRETED),
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        )
    return out
