"""One worker's KV cache as the policy sees it: its blocks (scheduler/block_manager.py), the prefix index over
them (scheduler/prefix_index.py), and the counters of both. No I/O.

The policy asks it what is cached for a sequence, allocates slots and frees tables through it, and tells it
when a step result confirmed a sequence's positions. Prefix caching, when on:
- A sequence (re)starts on the longest run of cached full blocks of its prompt + outputs, shared read-only,
  always leaving at least one position to compute (the last one's logits give its next token). Its
  `SeqStart.num_cached` says so, and the worker computes nothing before it.
- Its blocks are named as step results confirm them: once a token is accepted, the positions before it
  are in the cache. A lost plan names nothing.
- A sequence whose next block is being computed right now by another sequence on this worker (the `n`
  choices of one request, or requests sharing a new system prompt) waits for it instead of computing it a
  second time: so `n > 1` prefills once and the other choices fork from its blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from phaseserve.kv_admission import KVCapacity
from phaseserve.scheduler_stats import PrefixCacheStats
from phaseserve.scheduler.block_manager import BlockManager
from phaseserve.scheduler.prefix_index import block_hashes
from phaseserve.scheduler.sequence import Sequence, SequenceStatus


class KVCacheManager:
    """Block accounting and prefix caching for one worker."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float, enable_prefix_caching: bool):
        self.block_manager = BlockManager(num_blocks, block_size, watermark,
                                          enable_prefix_caching=enable_prefix_caching)
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self._queries = 0  # prefill tokens of sequence (re)starts, and those found cached
        self._hits = 0

    # ------------------------------------------------------------------ block figures

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached idle ones included: they are evicted on demand)."""
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def watermark_blocks(self) -> int:
        return self.block_manager.watermark_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.block_manager.blocks_for(num_tokens)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        return self.block_manager.num_new_blocks(block_table, num_tokens)

    def num_promised_blocks(self, seq: Sequence, capacity: KVCapacity) -> int:
        """Blocks a partially-prefilled `seq` will still take: the rest of its prefill and its first decode
        (0 for one that is not prefilling)."""
        if not seq.is_prefilling:
            return 0
        return self.num_new_blocks(seq.block_table, seq.promised_len(capacity, seq.prefill_len))

    def can_allocate(self, num_blocks: int, *, reserved: int = 0) -> bool:
        """Whether `num_blocks` more can be taken for new work, leaving `reserved` and the watermark free."""
        return self.block_manager.can_allocate(num_blocks, reserved=reserved)

    # ------------------------------------------------------------------ allocate and free

    def allocate_slots(self, block_table: list[int], num_tokens: int, n: int) -> None:
        """Grow `block_table` (holding `num_tokens` positions) to hold `n` more; the caller checked room."""
        self.block_manager.append(block_table, num_tokens, n)

    def free(self, block_table: list[int]) -> None:
        """Drop the table's blocks (cached ones stay named until evicted) and empty it."""
        self.block_manager.free(block_table)

    # ------------------------------------------------------------------ what is cached

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks a (re)start of `seq` would share: never its last prefill position's block."""
        if not self.prefix_caching:
            return []
        n_tokens = seq.num_known_tokens
        most = (n_tokens - 1) // self.block_size
        return self.block_manager.cached_blocks(self._known_hashes(seq)[:most])

    def num_cached_tokens(self, prompt_ids: list[int], seed: bytes = b"") -> int:
        """How many leading tokens of `prompt_ids` this worker holds cached in the scope `seed` names
        (`prefix_index.scope_seed`), for routing."""
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        hashes = block_hashes(prompt_ids[:(len(prompt_ids) - 1) // bs * bs], bs, prev=seed or None)
        return len(self.block_manager.cached_blocks(hashes)) * bs

    def blocks_to_admit(self, seq: Sequence, num_blocks: int) -> int:
        """Of the `num_blocks` a (re)start of `seq` needs, how many it takes from the free ones: its cached
        prefix's blocks are there already, but those nobody holds count as free until it takes them."""
        cached = self.computed_blocks(seq)
        return num_blocks - len(cached) + self.block_manager.num_idle(cached)

    def waits_for_prefix(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether the block after `seq`'s cached prefix is being computed by one of `running` now: then
        `seq` starts once that is confirmed, on its blocks."""
        if not self.prefix_caching or seq.on_worker:
            return False
        bs = self.block_size
        n_tokens = seq.num_known_tokens
        hashes = self._known_hashes(seq)
        nxt = len(self.computed_blocks(seq))
        if nxt >= min(len(hashes), (n_tokens - 1) // bs):
            return False
        want = hashes[nxt]
        return any(other.status is SequenceStatus.RUNNING and other.num_named_blocks <= nxt < len(other.block_hashes)
                   and nxt < other.num_computed_tokens // bs and other.block_hashes[nxt] == want
                   for other in running)

    # ------------------------------------------------------------------ sharing and naming

    def start_on_cached_prefix(self, seq: Sequence) -> int:
        """Share the cached blocks of `seq`'s prefix as the start of its (empty) table; returns the cached
        positions. Counts the query and the hit, in tokens."""
        if not self.prefix_caching:
            return 0
        blocks = self.computed_blocks(seq)
        self.block_manager.share(seq.block_table, blocks)
        seq.num_named_blocks = len(blocks)
        cached = len(blocks) * self.block_size
        self._queries += seq.num_known_tokens
        self._hits += cached
        return cached

    def cache_confirmed_blocks(self, seq: Sequence) -> None:
        """After a token of `seq` is accepted: every position before it is in the cache, so each full block
        among them is named (the prefix cache may hand it to other sequences from now on)."""
        if not self.prefix_caching or seq.status is not SequenceStatus.RUNNING:
            return
        bs = self.block_size
        written = seq.num_known_tokens - 1
        full = min(written // bs, len(seq.block_table))
        if full <= seq.num_named_blocks:
            return
        hashes = self._known_hashes(seq)
        for i in range(seq.num_named_blocks, full):
            self.block_manager.name(seq.block_table[i], hashes[i])
        seq.num_named_blocks = full

    def _known_hashes(self, seq: Sequence) -> list[bytes]:
        """The names of the full blocks of the sequence's confirmed tokens (prompt + outputs), kept on it."""
        bs = self.block_size
        known = seq.num_known_tokens
        if len(seq.block_hashes) < known // bs:
            tokens = seq.request.prompt_ids + seq.output_ids if seq.output_ids else seq.request.prompt_ids
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_seed
            seq.block_hashes.extend(block_hashes(tokens, bs, len(seq.block_hashes), prev))
        return seq.block_hashes

    # ------------------------------------------------------------------ stats

    def stats(self) -> PrefixCacheStats:
        bm = self.block_manager
        return PrefixCacheStats(self._queries, self._hits, bm.num_evictions, bm.num_cached_blocks)
