"""The Triton twin of kernels/reference_sampling.py's sample (CUDA tensors; kernels/triton_ops.py exports it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseserve.kernels.triton_common import pow2, warps

_SAMPLE_BLOCK_V = 1024


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
    block = min(pow2(V), _SAMPLE_BLOCK_V)
    _sample_kernel[(B,)](
        logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
        noise, out, V, logits.stride(0), noise.stride(0),
        BLOCK_V=block, num_warps=warps(block),
    )
    return out
