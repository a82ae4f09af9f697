"""The dispatch of paged attention: Triton on CUDA tensors; on CPU the native decode and prefill (extend)
ops of the activations' dtype where they take the heads' shapes, else torch."""

from __future__ import annotations

import torch

from phaseserve.kernels import reference
from phaseserve.kernels.dispatch.choices import CHOICES, Choice, dtype_name, load_native, triton_ops

# What the native attention ops (decode and prefill) handle; anything else takes the torch path.
NATIVE_ATTENTION_HEAD_DIMS = {torch.bfloat16: (32, 64, 128), torch.float32: (16, 32, 64, 128)}
NATIVE_ATTENTION_MAX_GROUP = 16  # query heads per KV head

# the native files of the attention ops, per activation dtype
ATTENTION_SOURCE = {torch.bfloat16: {"decode_attention": "decode_attention", "extend_attention": "extend_attention"},
                    torch.float32: {"decode_attention": "attention_f32", "extend_attention": "attention_f32"}}


def unsupported_native_attention(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                 head_dim: int) -> str | None:
    """Why the native attention ops (decode and prefill) cannot take these shapes, or None when they can."""
    if dtype not in ATTENTION_SOURCE:
        return f"dtype {dtype} (native attention: bfloat16, float32)"
    if head_dim not in NATIVE_ATTENTION_HEAD_DIMS[dtype]:
        return f"head_dim {head_dim} (native: {', '.join(map(str, NATIVE_ATTENTION_HEAD_DIMS[dtype]))})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > NATIVE_ATTENTION_MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    return None


def _attention_choice(op: str, event: str) -> Choice:
    """The choice of the native `op` (decode_attention or extend_attention), per key (dtype, query heads, KV
    heads, head_dim): its loaded ops, or None (torch)."""

    def resolve(key: tuple[torch.dtype, int, int, int]):
        dtype, num_heads, num_kv_heads, head_dim = key
        why_not = unsupported_native_attention(*key)
        return load_native(None if why_not else ATTENTION_SOURCE[dtype][op], event, why_not=why_not,
                           dtype=dtype_name(dtype), heads=num_heads, kv_heads=num_kv_heads, head_dim=head_dim)

    return Choice(op, resolve)


DECODE_ATTENTION = _attention_choice("decode_attention", "CPU decode attention")
EXTEND_ATTENTION = _attention_choice("extend_attention", "CPU prefill attention")


def native_decode(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """The loaded native ops serving CPU decode attention at these shapes, or None (torch)."""
    return CHOICES.get(DECODE_ATTENTION, (dtype, num_heads, num_kv_heads, head_dim))


def decode_reads_own_lengths(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> bool:
    """True when paged_attention's decodes (one query per sequence) on this device read each sequence's own
    context length, so a caller gains nothing from grouping decodes by length. False for the torch path,
    which pads every row of a call to its longest context."""
    if torch.device(device).type == "cuda":
        return True
    return native_decode(dtype, num_heads, num_kv_heads, head_dim) is not None


def paged_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if q.is_cuda:
        return triton_ops().paged_attention(q, *args, **kwargs)
    return _cpu_paged_attention(q, *args, **kwargs)


paged_attention.__doc__ = reference.paged_attention.__doc__


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.int()


def _cpu_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, max_query_len: int,
) -> torch.Tensor:
    T, H, D = q.shape
    if k_cache.dtype == q.dtype:
        decode = max_query_len == 1 and T == seq_lens.shape[0]
        ops = CHOICES.get(DECODE_ATTENTION if decode else EXTEND_ATTENTION, (q.dtype, H, k_cache.shape[2], D))
        if ops is not None:
            if q.stride(2) != 1 or q.stride(1) != D:
                q = q.contiguous()
            # the runner's step tensors are int32 already: .int() would still cost a dispatch per layer
            block_tables, seq_lens = _int32(block_tables), _int32(seq_lens)
            if decode:
                return ops.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
            return ops.extend_attention(q, k_cache, v_cache, block_tables, seq_lens, _int32(query_start_loc), scale)
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_len)
