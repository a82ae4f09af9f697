"""KV transfer between workers on one host: a file in /dev/shm per transfer, mapped by both ends.

Layout: a HEADER_BYTES header, then the pieces' export bytes back to back (the same bytes, in the same
order, as the Redis transport's chunks, so the same checksum). The sender exports each piece straight into
the mapping (no copy beyond the gather); `finish` writes the msgpack description, then the fixed header with
the magic last: a receiver that sees the magic sees a complete transfer. The receiver verifies the checksum
over the mapping and scatters from it into its cache (the mapping is the staging buffer), then unlinks the
file. A plain file rather than multiprocessing.shared_memory: Python 3.11's resource tracker unlinks
segments that an attaching process registered when that process exits.

Private: the files live in a directory of the stack's own (`private_dir`, mode 0700, owned by the
workers' user), their names carry the scheduler's random transfer ids, and the receiver maps a file only
if it is a regular file of its own user that no one else can read or write. Another local user can
neither read a prompt's KV nor plant a file for a receiver to apply.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import time
from pathlib import Path

import msgpack
import structlog
import torch

from phaseserve.workers.kv_cache import KVCache
from phaseserve.workers.kv_transfer import (
    DEFAULT_TIMEOUT_S, KVLayout, KVLayoutMismatch, KVReceiver, KVSender, KVTransferCorrupt, KVTransferError,
    KVTransferTimeout, TransferSummary, apply_pieces, as_bytes, check_num_tokens, checksum,
)

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096
MAGIC = b"PSKV0001"
FIXED = struct.Struct("<8sQIIQ")  # magic, checksum, num_tokens, description length, payload bytes
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
POLL_S = 0.0005
POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


def private_dir(stack: str, base: Path = SHM_DIR) -> Path:
    """The stack's transfer directory (stack: its key prefix), made 0700 if absent; a clear error if it exists
    but is not this user's alone (another user made it first, or it is a link)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", stack)[:64]
    path = base / f"phaseserve-kv-{os.geteuid()}-{safe}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private(path, directory=True)
    return path


def check_private(path: Path, directory: bool = False, st: os.stat_result | None = None) -> None:
    """Refuse what this user does not own alone: another owner, group or other permissions, a link, or a file of
    the wrong kind (st: the stat of an open file, so what is checked is what gets mapped)."""
    st = st or os.lstat(path)
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise KVTransferError(f"{path} is not private to this user (owner uid {st.st_uid}, mode "
                              f"{stat.filemode(st.st_mode)}; want uid {os.geteuid()}, no group or other access): "
                              "refused")


def transfer_path(transfer_id: str, directory: Path) -> Path:
    if not _SAFE_ID.match(transfer_id):
        raise ValueError(f"transfer id {transfer_id!r}: use 1-128 letters, digits, '.', '_' or '-'")
    return directory / f"phaseserve-kv-{transfer_id}"


def remove_stale_transfers(max_age_s: float, directory: Path) -> int:
    """Unlink transfer files untouched for max_age_s: ones whose receiver never came (its worker died, or
    the scheduler gave the sequence to another). Run now and then by whoever owns the host's workers."""
    now = time.time()
    removed = 0
    for path in directory.glob("phaseserve-kv-*"):
        try:
            if now - path.stat().st_mtime > max_age_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # its receiver took it meanwhile
            pass
    if removed:
        log.info("removed stale kv transfers", count=removed, directory=str(directory))
    return removed


class ShmKVSender(KVSender):
    def __init__(self, transfer_id: str, cache: KVCache, block_ids: list[int], *, directory: Path):
        super().__init__(transfer_id, cache, block_ids)
        check_private(directory, directory=True)
        self.path = transfer_path(transfer_id, directory)
        self.total = len(self.block_ids) * self.layout.piece_bytes_per_block
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise KVTransferError(f"transfer id {transfer_id} is in use ({self.path}); a retry needs a new id") from None
        try:
            os.ftruncate(fd, HEADER_BYTES + self.total)
            # no MAP_POPULATE here: allocating and zeroing fresh tmpfs pages is the cost either way (populating
            # up front measured slower); a pool of reused segments would avoid it
            self.mm = mmap.mmap(fd, HEADER_BYTES + self.total)
        finally:
            os.close(fd)

    def send_blocks(self, start: int, end: int) -> None:
        self.pieces.add(start, end)
        n = end - start
        count = n * self.layout.piece_bytes_per_block
        region = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER_BYTES + self.num_bytes, count=count)
        out = region.view(self.cache.dtype).view(self.cache.export_shape(n))
        self.cache.export_blocks(self.block_ids[start:end], out=out)
        self.digest.update(as_bytes(region))
        self.num_bytes += count
        del region, out  # the mapping cannot close while a tensor views it

    def finish(self, num_tokens: int) -> None:
        self.pieces.check_complete()
        check_num_tokens(num_tokens, len(self.block_ids), self.layout.block_size)
        desc = msgpack.packb({"layout": self.layout.to_list(), "pieces": self.pieces.sizes})
        if FIXED.size + len(desc) > HEADER_BYTES:
            raise KVTransferError(f"transfer {self.transfer_id}: {len(self.pieces.sizes)} pieces do not fit the "
                                  "shared-memory header; send fewer, larger ranges")
        self.mm[FIXED.size:FIXED.size + len(desc)] = desc
        self.mm[:FIXED.size] = FIXED.pack(b"\0" * 8, self.digest.value, num_tokens, len(desc), self.total)
        self.mm[:len(MAGIC)] = MAGIC  # last: the commit mark
        self.mm.close()

    def abort(self) -> None:
        if not self.mm.closed:
            self.mm.close()
        self.path.unlink(missing_ok=True)


class ShmKVReceiver(KVReceiver):
    def __init__(self, *, directory: Path):
        check_private(directory, directory=True)
        self.directory = directory

    def receive(self, transfer_id: str, cache: KVCache, block_ids: list[int],
                timeout: float = DEFAULT_TIMEOUT_S) -> TransferSummary:
        t0 = time.perf_counter()
        path = transfer_path(transfer_id, self.directory)
        try:
            mm = self._wait(path, transfer_id, time.monotonic() + timeout)
            try:
                num_tokens, num_bytes = self._apply(mm, transfer_id, cache, block_ids)
            finally:
                mm.close()
        except KVTransferError as e:
            log.warning("kv transfer failed", transfer_id=transfer_id, error=str(e))
            raise
        finally:
            path.unlink(missing_ok=True)
        return TransferSummary(transfer_id, len(block_ids), num_tokens, num_bytes, time.perf_counter() - t0)

    @staticmethod
    def _wait(path: Path, transfer_id: str, deadline: float) -> mmap.mmap:
        """Map the file once its header carries the magic (the sender's commit mark)."""
        mm = None
        while True:
            if mm is None:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                except FileNotFoundError:
                    fd = None
                except OSError as e:  # a link (ELOOP), or not ours to open
                    raise KVTransferError(f"transfer {transfer_id}: cannot open {path}: {e.strerror}: refused") from e
                if fd is not None:
                    try:
                        st = os.fstat(fd)
                        check_private(path, st=st)  # only a file its sender (this user) made, readable by no one else
                        if st.st_size >= HEADER_BYTES:  # created but not yet sized: look again
                            # the pages exist: map them all in one call instead of one fault per page
                            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | POPULATE)
                    finally:
                        os.close(fd)
            if mm is not None and mm[:len(MAGIC)] == MAGIC:
                return mm
            if time.monotonic() >= deadline:
                if mm is not None:
                    mm.close()
                state = "started but never finished" if mm is not None else "never started"
                raise KVTransferTimeout(f"transfer {transfer_id}: {state} within the timeout")
            time.sleep(POLL_S)

    @staticmethod
    def _apply(mm: mmap.mmap, transfer_id: str, cache: KVCache, block_ids: list[int]) -> tuple[int, int]:
        _, crc, num_tokens, desc_len, total = FIXED.unpack(mm[:FIXED.size])
        try:
            desc = msgpack.unpackb(mm[FIXED.size:FIXED.size + desc_len], raw=False)
            layout, sizes = KVLayout.from_list(desc["layout"]), [int(n) for n in desc["pieces"]]
        except Exception as e:  # msgpack raises several unrelated types
            raise KVTransferCorrupt(f"transfer {transfer_id}: unreadable header: {e}") from e
        layout.check_matches(KVLayout.of(cache))
        if sum(sizes) != len(block_ids):
            raise KVLayoutMismatch(f"transfer {transfer_id}: {sum(sizes)} blocks sent, "
                                   f"{len(block_ids)} destination blocks given")
        if HEADER_BYTES + total != len(mm) or total != sum(sizes) * layout.piece_bytes_per_block:
            raise KVTransferCorrupt(f"transfer {transfer_id}: payload size {total} does not match its pieces")
        check_num_tokens(num_tokens, len(block_ids), layout.block_size)
        payload = torch.frombuffer(mm, dtype=torch.uint8, offset=HEADER_BYTES, count=total)
        pieces: list = []
        try:
            if checksum(as_bytes(payload)) != crc:
                raise KVTransferCorrupt(f"transfer {transfer_id}: checksum differs")
            per_block = layout.piece_bytes_per_block
            pieces, at = [], 0
            for n in sizes:
                pieces.append((n, payload[at:at + n * per_block]))
                at += n * per_block
            apply_pieces(cache, block_ids, pieces)
        finally:
            del payload, pieces  # views of the mapping must go before it closes
        return num_tokens, total
