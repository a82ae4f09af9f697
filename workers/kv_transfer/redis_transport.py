"""KV transfer over Redis: one stream per transfer, `<prefix>:kv:<transfer id>`.

Entries, each {h: msgpack header, d: raw bytes}, numbered by `seq` from 0:
  begin  {layout, num_blocks}
  chunk  {piece, piece_blocks, offset, crc (XXH3 of this chunk)}  + at most CHUNK_BYTES of one piece's export bytes
  end    {num_tokens, num_pieces, num_bytes, crc}   (crc: XXH3 over every chunk's bytes, in order)
The stream has an exact MAXLEN of the whole transfer's entry count (a runaway sender cannot grow it) and
an EXPIRE refreshed by every write (an abandoned transfer disappears). The receiver reads it with XREAD
BLOCK and deletes it when done, whatever the outcome.
"""

from __future__ import annotations

import math
import time

import msgpack
import numpy as np
import redis
import structlog
import torch

from phaseserve.wire import Keys
from phaseserve.workers.kv_cache import KVCache
from phaseserve.workers.kv_transfer import (
    CHUNK_BYTES, DEFAULT_TIMEOUT_S, KVLayout, KVLayoutMismatch, KVReceiver, KVSender, KVTransferCorrupt,
    Digest, KVTransferError, KVTransferOutOfOrder, KVTransferTimeout, TransferSummary, apply_pieces, as_bytes,
    check_num_tokens, checksum,
)

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = 60
# chunks per pipeline round trip: enough to keep the socket busy, few enough to bound the client's buffer
PIPELINE_CHUNKS = 16


def transfer_key(prefix: str, transfer_id: str) -> str:
    return Keys(prefix).kv_transfer(transfer_id)


class RedisKVSender(KVSender):
    def __init__(self, client: redis.Redis, transfer_id: str, cache: KVCache, block_ids: list[int], *,
                 prefix: str = "ps", ttl_s: int = DEFAULT_TTL_S, chunk_bytes: int = CHUNK_BYTES):
        super().__init__(transfer_id, cache, block_ids)
        self.client = client
        self.key = transfer_key(prefix, transfer_id)
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        n = len(self.block_ids)
        # begin + end + every chunk; each piece may end in one partial chunk
        self.maxlen = 2 + math.ceil(n * self.layout.piece_bytes_per_block / chunk_bytes) + n
        self.seq = 0
        pipe = self.client.pipeline(transaction=False)
        self._add(pipe, {"k": "begin", "layout": self.layout.to_list(), "num_blocks": n})
        pipe.execute()

    def _add(self, pipe, header: dict, payload=b"") -> None:
        header["seq"] = self.seq
        self.seq += 1
        pipe.xadd(self.key, {"h": msgpack.packb(header), "d": payload}, maxlen=self.maxlen, approximate=False)
        pipe.expire(self.key, self.ttl_s)

    def send_blocks(self, start: int, end: int) -> None:
        self.pieces.add(start, end)
        piece = len(self.pieces.sizes) - 1
        data = as_bytes(self.cache.export_blocks(self.block_ids[start:end]))
        pipe = self.client.pipeline(transaction=False)
        for i, offset in enumerate(range(0, len(data), self.chunk_bytes)):
            chunk = data[offset:offset + self.chunk_bytes]
            self.digest.update(chunk)
            self._add(pipe, {"k": "chunk", "piece": piece, "piece_blocks": end - start, "offset": offset,
                             "crc": checksum(chunk)}, chunk)
            if (i + 1) % PIPELINE_CHUNKS == 0:
                pipe.execute()
        pipe.execute()
        self.num_bytes += len(data)

    def finish(self, num_tokens: int) -> None:
        self.pieces.check_complete()
        check_num_tokens(num_tokens, len(self.block_ids), self.layout.block_size)
        pipe = self.client.pipeline(transaction=False)
        self._add(pipe, {"k": "end", "num_tokens": num_tokens, "num_pieces": len(self.pieces.sizes),
                         "num_bytes": self.num_bytes, "crc": self.digest.value})
        pipe.execute()

    def abort(self) -> None:
        self.client.delete(self.key)


class _Assembly:
    """The receiver's staging: pieces filled chunk by chunk, checked for order and checksums."""

    def __init__(self, transfer_id: str, layout: KVLayout, num_blocks: int):
        self.transfer_id = transfer_id
        self.layout = layout
        self.num_blocks = num_blocks
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.current: tuple[int, torch.Tensor] | None = None
        self.filled = 0
        self.digest = Digest()
        self.num_bytes = 0
        self.blocks = 0

    def chunk(self, h: dict, payload: bytes) -> None:
        seq = h["seq"]
        if checksum(payload) != h["crc"]:
            raise KVTransferCorrupt(f"transfer {self.transfer_id}: chunk {seq} (piece {h['piece']}, offset "
                                    f"{h['offset']}) does not match its checksum")
        if self.current is None:
            n = h["piece_blocks"]
            if h["piece"] != len(self.pieces) or h["offset"] != 0 or n < 1 or self.blocks + n > self.num_blocks:
                raise KVTransferOutOfOrder(f"transfer {self.transfer_id}: chunk {seq} starts piece {h['piece']} "
                                           f"at offset {h['offset']}, expected piece {len(self.pieces)} at 0")
            self.current = (n, torch.empty(n * self.layout.piece_bytes_per_block, dtype=torch.uint8))
            self.filled = 0
        n, buf = self.current
        if h["piece"] != len(self.pieces) or h["offset"] != self.filled or self.filled + len(payload) > buf.numel():
            raise KVTransferOutOfOrder(f"transfer {self.transfer_id}: chunk {seq} (piece {h['piece']}, offset "
                                       f"{h['offset']}) does not continue piece {len(self.pieces)} at {self.filled}")
        buf.numpy()[self.filled:self.filled + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self.filled += len(payload)
        self.digest.update(payload)
        self.num_bytes += len(payload)
        if self.filled == buf.numel():
            self.pieces.append(self.current)
            self.blocks += n
            self.current = None

    def end(self, h: dict) -> int:
        if self.current is not None or self.blocks != self.num_blocks or h["num_pieces"] != len(self.pieces):
            raise KVTransferOutOfOrder(f"transfer {self.transfer_id}: end after {self.blocks} of {self.num_blocks} "
                                       f"blocks in {len(self.pieces)} of {h['num_pieces']} pieces")
        if h["crc"] != self.digest.value or h["num_bytes"] != self.num_bytes:
            raise KVTransferCorrupt(f"transfer {self.transfer_id}: whole-transfer checksum or size differs "
                                    f"({self.num_bytes} bytes received, {h['num_bytes']} sent)")
        check_num_tokens(h["num_tokens"], self.num_blocks, self.layout.block_size)
        return h["num_tokens"]


class RedisKVReceiver(KVReceiver):
    def __init__(self, client: redis.Redis, *, prefix: str = "ps", read_count: int = 32):
        self.client = client
        self.prefix = prefix
        self.read_count = read_count

    def receive(self, transfer_id: str, cache: KVCache, block_ids: list[int],
                timeout: float = DEFAULT_TIMEOUT_S) -> TransferSummary:
        t0 = time.perf_counter()
        key = transfer_key(self.prefix, transfer_id)
        try:
            assembly, num_tokens = self._read(key, transfer_id, cache, block_ids, time.monotonic() + timeout)
            apply_pieces(cache, block_ids, assembly.pieces)
        except KVTransferError as e:
            log.warning("kv transfer failed", transfer_id=transfer_id, error=str(e))
            raise
        finally:
            self.client.delete(key)
        return TransferSummary(transfer_id, len(block_ids), num_tokens, assembly.num_bytes,
                               time.perf_counter() - t0)

    def _read(self, key: str, transfer_id: str, cache: KVCache, block_ids: list[int],
              deadline: float) -> tuple[_Assembly, int]:
        last_id = b"0-0"
        expect = 0
        assembly: _Assembly | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got = "nothing" if assembly is None else f"{assembly.blocks} of {assembly.num_blocks} blocks"
                raise KVTransferTimeout(f"transfer {transfer_id}: incomplete after the timeout ({got} arrived)")
            reply = self.client.xread({key: last_id}, count=self.read_count, block=max(1, int(remaining * 1000)))
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    try:
                        h = msgpack.unpackb(fields[b"h"], raw=False)
                        kind, seq = h["k"], h["seq"]
                    except Exception as e:  # msgpack raises several unrelated types
                        raise KVTransferCorrupt(f"transfer {transfer_id}: unreadable header in entry "
                                                f"{entry_id!r}: {e}") from e
                    if seq != expect:
                        raise KVTransferOutOfOrder(f"transfer {transfer_id}: entry {seq} arrived, expected {expect} "
                                                   "(a chunk is missing or repeated)")
                    expect += 1
                    if kind == "begin":
                        KVLayout.from_list(h["layout"]).check_matches(KVLayout.of(cache))
                        if h["num_blocks"] != len(block_ids):
                            raise KVLayoutMismatch(f"transfer {transfer_id}: {h['num_blocks']} blocks sent, "
                                                   f"{len(block_ids)} destination blocks given")
                        assembly = _Assembly(transfer_id, KVLayout.of(cache), len(block_ids))
                    elif assembly is None:
                        raise KVTransferOutOfOrder(f"transfer {transfer_id}: {kind} before begin")
                    elif kind == "chunk":
                        assembly.chunk(h, fields[b"d"])
                    elif kind == "end":
                        return assembly, assembly.end(h)
                    else:
                        raise KVTransferCorrupt(f"transfer {transfer_id}: unknown entry kind {kind!r}")
