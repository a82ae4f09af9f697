"""The paged KV cache: per layer one K and one V tensor of fixed-size blocks.

Shape [num_blocks, block_size, num_kv_heads, head_dim], the layout kernels/
expects. Block ids are handed out by the scheduler; this module only owns the
memory.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_SIZE = 16


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Memory one block id costs across all layers, K and V."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class KVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None, memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("give num_blocks or memory_bytes for the KV cache")
            num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache of {memory_bytes} bytes holds no block (one block costs {per_block} bytes)")
        self.num_blocks = int(num_blocks)
        self.block_size = block_size
        self.dtype = dtype
        shape = (self.num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a masked-out slot still enters the attention product (0 * NaN = NaN)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.memory_bytes = per_block * self.num_blocks

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]
