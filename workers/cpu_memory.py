"""Keep the C heap from handing large blocks back to the kernel between steps.

glibc serves allocations above its mmap threshold (128 KiB to start) with fresh mmap pages and trims
freed heap tops back to the OS. A forward pass allocates and frees the same multi-MiB activations
every layer, so every layer pays first-touch page faults again, which slowed a batched decode attention
call several times over. Raising both thresholds once lets freed blocks be reused; the process keeps its
peak activation memory instead of returning it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# largest allocation still served from the reusable heap: above every activation of a step, far below
# the weights (which are allocated once and never freed)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20  # grow the heap in large steps: fewer brk calls while a step's activations grow

_done = False


def keep_heap_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once). False where malloc is not glibc's."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("mallopt unavailable: heap thresholds left as they are", libc=name)
        return False
    ok = all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES)))
    _done = ok
    return ok


def release_free_heap() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc malloc_trim), e.g. after a load that
    freed weights it converted (quantized at load: the float copies); the raised trim threshold keeps it
    otherwise. False where malloc is not glibc's."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    return trim(0) == 1
