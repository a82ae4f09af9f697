"""KV block accounting: which block ids are free, and growing a sequence's block table.

Pure bookkeeping; the KV tensor itself lives in the worker, which writes only
where a plan tells it to. Every block id in [0, num_blocks) is an ordinary
block (the worker's attention reads only positions < a sequence's length, so
no id needs reserving as padding).
"""

from __future__ import annotations

from collections import deque

from phaseserve.kv_admission import cdiv, watermark_blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # blocks kept free when admitting new work, so running decodes can grow without preempting at once
        self.watermark_blocks = watermark_blocks(num_blocks, watermark)
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold positions [0, num_tokens)."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to `block_table` so that it holds positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_allocate(self, num_blocks: int, *, reserved: int = 0, use_watermark: bool = True) -> bool:
        """Whether `num_blocks` more can be taken, leaving `reserved` blocks (promised elsewhere)
        plus, for new admissions, the watermark free."""
        floor = reserved + (self.watermark_blocks if use_watermark else 0)
        return len(self._free) - num_blocks >= floor

    def allocate(self, num_tokens: int) -> list[int]:
        """A new block table holding positions [0, num_tokens)."""
        table: list[int] = []
        self.append(table, 0, num_tokens)
        return table

    def append(self, block_table: list[int], num_tokens: int, n: int) -> list[int]:
        """Grow `block_table` (which holds `num_tokens` positions) in place to hold `n` more.

        Returns the block ids added. Raises if the free pool cannot cover them:
        callers check first, so running out here is a bug, not a policy decision.
        """
        need = self.num_new_blocks(block_table, num_tokens + n)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        added = [self._free.popleft() for _ in range(need)]
        self._used.update(added)
        block_table.extend(added)
        return added

    def free(self, block_table: list[int]) -> None:
        """Return every block of `block_table` to the pool and empty the table."""
        for b in block_table:
            if b not in self._used:
                raise RuntimeError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)
        block_table.clear()
