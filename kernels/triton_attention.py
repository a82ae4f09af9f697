"""The Triton twin of kernels/reference.py's paged_attention (CUDA tensors; kernels/triton_ops.py exports it).

Query tiles of one GQA group's heads over the paged KV cache, keys in steps of a tile, an online softmax in
fp32; decode rows take a smaller query tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseserve.kernels.triton_common import INTERPRETED, as_heads, pow2

# Attention tiles: rows of a query tile (query tokens x heads of one GQA group)
# and keys per inner-loop step. tl.dot needs every dimension >= 16.
_ATTN_BLOCK_M = 64
_ATTN_DECODE_BLOCK_M = 16
_ATTN_TILE_N = 32


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
    q = as_heads(q, "q")
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
    g_pad = pow2(group)
    block_m = _ATTN_DECODE_BLOCK_M if max_query_len <= 1 else _ATTN_BLOCK_M
    if q.dtype == torch.float32:  # fp32 tiles take twice the registers and shared memory
        block_m = max(block_m // 2, 16)
    block_m = max(block_m, g_pad)
    block_q = block_m // g_pad
    # 1-D metadata is read with unit stride, table rows with unit column stride
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    upcast = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and INTERPRETED)
    grid = (T // block_q + B, KVH)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale) * 1.4426950408889634, B, bs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=D, D_PAD=pow2(D, 16), GROUP=group, G_PAD=g_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=_ATTN_TILE_N,
        UPCAST=upcast, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
