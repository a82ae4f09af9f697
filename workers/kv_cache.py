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

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """(block_size, num_kv_heads, head_dim): one block of one layer's K (or V)."""
        return tuple(self.k[0].shape[1:])

    def export_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The layout export_blocks writes: [layer, K|V, block, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, num_blocks, *self.block_shape)

    def export_nbytes(self, num_blocks: int) -> int:
        return bytes_per_block(self.num_layers, self.block_shape[1], self.block_shape[2], self.block_size,
                               self.dtype) * num_blocks

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        if not block_ids:
            raise ValueError("no block ids given")
        if min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks}): {block_ids}")
        return torch.tensor(block_ids, dtype=torch.int64, device=self.k[0].device)

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather the K and V of `block_ids` (every layer) into one contiguous host tensor of
        export_shape(len(block_ids)): one index_select per layer and K/V, straight into `out` on CPU.
        On a GPU the gather runs on the device and is copied to `out` (pass a pinned buffer there)."""
        idx = self._index(block_ids)
        shape = self.export_shape(len(block_ids))
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"export buffer must be a contiguous {self.dtype} tensor of shape {shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        on_host = self.k[0].device.type == "cpu"
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if on_host:
                torch.index_select(k, 0, idx, out=out[i, 0])
                torch.index_select(v, 0, idx, out=out[i, 1])
            else:
                out[i, 0].copy_(k.index_select(0, idx), non_blocking=True)
                out[i, 1].copy_(v.index_select(0, idx), non_blocking=True)
        if not on_host:
            torch.cuda.current_stream(self.k[0].device).synchronize()  # `out` is read by the host next
        return out

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Scatter a tensor laid out as export_blocks writes it into `block_ids` (every layer):
        one index_put_ per layer and K/V. `data` may be any dtype view of the same bytes (uint8 from a
        socket or shared memory): it is reinterpreted, never converted."""
        idx = self._index(block_ids)
        shape = self.export_shape(len(block_ids))
        if data.dtype != self.dtype:
            if data.dtype != torch.uint8 or not data.is_contiguous():
                raise ValueError(f"import data must be {self.dtype} or contiguous uint8, got {data.dtype}")
            if data.numel() != self.export_nbytes(len(block_ids)):
                raise ValueError(f"import data has {data.numel()} bytes, {len(block_ids)} blocks need "
                                 f"{self.export_nbytes(len(block_ids))}")
            data = data.view(self.dtype)
        data = data.reshape(shape)
        device = self.k[0].device
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            # index_put_, not index_copy_: the faster of the two on CPU for whole-block rows
            k.index_put_((idx,), data[i, 0].to(device, non_blocking=True))
            v.index_put_((idx,), data[i, 1].to(device, non_blocking=True))
