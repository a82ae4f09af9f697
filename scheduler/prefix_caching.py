"""The prefix-caching bookkeeping of a worker's policy: a sequence starting on blocks that already hold its
prefix, and naming its blocks once their contents are confirmed. No I/O; the index is
scheduler/prefix_cache.py, the reference counts scheduler/block_manager.py.

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

import structlog

from scheduler.prefix_cache import block_hashes
from scheduler.sequence import Sequence, SequenceStatus

log = structlog.get_logger("scheduler.policy")


class PrefixCacheBookkeeping:
    """The part of `WorkerPolicy` that shares cached prefixes; it works on the policy's sequences and blocks."""

    @property
    def prefix_caching(self) -> bool:
        return self.block_manager.prefix_index is not None

    def _known_hashes(self, seq: Sequence) -> list[bytes]:
        """The names of the full blocks of the sequence's confirmed tokens (prompt + outputs), kept on it."""
        bs = self.block_manager.block_size
        known = seq.num_prompt_tokens + len(seq.output_ids)
        if len(seq.block_hashes) < known // bs:
            tokens = seq.request.prompt_ids + seq.output_ids if seq.output_ids else seq.request.prompt_ids
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_seed
            seq.block_hashes.extend(block_hashes(tokens, bs, len(seq.block_hashes), prev))
        return seq.block_hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a (re)start of `seq` would share: never its last prefill position's block."""
        if not self.prefix_caching:
            return []
        n_tokens = seq.num_prompt_tokens + len(seq.output_ids)
        most = (n_tokens - 1) // self.block_manager.block_size
        return self.block_manager.cached_blocks(self._known_hashes(seq)[:most])

    def num_cached_tokens(self, prompt_ids: list[int], seed: bytes = b"") -> int:
        """How many leading tokens of `prompt_ids` this worker holds cached in the scope `seed` names
        (`prefix_cache.scope_seed`), for routing."""
        if not self.prefix_caching:
            return 0
        bs = self.block_manager.block_size
        hashes = block_hashes(prompt_ids[:(len(prompt_ids) - 1) // bs * bs], bs, prev=seed or None)
        return len(self.block_manager.cached_blocks(hashes)) * bs

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether the block after `seq`'s cached prefix is being computed by a running sequence here: then
        `seq` starts once that is confirmed, on its blocks."""
        if not self.prefix_caching or seq.on_worker:
            return False
        n_tokens = seq.num_prompt_tokens + len(seq.output_ids)
        hashes = self._known_hashes(seq)
        nxt = len(self.cached_prefix(seq))
        if nxt >= min(len(hashes), (n_tokens - 1) // self.block_manager.block_size):
            return False
        want = hashes[nxt]
        bs = self.block_manager.block_size
        for other in self._running:
            if other.status is SequenceStatus.RUNNING and other.num_named_blocks <= nxt < len(other.block_hashes) \
                    and nxt < other.num_computed_tokens // bs and other.block_hashes[nxt] == want:
                return True
        return False

    def _start_on_cached_prefix(self, seq: Sequence) -> int:
        """Share the cached blocks of `seq`'s prefix as the start of its (empty) table; returns the cached
        positions. Counts the query and the hit, in tokens."""
        if not self.prefix_caching:
            return 0
        blocks = self.cached_prefix(seq)
        self.block_manager.share(seq.block_table, blocks)
        seq.num_named_blocks = len(blocks)
        cached = len(blocks) * self.block_manager.block_size
        self._num_prefix_queries += seq.num_prompt_tokens + len(seq.output_ids)
        self._num_prefix_hits += cached
        return cached

    def _blocks_to_admit(self, seq: Sequence, num_blocks: int) -> int:
        """Of the `num_blocks` a (re)start of `seq` needs, how many it takes from the free ones: its cached
        prefix's blocks are there already, but those nobody holds count as free until it takes them."""
        cached = self.cached_prefix(seq)
        return num_blocks - len(cached) + self.block_manager.num_idle(cached)

    def _name_confirmed_blocks(self, seq: Sequence) -> None:
        """After a token of `seq` is accepted: every position before it is in the cache, so each full block
        among them is named (the prefix cache may hand it to other sequences from now on)."""
        if not self.prefix_caching or seq.status is not SequenceStatus.RUNNING:
            return
        bs = self.block_manager.block_size
        written = seq.num_prompt_tokens + len(seq.output_ids) - 1
        full = min(written // bs, len(seq.block_table))
        if full <= seq.num_named_blocks:
            return
        hashes = self._known_hashes(seq)
        for i in range(seq.num_named_blocks, full):
            self.block_manager.name(seq.block_table[i], hashes[i])
        seq.num_named_blocks = full
