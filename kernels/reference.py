"""Torch implementations of every kernel: the reference for the Triton kernels
and the path that runs on CPU. Each function here has a Triton twin with the
same signature in kernels/triton_ops.py; kernels/__init__.py picks one.

Shapes (T = tokens in the packed step, H = query heads, KVH = kv heads, D = head dim):
  q [T, H, D]; k, v [T, KVH, D]
  k_cache, v_cache [num_blocks, block_size, KVH, D]
  block_tables [B, max_blocks_per_seq] int32 (rows padded with 0)
  seq_lens [B] int32: context length of each sequence *after* this step's tokens
  query_start_loc [B + 1] int32: cumulative new-token counts (packed layout)
  slot_mapping [T] int64: block_id * block_size + offset for each new token (-1 = skip)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm with an optional fused residual add.

    With `residual`, computes h = x + residual and returns (norm(h) * weight, h),
    which is how a pre-norm decoder layer threads its residual stream.
    Statistics in fp32, as Hugging Face Llama does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as in Hugging Face Llama.

    cos_sin_cache [max_pos, rotary_dim]: first half cos, second half sin, fp32.
    Rotates the first `rotary_dim` features of every head; returns new q, k.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rd/2] each
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1] * 2
        xr, xpass = x[..., :rd].float(), x[..., rd:]
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, xpass), dim=-1) if xpass.shape[-1] else out

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K and V at its slot (in place). Slots < 0 are skipped."""
    nb, bs, kvh, d = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, max_query_len: int,
) -> torch.Tensor:
    """Varlen causal attention over a paged KV cache (prefill chunks and decodes together).

    Sequence i has n_i = qsl[i+1] - qsl[i] new queries, the last n_i of its
    seq_lens[i] positions: query j sits at position seq_lens[i] - n_i + j and
    attends to cached keys [0, that position]. The new tokens' K/V must already
    be in the cache (write_kv_cache first). Returns [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    if max_query_len == 1 and T == seq_lens.shape[0]:
        return _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        if n == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        blocks = block_tables[i, :nblk].long()
        kk = k_cache.index_select(0, blocks).view(-1, KVH, D)[:ctx]  # [ctx, KVH, D]
        vv = v_cache.index_select(0, blocks).view(-1, KVH, D)[:ctx]
        G = H // KVH
        # [KVH, G * n, D]: the query heads that share a KV head are stacked, so K/V are never repeated
        qi = q[s:e].view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * n, D)
        kk = kk.to(q.dtype).transpose(0, 1)  # [KVH, ctx, D]
        vv = vv.to(q.dtype).transpose(0, 1)
        # causal with an offset: query j sees keys <= ctx - n + j
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril_(ctx - n).repeat(G, 1)  # [G * n, ctx]
        # explicit matmul-softmax-matmul: on CPU, bf16 GEMMs run several times faster than SDPA's flash kernel
        # scale folded into q (n rows, not n * ctx scores); softmax in fp32
        scores = torch.matmul(qi * scale, kk.transpose(1, 2)).float()
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        o = torch.matmul(probs, vv)  # [KVH, G * n, D]
        out[s:e] = o.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per sequence (decode): gather every sequence's blocks at once into a padded
    [B, KVH, L, D] batch and attend with two batched matmuls, masking each row past its length.
    No host sync and no Python loop over the batch."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    M = block_tables.shape[1]
    L = M * bs
    G = H // KVH
    # index_select + one transpose copy is several times faster than advanced indexing, and the
    # contiguous [B, KVH, L, D] layout lets the matmuls run without hidden copies.
    # Padding entries of the block tables point at block 0 and are masked out.
    flat = block_tables.reshape(-1).long()
    kk = k_cache.index_select(0, flat).view(B, L, KVH, D).transpose(1, 2).contiguous().to(q.dtype)
    vv = v_cache.index_select(0, flat).view(B, L, KVH, D).transpose(1, 2).contiguous().to(q.dtype)
    mask = torch.arange(L, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    # plain matmul-softmax-matmul: for one query row, SDPA's CPU flash kernel is ~10x slower.
    # Query heads are grouped by their KV head (GQA) so K and V are never repeated.
    scores = torch.matmul(q.view(B, KVH, G, D) * scale, kk.transpose(-1, -2)).float()  # [B, KVH, G, L]
    probs = scores.masked_fill_(~mask[:, None, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, vv).view(B, H, D)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, noise: torch.Tensor,
) -> torch.Tensor:
    """One token per row. logits [B, V] fp32; per-row temperature/top_k/top_p/min_p [B];
    noise [B, V] fp32 drawn from Exponential(1) by the caller (seeded per request).

    Row with temperature == 0: argmax(logits) (greedy). Otherwise logits / temperature,
    keep the top_k (0 = all), keep the smallest set with cumulative prob >= top_p,
    drop tokens with prob < min_p * max prob, then argmax(prob / noise) -- the
    exponential-race form of sampling from the renormalized distribution, which
    makes the draw a pure function of (logits, noise).
    """
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    x = logits.float() / t
    V = x.shape[1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V))
    sorted_x, _ = x.sort(dim=1, descending=True)
    kth = sorted_x.gather(1, (k - 1).long().unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    # top-p on the top-k-filtered distribution, sorted descending
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sp = sorted_x.softmax(dim=1)
    cum_before = sp.cumsum(dim=1) - sp  # prob mass strictly above each token
    # top_p >= 1 keeps everything: the float cumsum can reach 1.0 before the tail
    keep_sorted = (cum_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    keep_sorted[:, 0] = True
    # threshold = smallest kept logit
    n_keep = keep_sorted.sum(dim=1, keepdim=True)
    thresh = sorted_x.gather(1, n_keep - 1)
    x = x.masked_fill(x < thresh, float("-inf"))
    p = x.softmax(dim=1)
    p = p.masked_fill(p < min_p.unsqueeze(1) * p.max(dim=1, keepdim=True).values, 0.0)
    sampled = (p / noise).argmax(dim=1)
    return torch.where(greedy, logits.argmax(dim=1), sampled)
