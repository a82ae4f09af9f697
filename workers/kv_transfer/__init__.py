"""Moving one sequence's KV blocks from a prefill worker's cache into blocks the scheduler allocated on a
decode worker's cache. See docs/kv-transfer.md.

The unit is a *transfer*: one sequence, identified by a transfer id the scheduler makes up (never reused: a
retry gets a new id). Its source is a list of block ids on the sender's KVCache; its destination is a list of
as many block ids on the receiver's KVCache, plus the number of valid tokens (the last block may be partial).

- `KVSender(transfer_id, cache, block_ids)`: `send_blocks(start, end)` ships source blocks
  block_ids[start:end] (every layer, K and V) as soon as the prefill has written them, so the transfer
  overlaps the prompt's remaining chunks; calls must tile [0, len(block_ids)) in order. `finish(num_tokens)`
  closes the transfer with the checksum of everything sent. `abort()` gives up and frees what the transport
  holds.
- `KVReceiver.receive(transfer_id, cache, block_ids, timeout)` waits for the whole transfer, verifies every
  chunk's and the whole transfer's checksum, and only then writes the destination blocks: never half-applied.
  It raises a KVTransferError subclass naming what went wrong (timeout, corrupt, missing or out-of-order
  chunk, a layout that does not match).

Why the receiver stages: a failed transfer (dead sender, corrupt chunk) must leave the destination blocks
exactly as they were, so the scheduler can recompute the sequence into them or hand them to another one
without reasoning about a half-written state; the extra host copy is far faster than any transport
moves bytes. The shared-memory transport stages for free: its segment *is* the staging buffer.

The payload is the same bytes in both transports: a sequence of *pieces*, one per send_blocks call, each the
raw bytes of KVCache.export_blocks (layout [layer, K|V, block, block_size, kv_heads, head_dim], the cache's
dtype, no pickling), and the checksum is XXH3-64 over those bytes in order. On a GPU the sender's
export gathers on the device and copies into a pinned host staging buffer (KVCache.export_blocks(out=...));
an RDMA transport (NIXL, Mooncake) would instead register the cache tensors and read the blocks directly,
which this interface allows: nothing in it names host memory, only block ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import xxhash

from phaseserve.workers.kv_cache import KVCache

# One stream entry (Redis) carries at most this much payload: no multi-megabyte message blocks Redis's
# event loop or a reader's socket buffer.
CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 30.0


class KVTransferError(RuntimeError):
    """A transfer that cannot be applied; nothing was written to the destination blocks."""


class KVTransferTimeout(KVTransferError):
    """The transfer did not complete in time (its sender died, or never started)."""


class KVTransferCorrupt(KVTransferError):
    """A chunk's bytes do not match their checksum, or the whole transfer's does not."""


class KVTransferOutOfOrder(KVTransferError):
    """A chunk or piece is missing, repeated or arrived out of order."""


class KVLayoutMismatch(KVTransferError):
    """The sender's cache layout (layers, heads, block size, dtype) or block count differs from the receiver's."""


def checksum(data) -> int:
    """One chunk's checksum: 64-bit XXH3, the fastest of the hashes measured against it (zlib.crc32, sha1,
    blake2b). It catches corruption, not an adversary."""
    return xxhash.xxh3_64_intdigest(data)


class Digest:
    """The whole transfer's checksum: XXH3 over every piece's bytes in order, however they were split
    (Redis chunks, shared-memory pieces), so both transports agree on it."""

    def __init__(self):
        self._h = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._h.update(data)

    @property
    def value(self) -> int:
        return self._h.intdigest()


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's raw bytes without a copy (bf16 has no numpy dtype: view it as uint8 first)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class KVLayout:
    """What both ends must agree on for the bytes to mean the same thing."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float32"

    @classmethod
    def of(cls, cache: KVCache) -> "KVLayout":
        bs, h, d = cache.block_shape
        return cls(cache.num_layers, bs, h, d, str(cache.dtype).removeprefix("torch."))

    def to_list(self) -> list:
        return [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype]

    @classmethod
    def from_list(cls, x: list) -> "KVLayout":
        return cls(int(x[0]), int(x[1]), int(x[2]), int(x[3]), str(x[4]))

    @property
    def piece_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def check_matches(self, other: "KVLayout") -> None:
        if self != other:
            raise KVLayoutMismatch(f"sender's KV layout {self} differs from the receiver's {other}")


@dataclass
class TransferSummary:
    transfer_id: str
    num_blocks: int
    num_tokens: int
    num_bytes: int
    seconds: float  # receive() call to blocks applied


def check_num_tokens(num_tokens: int, num_blocks: int, block_size: int) -> None:
    """The last block holds 1..block_size valid tokens."""
    if not (num_blocks - 1) * block_size < num_tokens <= num_blocks * block_size:
        raise KVTransferError(f"{num_tokens} tokens do not fill the last of {num_blocks} blocks of {block_size}")


class PieceTracker:
    """The sender's side of the ordering rule: send_blocks ranges tile [0, num_blocks) in order."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.sent = 0
        self.sizes: list[int] = []  # blocks per piece, in order

    def add(self, start: int, end: int) -> None:
        if start != self.sent or not start < end <= self.num_blocks:
            raise KVTransferOutOfOrder(
                f"send_blocks({start}, {end}): the next range must start at block {self.sent} and end within "
                f"({self.sent}, {self.num_blocks}]")
        self.sent = end
        self.sizes.append(end - start)

    def check_complete(self) -> None:
        if self.sent != self.num_blocks:
            raise KVTransferOutOfOrder(f"finish() after {self.sent} of {self.num_blocks} blocks were sent")


def apply_pieces(cache: KVCache, block_ids: list[int], pieces: list[tuple[int, torch.Tensor]]) -> None:
    """Write verified pieces (blocks-in-piece, uint8 bytes in export layout) into the destination blocks,
    in order: piece i covers the next `n` destination block ids."""
    at = 0
    for n, data in pieces:
        cache.import_blocks(block_ids[at:at + n], data)
        at += n
    if at != len(block_ids):
        raise KVTransferOutOfOrder(f"pieces cover {at} blocks, the destination has {len(block_ids)}")


class KVSender(ABC):
    """Ships the blocks of one sequence, piece by piece, then closes the transfer."""

    def __init__(self, transfer_id: str, cache: KVCache, block_ids: list[int]):
        if not block_ids:
            raise ValueError("a KV transfer needs at least one block")
        self.transfer_id = transfer_id
        self.cache = cache
        self.block_ids = list(block_ids)
        self.layout = KVLayout.of(cache)
        self.pieces = PieceTracker(len(self.block_ids))
        self.digest = Digest()
        self.num_bytes = 0

    def update_block_ids(self, known: list[int]) -> None:
        """The source blocks known so far, a prefix of the list (a chunked prefill learns its later blocks
        chunk by chunk; a sender may be opened with placeholders for them)."""
        n = min(len(known), len(self.block_ids))
        self.block_ids[:n] = known[:n]

    @abstractmethod
    def send_blocks(self, start: int, end: int) -> None:
        """Ship source blocks block_ids[start:end] (every layer); ranges must tile the list in order."""

    @abstractmethod
    def finish(self, num_tokens: int) -> None:
        """Close the transfer: num_tokens valid tokens, the checksum of all pieces sent."""

    def send_all(self, num_tokens: int) -> None:
        self.send_blocks(0, len(self.block_ids))
        self.finish(num_tokens)

    @abstractmethod
    def abort(self) -> None:
        """Give up: free whatever the transport holds for this transfer (the receiver then times out)."""


class KVReceiver(ABC):
    """Waits for whole transfers and applies them into destination blocks."""

    @abstractmethod
    def receive(self, transfer_id: str, cache: KVCache, block_ids: list[int],
                timeout: float = DEFAULT_TIMEOUT_S) -> TransferSummary:
        """Block until the transfer has arrived and verified, then write it into `block_ids`.
        Raises a KVTransferError (nothing written) otherwise; the transport's copy is freed either way."""
