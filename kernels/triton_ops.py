"""Triton twins of kernels/reference.py: same signatures, same semantics.

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

# Decided when the kernels below are decorated, like the decorator itself.
# The interpreter computes bf16 arithmetic (and bf16 tl.dot) wrongly, so on it
# attention upcasts bf16 to fp32 before its dots; a GPU keeps the native dot.
_INTERPRETED = bool(triton.knobs.runtime.interpret)

# Attention tiles: rows of a query tile (query tokens x heads of one GQA group)
# and keys per inner-loop step. tl.dot needs every dimension >= 16.
_ATTN_BLOCK_M = 64
_ATTN_DECODE_BLOCK_M = 16
_ATTN_TILE_N = 32
_SAMPLE_BLOCK_V = 1024
_ELEMWISE_BLOCK = 1024
_MAX_FUSED_ROW = 65536


def _pow2(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(max(int(n), 1)), floor)


def _warps(elems: int) -> int:
    # ~8 elements per thread, 1..16 warps
    return min(max(_pow2(elems) // 256, 1), 16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, last] with a unit last stride (copies only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _heads(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


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
    x2 = _rows(x)
    stream_dtype = x.dtype
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        stream_dtype = torch.promote_types(x.dtype, residual.dtype)
        r2 = _rows(residual)
        res_out = torch.empty(x2.shape, dtype=stream_dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused by the kernel (HAS_RESIDUAL=False)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    block = _pow2(n)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            n, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
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
    q = _heads(q, "q")
    k = _heads(k, "k")
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
    block_h = _pow2(max(H, k.shape[1]))
    block_half = _pow2(half)
    if T > 0:
        _rotary_kernel[(T,)](
            positions.contiguous(), cache, q, k, qo, ko,
            cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            H, k.shape[1], D, half,
            BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=_pow2(D - rd), HAS_PASS=rd < D,
            num_warps=_warps(block_h * block_half * 2),
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
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(_pow2(inter), _ELEMWISE_BLOCK)
    if x2.shape[0] > 0 and inter > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=_warps(block),
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
    k = _heads(k, "k")
    v = _heads(v, "v")
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
        BLOCK_H=_pow2(kvh), BLOCK_D=_pow2(d), num_warps=_warps(kvh * d),
    )


def rotary_and_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the two kernels back to back: on a GPU neither is worth fusing (launches, not per-op host work)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


# --------------------------------------------------------------------------- paged_attention


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    qk_scale, num_seqs, block_size,
    q_st_t, q_st_h, o_st_t, o_st_h,
    kc_st_b, kc_st_s, kc_st_h, vc_st_b, vc_st_s, vc_st_h, bt_st,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (query tile, kv head). A query tile is up to BLOCK_Q new
    tokens of one sequence times the GROUP query heads sharing this kv head, so
    each K/V tile is loaded once per GQA group. Grid axis 0 enumerates tiles of
    all sequences: sequence i owns tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1),
    found by binary search, so no host-side per-sequence bookkeeping is needed."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1

    q_begin = tl.load(qsl_ptr + seq)
    n_new = tl.load(qsl_ptr + seq + 1) - q_begin
    q_first = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first new-token index of this tile

    if q_first < n_new:
        ctx = tl.load(seq_lens_ptr + seq)
        pos0 = ctx - n_new  # position of the first new token

        offs_m = tl.arange(0, BLOCK_M)
        q_local = q_first + offs_m // G_PAD
        head_in_group = offs_m % G_PAD
        row_valid = (q_local < n_new) & (head_in_group < GROUP)
        head = kvh * GROUP + head_in_group
        tok = (q_begin + q_local).to(tl.int64)
        q_pos = pos0 + q_local

        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + tok[:, None] * q_st_t + head[:, None] * q_st_h + offs_d[None, :],
                    mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

        # keys [0, kv_end) are visible to at least one row of this tile
        kv_end = pos0 + tl.minimum(q_first + BLOCK_Q, n_new)
        bt_row = bt_ptr + seq.to(tl.int64) * bt_st
        for start in range(0, kv_end, TILE_N):
            k_pos = start + tl.arange(0, TILE_N)
            k_valid = k_pos < kv_end
            phys = tl.load(bt_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
            in_blk = (k_pos % block_size).to(tl.int64)
            k_off = phys * kc_st_b + in_blk * kc_st_s + kvh * kc_st_h
            v_off = phys * vc_st_b + in_blk * vc_st_s + kvh * vc_st_h
            kt = tl.load(kc_ptr + k_off[None, :] + offs_d[:, None],
                         mask=k_valid[None, :] & d_mask[:, None], other=0.0)  # [D_PAD, TILE_N]
            v = tl.load(vc_ptr + v_off[:, None] + offs_d[None, :],
                        mask=k_valid[:, None] & d_mask[None, :], other=0.0)  # [TILE_N, D_PAD]
            # the cache may hold another dtype; the reference casts it to q's
            kt = kt.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
            if UPCAST:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)

            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # log2 domain
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if UPCAST:
                acc += tl.dot(p, v, input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * o_st_t + head[:, None] * o_st_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, max_query_len: int,
) -> torch.Tensor:
    q = _heads(q, "q")
    T, H, D = q.shape
    nb, bs, KVH, Dc = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if Dc != D or H % KVH:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache heads ({KVH}, {Dc})")
    B = seq_lens.shape[0]
    if query_start_loc.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(
            f"need seq_lens [B], query_start_loc [B+1], block_tables [B, n]; got {tuple(seq_lens.shape)}, "
            f"{tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride on head_dim")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    group = H // KVH
    g_pad = _pow2(group)
    block_m = _ATTN_DECODE_BLOCK_M if max_query_len <= 1 else _ATTN_BLOCK_M
    if q.dtype == torch.float32:  # fp32 tiles take twice the registers and shared memory
        block_m = max(block_m // 2, 16)
    block_m = max(block_m, g_pad)
    block_q = block_m // g_pad
    # 1-D metadata is read with unit stride, table rows with unit column stride
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    upcast = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _INTERPRETED)
    grid = (T // block_q + B, KVH)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale) * 1.4426950408889634, B, bs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=D, D_PAD=_pow2(D, 16), GROUP=group, G_PAD=g_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=_ATTN_TILE_N,
        UPCAST=upcast, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


# --------------------------------------------------------------------------- sample


@triton.jit
def _order_key(x):
    """int64 key whose order equals the float order of x (-0.0 folded into +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, noise_ptr, out_ptr,
    V, l_stride, n_stride,
    BLOCK_V: tl.constexpr,
):
    """One program per row. Top-k and top-p become thresholds on the logit found
    by bisection over the float order (no sort): a pass over the row per step.

    top-k: the k-th largest value is the largest key t with count(key >= t) >= k.
    top-p: the reference keeps a token iff the probability mass strictly above
    it is < top_p (always keeping the top one); that mass falls as the value
    rises, so the kept set is {key >= t0} for the smallest such t0.
    """
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * l_stride
    nrow = noise_ptr + row * n_stride
    offs = tl.arange(0, BLOCK_V)

    # pass 1: greedy argmax (first index of the max, like torch) and the row's range
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int64)
    low = tl.full([], float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        mask = idx < V
        x = tl.load(lrow + idx, mask=mask, other=float("-inf")).to(tl.float32)
        bmax = tl.max(x, axis=0)
        bidx = tl.min(tl.where((x == bmax) & mask, idx, V), axis=0).to(tl.int64)
        better = bmax > best
        best_idx = tl.where(better, bidx, best_idx)
        best = tl.where(better, bmax, best)
        low = tl.minimum(low, tl.min(tl.where(mask, x, float("inf")), axis=0))

    t = tl.load(temp_ptr + row).to(tl.float32)
    result = best_idx
    if t != 0.0:
        # max/min of logits / t (division by a positive or negative t keeps or flips order)
        x_max = tl.maximum(best / t, low / t)
        x_min = tl.minimum(best / t, low / t)
        key_max = _order_key(x_max)

        # top-k threshold (keep key >= kth_key)
        k = tl.load(top_k_ptr + row).to(tl.int64)
        kth_key = _order_key(x_min)
        if (k > 0) & (k < V):
            lo = kth_key  # count(key >= lo) = V >= k
            hi = key_max + 1  # count(key >= hi) = 0 < k
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                cnt = tl.zeros([], tl.int64)
                for start in range(0, V, BLOCK_V):
                    idx = start + offs
                    mask = idx < V
                    x = tl.load(lrow + idx, mask=mask, other=0.0).to(tl.float32) / t
                    cnt += tl.sum(((_order_key(x) >= mid) & mask).to(tl.int64), axis=0)
                lo = tl.where(cnt >= k, mid, lo)
                # exactly k at or above mid: that set is the top-k set, stop
                hi = tl.where(cnt == k, mid + 1, tl.where(cnt >= k, hi, mid))
            kth_key = lo

        # top-p threshold (keep key >= keep_key)
        p_top = tl.load(top_p_ptr + row).to(tl.float32)
        keep_key = kth_key
        if p_top < 1.0:
            # mass of the top-k set and the counts the early stop below needs
            z_k = tl.zeros([], tl.float32)
            n_k = tl.zeros([], tl.int64)
            n_top = tl.zeros([], tl.int64)
            for start in range(0, V, BLOCK_V):
                idx = start + offs
                mask = idx < V
                x = tl.load(lrow + idx, mask=mask, other=0.0).to(tl.float32) / t
                key = _order_key(x)
                kept = mask & (key >= kth_key)
                z_k += tl.sum(tl.where(kept, tl.exp(x - x_max), 0.0), axis=0)
                n_k += tl.sum(kept.to(tl.int64), axis=0)
                n_top += tl.sum((mask & (key >= key_max)).to(tl.int64), axis=0)
            limit = p_top * z_k
            lo = kth_key - 1  # mass above lo is all of z_k >= limit: not kept
            hi = key_max  # the top token is always kept
            n_above_lo = n_k  # count(key > lo)
            n_from_hi = n_top  # count(key >= hi)
            # stop when no token lies strictly between lo and hi: the set is decided
            while (hi - lo > 1) & (n_above_lo != n_from_hi):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros([], tl.float32)
                n_gt = tl.zeros([], tl.int64)
                n_ge = tl.zeros([], tl.int64)
                for start in range(0, V, BLOCK_V):
                    idx = start + offs
                    mask = idx < V
                    x = tl.load(lrow + idx, mask=mask, other=0.0).to(tl.float32) / t
                    key = _order_key(x)
                    kept = mask & (key >= kth_key)
                    mass += tl.sum(tl.where(kept & (key > mid), tl.exp(x - x_max), 0.0), axis=0)
                    n_gt += tl.sum((kept & (key > mid)).to(tl.int64), axis=0)
                    n_ge += tl.sum((kept & (key >= mid)).to(tl.int64), axis=0)
                good = mass < limit
                hi = tl.where(good, mid, hi)
                n_from_hi = tl.where(good, n_ge, n_from_hi)
                lo = tl.where(good, lo, mid)
                n_above_lo = tl.where(good, n_above_lo, n_gt)
            keep_key = hi

        # min-p (relative to the top probability, whose unnormalized weight is 1)
        # and the exponential race argmax(p / noise); dividing every p by the same
        # normalizer cannot change the winner, so it is left out.
        p_min = tl.load(min_p_ptr + row).to(tl.float32)
        win = tl.full([], -1.0, tl.float32)
        win_idx = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            mask = idx < V
            x = tl.load(lrow + idx, mask=mask, other=0.0).to(tl.float32) / t
            w = tl.exp(x - x_max)
            kept = mask & (_order_key(x) >= keep_key) & (w >= p_min)
            noise = tl.load(nrow + idx, mask=mask, other=1.0).to(tl.float32)
            score = tl.where(kept, w / noise, 0.0)
            score = tl.where(mask, score, -1.0)
            bmax = tl.max(score, axis=0)
            bidx = tl.min(tl.where(score == bmax, idx, V), axis=0).to(tl.int64)
            better = bmax > win
            win_idx = tl.where(better, bidx, win_idx)
            win = tl.where(better, bmax, win)
        result = win_idx
    tl.store(out_ptr + row, result)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, noise: torch.Tensor,
) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    B, V = logits.shape
    if noise.shape != (B, V):
        raise ValueError(f"noise must be [{B}, {V}], got {tuple(noise.shape)}")
    for name, p in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if p.shape != (B,):
            raise ValueError(f"{name} must be [{B}], got {tuple(p.shape)}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    noise = noise if noise.stride(-1) == 1 else noise.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    block = min(_pow2(V), _SAMPLE_BLOCK_V)
    _sample_kernel[(B,)](
        logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
        noise, out, V, logits.stride(0), noise.stride(0),
        BLOCK_V=block, num_warps=_warps(block),
    )
    return out


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
            QBLOCK=_QBLOCK, UPCAST=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _INTERPRETED),
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        )
    return out
