"""Which LoRA adapters a worker holds, as the scheduler follows it: pure, no I/O.

A worker loads an adapter when a sequence of it first runs there and keeps its --max-loras most recently
used ones (workers/lora.py). The scheduler sends it every sequence, so it keeps the same order itself
instead of asking: routing then prefers a worker that holds a request's adapter (no load from disk, and
its prefix blocks are there), within the same load slack as a cached prefix (scheduler/routing.py).
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_MAX_LORAS = 8  # a worker that does not say (WorkerInfo.max_loras 0: an older one): the worker's default


class AdapterRecency:
    """The adapter keys (LoraRef.key) a worker was last given, at most `limit`, least recent first."""

    def __init__(self, limit: int = 0):
        self.limit = limit or DEFAULT_MAX_LORAS
        self._keys: OrderedDict[str, None] = OrderedDict()

    def use(self, key: str | None) -> None:
        if key is None:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def holds(self, key: str | None) -> bool:
        return key is not None and key in self._keys

    def keys(self) -> list[str]:
        return list(self._keys)
