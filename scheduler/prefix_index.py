"""The prefix cache of one worker's KV blocks: which full blocks hold which tokens. Pure; no I/O.

A full block is named by a hash of its token ids chained with the hash of the block before it, so one
name stands for the whole prefix up to the block's end (vLLM's and nano-vllm's scheme). The block manager
(scheduler/block_manager.py) keeps the reference counts; this index keeps, for the blocks whose contents
were confirmed written, name <-> block id, and an LRU order of the named blocks no sequence holds, which
are still free to take: one is evicted (its name forgotten) only when a block is needed and no empty one
is left.

A block is named only once a step result confirms its positions were computed (`WorkerPolicy` commits on
each accepted token), never when a plan is sent: a plan that is lost would otherwise leave a named block
that was never written. A named block is full and is never written again: every later position of its
sequence lies in a later block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BlockHash = bytes


def scope_seed(scope: str, salt: str, lora: str = "") -> BlockHash:
    """What a sequence's first block name is chained to: its cache scope (the tenant, or a group of tenants the
    operator lets share), its request's `cache_salt` and its LoRA adapter (LoraRef.key; an adapter computes
    other KV from the same tokens, docs/lora.md). So blocks are shared only within one scope, salt and
    adapter, and a tenant can neither hit nor probe another's prefixes (docs/tenants.md). b"" without any:
    names are what they were before tenants (and a scope without an adapter is named as before adapters)."""
    if not scope and not salt and not lora:
        return b""
    seed = b"phaseserve cache scope\0" + scope.encode() + b"\0" + salt.encode()
    return hashlib.sha256(seed + (b"\0lora\0" + lora.encode() if lora else b"")).digest()


def request_seed(req) -> BlockHash:
    """scope_seed of a SubmitRequest: its cache scope, salt and LoRA adapter."""
    return scope_seed(req.cache_scope, req.cache_salt, req.lora.key if req.lora is not None else "")


def block_hashes(token_ids: list[int], block_size: int, start_block: int = 0,
                 prev: BlockHash | None = None) -> list[BlockHash]:
    """The chained names of the full blocks of `token_ids` from block `start_block` on; `prev` is the name of
    block `start_block - 1` (for the first block: the sequence's `scope_seed`, or None)."""
    n_full = len(token_ids) // block_size
    if start_block >= n_full:
        return []
    data = array("q", token_ids[start_block * block_size:n_full * block_size]).tobytes()
    width = 8 * block_size
    out: list[BlockHash] = []
    h = prev or b""
    for i in range(0, len(data), width):
        h = hashlib.sha256(h + data[i:i + width]).digest()
        out.append(h)
    return out


class PrefixIndex:
    """Named blocks of one worker's cache, and the LRU order of those no sequence holds."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._name_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: oldest first
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._name_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest prefix of `hashes`."""
        blocks = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def holds(self, block: int) -> bool:
        return block in self._name_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def name(self, block: int, h: BlockHash) -> bool:
        """Name a referenced block whose contents were confirmed. False (nothing changes) when the name is
        already another block's (two sequences computed the same prefix at once) or the block has a name."""
        if h in self._block_of or block in self._name_of:
            return False
        self._block_of[h] = block
        self._name_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A named block no sequence holds any more: the most recently used of the idle ones."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle named block a sequence takes again."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block's name; it is empty again."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._name_of.pop(block)]
        self.num_evictions += 1
        return block

    def clear(self) -> list[int]:
        """Forget every name; returns the idle blocks (now empty)."""
        idle = list(self._idle)
        self._block_of.clear()
        self._name_of.clear()
        self._idle.clear()
        return idle
