"""Torch implementations of every kernel: the reference for the Triton kernels and the native CPU
ops (kernels/native), and the path that runs on CPU where no native op applies. Each function here
has a Triton twin with the same signature in kernels/triton_ops.py; kernels/dispatch/ picks one. Sampling's
lives in kernels/reference_sampling.py (re-exported here).

Shapes (T = tokens in the packed step, H = query heads, KVH = kv heads, D = head dim):
  q [T, H, D]; k, v [T, KVH, D]
  k_cache, v_cache [num_blocks, block_size, KVH, D]
  block_tables [B, max_blocks_per_seq] int32 (rows padded with 0)
  seq_lens [B] int32: context length of each sequence *after* this step's tokens
  query_start_loc [B + 1] int32: cumulative new-token counts (packed layout)
  slot_mapping [T] int64: block_id * block_size + offset for each new token (-1 = skip)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from phaseserve.kernels.quant import QuantizedWeight
from phaseserve.kernels.reference_sampling import sample  # noqa: F401  (re-exported: every kernel's reference is here)


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
    # torch's rms_norm takes its statistics in fp32 and rounds the normalized value back to x's dtype,
    # bit for bit what Hugging Face does, so x needs no fp32 copy of its own (nor a cast back)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps), residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as in Hugging Face Llama.

    cos_sin_cache [max_pos, rotary_dim]: first half cos, second half sin, fp32.
    Rotates the first `rotary_dim` features of every head; returns new q, k.
    """
    cos, sin = _rotary_factors(positions, cos_sin_cache)
    qk = _adjacent_heads(q, k)
    if qk is not None:
        # q and k cut from one qkv row: one pass over both (half the ops); the results are views of one buffer
        out = _rotate(qk, cos, sin)
        return out[:, :q.shape[1]], out[:, q.shape[1]:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, KVH, D] as one [T, H + KVH, D] view when k's heads directly follow q's in
    memory with the same strides (both sliced from a fused qkv GEMM output), else None.
    Plain tuple and pointer tests, the pointer first: this runs once per layer, in the per-op overhead."""
    T, H, D = q.shape
    qs, ks = q.stride(), k.stride()
    if (k.data_ptr() - q.data_ptr() != H * D * q.element_size() or qs[1:] != (D, 1) or ks[1:] != (D, 1)
            or (T > 1 and ks[0] != qs[0]) or k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype
            or k.device != q.device):
        return None
    return q.as_strided((T, H + k.shape[1], D), (qs[0], D, 1))


def _version(t: torch.Tensor):
    return None if t.is_inference() else t._version


class _PerStep:
    """`fn` of some tensors, computed once and reused while the same tensor objects come back unchanged
    (version counter). Every layer of a step passes the runner's step tensors (positions, slots, block
    tables), so work that depends only on them runs once a step instead of once a layer. An inference
    tensor has no version counter: identity alone decides there, which holds as the runner builds fresh
    step tensors every step and never edits them in place. A few entries: a step attends its decodes in
    several buckets, each with its own tables."""

    SIZE = 4

    def __init__(self, fn):
        self.fn = fn
        self.entries: list[tuple] = []  # (args, versions, value), newest first; args held: no id reuse

    def __call__(self, *args):
        """Tensors are matched by identity and version, other arguments (sizes) by value."""
        versions = tuple(_version(t) if isinstance(t, torch.Tensor) else t for t in args)
        for held, held_versions, value in self.entries:
            if held_versions == versions and all(a is b for a, b in zip(args, held)
                                                 if isinstance(a, torch.Tensor)):
                return value
        value = self.fn(*args)
        self.entries = [(args, versions, value)] + self.entries[:self.SIZE - 1]
        return value


@_PerStep
def _rotary_factors(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, rotary_dim] with x * cos + swap_halves(x) * sin == rotate-half rotary:
    cos repeated over both halves, sin negated in the first half (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rd/2] each
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    whole = rd == x.shape[-1]
    xr = (x if whole else x[..., :rd]).to(torch.float32, copy=True)  # our own fp32 buffer, updated in place
    swapped = xr.roll(rd // 2, -1).mul_(sin)  # [x2, x1] * (-sin, sin)
    # x cos + swapped sin in fp32, rounded once to x's dtype (not addcmul: its fused rounding differs)
    out = xr.mul_(cos).add_(swapped).to(x.dtype)
    return out if whole else torch.cat((out, x[..., rd:]), dim=-1)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [T, in] @ W.T for a block-quantized W [out, in] (kernels/quant.py): the weight dequantized
    to x's dtype (rounded once from fp32), then F.linear. Bias, if any, is the caller's."""
    return F.linear(x, weight.dequantize(x.dtype))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 activations [T, K] quantized per 32-element block, Q8_0-style with an fp32 scale: a = max |x|,
    d = a / 127, q = round-half-even(x * (127 / a)) (0 where a = 0), s = d * sum(q). Returns q int8 [T, K],
    d and s float32 [T, K / 32]: the bits the native op (kernels/native/quant_gemm_i8.cpp) computes."""
    T, K = x.shape
    xb = x.float().reshape(T, K // 32, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax == 0, torch.zeros_like(amax), 127 / amax)
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    s = d * q.sum(-1, dtype=torch.int32).float()
    return q.reshape(T, K), d, s


def quant_linear_int8_activations(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [T, in] float32 @ W.T with x quantized as quantize_activations does: each block's product of the
    integer values summed exactly, then out = sum over blocks of d_w d_x S (+ m_w s_x for int4), in float64,
    rounded once to float32. The oracle of the native op, which folds the blocks in fp32 in block order."""
    T, K = x.shape
    out_f, nb = weight.scales.shape
    qx, dx, sx = quantize_activations(x)
    if weight.kind == "int4":
        nib = weight.qdata.view(out_f, nb, 16)
        qw = torch.cat((nib & 0x0F, nib >> 4), dim=-1)
    else:
        qw = weight.qdata.view(out_f, nb, 32)
    # integer products of 32 pairs: exact in float64
    S = torch.einsum("tbk,obk->tob", qx.view(T, nb, 32).double(), qw.double())
    out = (S * (weight.scales.double().unsqueeze(0) * dx.double().unsqueeze(1))).sum(-1)
    if weight.kind == "int4":
        out = out + sx.double() @ weight.mins.double().T
    return out.float()


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
    valid = _valid_slots(slot_mapping)
    if valid is not None:
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rotary_and_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding, then write_kv_cache of the rotated k and v (one layer's step, fused natively on
    CPU): returns the rotated (q, k)."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


@_PerStep
def _valid_slots(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The mask of slots >= 0, or None when all are (the usual case): one host sync a step, not a layer."""
    valid = slot_mapping >= 0
    return None if bool(valid.all()) else valid


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
        # [KVH, nblk * bs, D]: the query heads that share a KV head attend to it together, so K/V are never
        # repeated. Whole blocks: the tiles read up to a multiple of _KEY_QUANTUM keys (masked past ctx).
        kk = k_cache.index_select(0, blocks).view(-1, KVH, D).transpose(0, 1).contiguous().to(q.dtype)
        vv = v_cache.index_select(0, blocks).view(-1, KVH, D).transpose(0, 1).contiguous().to(q.dtype)
        qs = q[s:e] * scale  # scale folded into q (n rows, not n * ctx scores)
        for t0 in range(0, n, _PREFILL_TILE):
            t1 = min(n, t0 + _PREFILL_TILE)
            out[s + t0:s + t1] = _prefill_tile(qs[t0:t1], kk, vv, ctx - n + t1)
    return out


# Query rows per prefill attention tile: a tile's bf16 scores stay cache-sized (1 MiB for 8 query heads
# over 512 keys), and each tile only reads the keys its last query can see (a causal prefill computes
# about half of the full score matrix). 128 rather than 64 since the scores stopped being fp32: bf16
# scores let twice the rows fit the same cache, and long prefills measured faster (docs/model-runner.md).
_PREFILL_TILE = 128
# oneDNN builds (JIT-compiles) and caches a matmul primitive per shape; unrounded, every step's tiles had
# shapes never seen before (workers/linear.py says what that cost). So a tile of several queries is
# padded to a multiple of _QUERY_QUANTUM zero queries (dropped after) and reads its visible keys rounded
# up to a multiple of _KEY_QUANTUM (the extra ones masked).
_QUERY_QUANTUM = 16
_KEY_QUANTUM = 32


def _prefill_tile(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, visible: int) -> torch.Tensor:
    """Causal attention of m consecutive queries q [m, H, D] (pre-scaled) whose last one sits at position
    visible - 1, over kk/vv [KVH, >= visible, D] (finite past visible). Explicit matmul-softmax-matmul: on
    CPU, bf16 GEMMs run several times faster than SDPA's flash kernel. Softmax in fp32."""
    m, H, D = q.shape
    KVH = kk.shape[0]
    G = H // KVH
    rows = m if m == 1 else -(-m // _QUERY_QUANTUM) * _QUERY_QUANTUM
    if rows > m:
        q = F.pad(q, (0, 0, 0, 0, 0, rows - m))
    width = min(kk.shape[1], -(-visible // _KEY_QUANTUM) * _KEY_QUANTUM)
    qi = q.view(rows, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * rows, D)
    scores = torch.matmul(qi, kk[:, :width].transpose(1, 2))  # [KVH, G * rows, width]
    if rows > 1 or width > visible:
        # query j sees keys <= visible - m + j: only columns from visible - m on can be hidden
        tail = scores.view(KVH, G, rows, width)[..., visible - m:]
        tail.masked_fill_(_hidden(*tail.shape[-2:], q.device), float("-inf"))
    probs = _softmax(scores)
    o = torch.matmul(probs, vv[:, :width])  # [KVH, G * rows, D]
    return o.view(KVH, G, rows, D)[:, :, :m].permute(2, 0, 1, 3).reshape(m, H, D)


@functools.lru_cache(maxsize=256)
def _hidden(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """[rows, cols] True above the diagonal: the tail of a tile's scores its queries may not see. Kept per
    shape (the padded tiles have few): two fewer ops a tile. Read-only."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu_(1)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in fp32, rounded once to the scores' dtype: what Hugging Face computes as
    softmax(scores.float()).to(dtype). torch's CPU softmax on bf16 already works in fp32 inside, so it gives
    the same probabilities without the two fp32 copies (tested bit for bit)."""
    if scores.device.type == "cpu" and scores.dtype == torch.bfloat16:
        return scores.softmax(dim=-1)
    return scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)


# Bytes of gathered K+V per decode attention batch: within a core's share of L2/L3.
_DECODE_GATHER_BYTES = 4 << 20


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per sequence (decode): gather every sequence's blocks at once into a padded
    [B, KVH, L, D] batch and attend with two batched matmuls, masking each row past its length.
    No host sync and no Python loop over the batch."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    L = block_tables.shape[1] * bs
    blocks, padding = _decode_layout(block_tables, seq_lens, bs)
    rows = max(1, _DECODE_GATHER_BYTES // (2 * L * KVH * D * k_cache.element_size()))
    if B <= rows:
        return _decode_rows(q, k_cache, v_cache, blocks, padding, scale)
    # a few sequences at a time: their gathered K/V and scores stay in cache between the copies
    # and matmuls that read them (faster than one big gather of every sequence)
    return torch.cat([_decode_rows(q[i:i + rows], k_cache, v_cache, blocks[i:i + rows], padding[i:i + rows], scale)
                      for i in range(0, B, rows)])


@_PerStep
def _decode_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids [B, M] as int64 (index_select's type) and the padding mask [B, 1, 1, L] (True past a
    sequence's length), once a step. Padding entries of the block tables point at block 0, masked out."""
    B, M = block_tables.shape
    padding = torch.arange(M * block_size, device=seq_lens.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    return block_tables.long(), padding.view(B, 1, 1, M * block_size)


def _decode_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, padding: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    L = blocks.shape[1] * bs
    G = H // KVH
    # index_select + one transpose copy is several times faster than advanced indexing, and the
    # contiguous [B, KVH, L, D] layout lets the matmuls run without hidden copies.
    flat = blocks.reshape(-1)
    kk = k_cache.index_select(0, flat).view(B, L, KVH, D).transpose(1, 2).contiguous().to(q.dtype)
    vv = v_cache.index_select(0, flat).view(B, L, KVH, D).transpose(1, 2).contiguous().to(q.dtype)
    # plain matmul-softmax-matmul: SDPA's CPU flash kernel measured slower from 16 sequences up.
    # Query heads are grouped by their KV head (GQA) so K and V are never repeated.
    scores = torch.matmul(q.view(B, KVH, G, D) * scale, kk.transpose(-1, -2))  # [B, KVH, G, L]
    probs = _softmax(scores.masked_fill_(padding, float("-inf")))
    return torch.matmul(probs, vv).view(B, H, D)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's greedy token, the first index of its maximum (NaN counts as the maximum). For
    bf16 logits the same index as for their fp32 copy: the upcast is exact and keeps the order."""
    return logits.argmax(dim=-1)


# Rows per tile of lora_add: every tile's matmuls have this many rows, whatever the step holds, so a row's
# product never depends on how many rows share its adapter (one numerics; tests/test_lora.py).
LORA_TILE_ROWS = 4


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, ends: list[int], a: list[torch.Tensor],
             b: list[torch.Tensor], cols: list[int]) -> torch.Tensor:
    """The LoRA adapters' low-rank products added to a linear's output for their rows (punica's shrink-expand;
    the other rows keep their bits), in place, returns y.

    x [T, in], y [T, out]: the linear's input and output over the packed rows; rows [n]: the LoRA rows (each
    once) in groups, one per adapter, group g ending at ends[g]; a[g] [M * r, in]: the group's adapter's A
    matrices of the linear's M modules (q/k/v: 3), r rows each; b[g] [r, out]: their B matrices transposed side
    by side, module m's in y's columns cols[m]:cols[m + 1], the scaling folded in (r = 0: no product).
    y[row, cols[m]:cols[m+1]] += (x[row] @ a[g][m*r:(m+1)*r].T) @ b[g][:, cols[m]:cols[m+1]], summed in
    float32 and rounded once to y's dtype. A group's rows run in tiles of LORA_TILE_ROWS (the last one padded
    with its last row), each tile one matrix of a batched matmul of fixed shape (the adapter's matrices
    expanded over the tiles, not copied), so a row's bits do not depend on the other rows."""
    start = 0
    for end, ag, bg in zip(ends, a, b):
        if end > start and bg.shape[0] > 0:
            _lora_add_group(y, x, rows[start:end], ag, bg, cols)
        start = end
    return y


def _lora_add_group(y, x, rows, a, b, cols):
    n, tile, r = rows.shape[0], LORA_TILE_ROWS, b.shape[0]
    tiles = -(-n // tile)
    padded = torch.cat([rows, rows[-1:].expand(tiles * tile - n)])
    xs = x.index_select(0, padded).float().view(tiles, tile, x.shape[1])
    h = torch.bmm(xs, a.float().t().expand(tiles, -1, -1))
    bf = b.float()
    delta = torch.cat([torch.bmm(h[:, :, m * r:(m + 1) * r].contiguous(), bf[:, c0:c1].expand(tiles, -1, -1))
                       for m, (c0, c1) in enumerate(zip(cols, cols[1:]))], dim=2)
    delta = delta.view(tiles * tile, -1)[:n]
    out = y.index_select(0, rows)
    out = out.add_(delta) if out.dtype == torch.float32 else (out.float() + delta).to(y.dtype)
    y.index_copy_(0, rows, out)
