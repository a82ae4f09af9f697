"""KV block accounting: which block ids are free, growing a sequence's block table, and (with prefix caching)
the full blocks shared between sequences.

Pure bookkeeping; the KV tensor itself lives in the worker, which writes only
where a plan tells it to. Every block id in [0, num_blocks) is an ordinary
block (the worker's attention reads only positions < a sequence's length, so
no id needs reserving as padding).

With prefix caching a block is referenced by every sequence whose table holds it. A block no sequence holds
is free: empty, or named in the prefix index (scheduler/prefix_index.py) and kept until a block is needed
and no empty one is left, when the least recently used named one is evicted. So cached blocks count as free
for admission and for the KV figures. A block is only ever taken for a later plan than the ones that read
it, and a worker runs its plans in order: no plan in flight reads a block after it is reused.
"""

from __future__ import annotations

from collections import deque

from phaseserve.kv_admission import cdiv, watermark_blocks
from phaseserve.scheduler.prefix_index import BlockHash, PrefixIndex


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False):
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
        self._free: deque[int] = deque(range(num_blocks))  # empty blocks
        self._refs: dict[int, int] = {}  # block -> sequences holding it
        self.prefix_index: PrefixIndex | None = PrefixIndex() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: empty ones and cached ones that may be evicted."""
        return len(self._free) + (self.prefix_index.num_idle if self.prefix_index else 0)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks named in the prefix index, held by sequences or not."""
        return len(self.prefix_index) if self.prefix_index else 0

    @property
    def num_evictions(self) -> int:
        return self.prefix_index.num_evictions if self.prefix_index else 0

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

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
        return self.num_free_blocks - num_blocks >= floor

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
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        added = [self._take() for _ in range(need)]
        block_table.extend(added)
        return added

    def _take(self) -> int:
        block = self._free.popleft() if self._free else self.prefix_index.evict()
        self._refs[block] = 1
        return block

    def free(self, block_table: list[int]) -> None:
        """Drop the table's reference to each of its blocks and empty the table. A block nobody holds any more
        is free again; a cached one stays named (deeper blocks of the table are evicted before shallower ones,
        which more prompts share)."""
        index = self.prefix_index
        for b in block_table:
            if b not in self._refs:
                raise RuntimeError(f"block {b} freed twice or never allocated")
        released = []
        for b in block_table:
            left = self._refs[b] - 1
            if left:
                self._refs[b] = left
            else:
                del self._refs[b]
                released.append(b)
        cached = [b for b in released if index is not None and index.holds(b)]
        self._free.extend(b for b in released if index is None or not index.holds(b))
        for b in reversed(cached):
            index.park(b)
        block_table.clear()

    # ------------------------------------------------------------------ prefix caching

    def cached_blocks(self, hashes: list[BlockHash]) -> list[int]:
        """The cached blocks holding the longest prefix of the blocks named `hashes` (none when caching is off)."""
        return self.prefix_index.lookup(hashes) if self.prefix_index is not None else []

    def num_idle(self, blocks: list[int]) -> int:
        """How many of `blocks` (cached) no sequence holds: sharing them takes them out of the free count."""
        return sum(1 for b in blocks if b not in self._refs)

    def share(self, block_table: list[int], blocks: list[int]) -> None:
        """Start the empty `block_table` with cached `blocks`, read-only: a reference to each."""
        assert not block_table, "a shared prefix starts a table"
        for b in blocks:
            n = self._refs.get(b, 0)
            if n == 0:
                self.prefix_index.unpark(b)
            self._refs[b] = n + 1
        block_table.extend(blocks)

    def name(self, block: int, h: BlockHash) -> None:
        """A held, full block whose contents a step result confirmed: cache it under its name (a block
        already cached under another name, or a name another block already has, stays as it is)."""
        if self.prefix_index is not None:
            assert block in self._refs, f"naming block {block} that no sequence holds"
            self.prefix_index.name(block, h)

    def forget_cache(self) -> None:
        """Evict every idle cached block (the worker's cache can no longer be trusted to hold them)."""
        if self.prefix_index is not None:
            self._free.extend(self.prefix_index.clear())
