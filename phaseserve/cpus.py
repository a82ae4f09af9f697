"""How many CPUs a worker's model gets: the thread-count rule shared by the worker (workers/service.py) and
the launcher that splits the cores between services (phaseserve/launcher.py). No torch, no service imports."""

from __future__ import annotations

import os
from pathlib import Path

# Above this much weight a step is bound by compute and memory bandwidth, and every core pays;
# below it a step is a few milliseconds of small ops, and a core left to the gateway, scheduler and
# Redis pays more (workload A, one run each: bundled 11 MB model 2283 tok/s on 1 thread vs 1881 on 2;
# 400 MB model 299 tok/s on 2 threads vs 200 on 1 -- README, "Benchmarks").
LARGE_MODEL_BYTES = 100 << 20


def auto_threads(num_threads: int, cores: int, weight_bytes: int) -> int:
    """The worker's torch thread count: the setting if > 0, else chosen by model size."""
    if num_threads > 0:
        return num_threads
    return cores if weight_bytes >= LARGE_MODEL_BYTES else max(1, cores - 1)


def usable_cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def worker_threads(num_threads: int, model_dir: str, cores: int | None = None) -> int:
    """What auto_threads gives for this model folder's weights on `cores` CPUs (default: ours)."""
    weight_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    weight_bytes += sum(f.stat().st_size for f in Path(model_dir).glob("*.gguf"))
    return auto_threads(num_threads, len(usable_cores()) if cores is None else cores, weight_bytes)
