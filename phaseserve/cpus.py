"""How many CPUs a worker's model gets: the thread-count rule shared by the worker (workers/service.py) and
the launcher that splits the cores between services (stack/launcher.py).

The choice is measured, once per model and machine: a child process (`python -m phaseserve.workers.thread_probe MODEL`)
loads the model and times a small fixed decode step (a representative batch) with every usable core and
with one core fewer, alternating, for a bounded time (PROBE_BUDGET_S of timing: a start stays in seconds).
A step on every core also pays for the rest of the service (gateway, scheduler, relay, Redis: their CPU
per step lands on the model's cores and stalls its threads at every barrier); with a core kept free it
runs beside the model, and the step takes the longer of the two. The fewer-threads choice wins unless its
step is longer than the all-cores step plus that service time. The answer is cached in
`<cache dir>/threads.json` (keyed by CPU, core count and model files). Contended threads time slower, so an
answer timed while other processes kept the machine busy is cached marked busy: a later start on a machine
still busy uses it (timing again there would only repeat the contention) and says so in one line, and the
first start that finds the machine quiet times again and keeps that answer. Where the model cannot be timed
(or the child overruns PROBE_TIMEOUT_S) the choice is by model size, and cached as well. The launcher's
core split and the worker it starts read the same answer. This module imports no torch itself: the
launcher must not pay for it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# The fallback when the model cannot be timed: above this much weight a step is bound by compute and
# memory bandwidth, below it a core left to the service pays more (docs/decisions.md, "Threads and cores").
LARGE_MODEL_BYTES = 100 << 20

# The batch the step is timed at: workload A's concurrency, and what a busy worker runs.
PROBE_BATCH = 16
# CPU seconds the gateway, scheduler, relay and Redis spend per decoded token, measured per process of
# `phaseserve up` on workload A (bench/results/2026-11-23-worker-threads.md) ...
SERVICE_CPU_PER_TOKEN_S = 0.21e-3
# ... when PYTHON_WORK (msgpack and dict work like theirs) took this long here; scaled by its time on the
# machine at hand, since that code runs as fast as the CPU runs Python, not as fast as it multiplies.
PYTHON_WORK_REFERENCE_S = 0.00137
# Seconds of decode steps the probe times (thread counts alternating; at least one round): bounded, so a
# slow CPU or a busy machine costs a start a few seconds, not minutes.
PROBE_BUDGET_S = 3.0
# The probe child's whole life: loading the model and compiling its native ops on a first start, then the
# timing. Past it the choice is by size.
PROBE_TIMEOUT_S = 180.0
# Other processes' load (cores) above which a timing counts as made on a busy machine.
BUSY_MACHINE_CORES = 0.3
# Seconds a start samples the machine's load for, to tell whether a busy machine's timing may be redone.
BUSY_CHECK_S = 0.5


@dataclass
class ThreadChoice:
    threads: int
    reason: str


def auto_threads(num_threads: int, cores: int, weight_bytes: int) -> int:
    """The fallback rule by model size: the setting if > 0, else every core for a large model, one fewer for a small."""
    if num_threads > 0:
        return num_threads
    return cores if weight_bytes >= LARGE_MODEL_BYTES else max(1, cores - 1)


def choose_threads(step_s: dict[int, float], cores: int, service_s: float) -> ThreadChoice:
    """From measured decode step seconds per thread count: `cores` threads cost their step plus the
    service's CPU per step (it runs on the model's cores); fewer threads leave it a core, and a step then
    takes the longer of the model's step and the service's work."""
    def cost(n: int) -> float:
        return step_s[n] + service_s if n >= cores else max(step_s[n], service_s)

    best = min(step_s, key=lambda n: (cost(n), n))
    measured = ", ".join(f"{n} thread{'s' * (n > 1)} {step_s[n] * 1e3:.1f} ms" for n in sorted(step_s))
    return ThreadChoice(best, f"decode step at batch {PROBE_BATCH}: {measured}; the rest of the service "
                              f"~{service_s * 1e3:.1f} ms CPU a step")


def usable_cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def model_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    return sorted([*root.glob("*.safetensors"), *root.glob("*.gguf")])


def worker_threads(num_threads: int, model_dir: str, cores: int | None = None) -> int:
    """The worker's torch thread count for this model folder on `cores` CPUs (default: ours)."""
    return thread_choice(num_threads, model_dir, cores).threads


def thread_choice(num_threads: int, model_dir: str, cores: int | None = None) -> ThreadChoice:
    """The thread count and why: the setting if > 0; else measured (or cached) when there is a choice."""
    cores = len(usable_cores()) if cores is None else cores
    if num_threads > 0:
        return ThreadChoice(num_threads, "set (--num-threads, or the launcher's share of the cores)")
    if cores <= 1:
        return ThreadChoice(1, "one usable CPU")
    files = model_files(model_dir)
    weight_bytes = sum(f.stat().st_size for f in files)
    if not (Path(model_dir) / "config.json").is_file():
        return ThreadChoice(auto_threads(0, cores, weight_bytes), "no config.json to load the model from: by size")
    key = cache_key(model_dir, files, cores)
    cached = read_cache().get(key)
    why = "once for this model and machine"
    if isinstance(cached, dict) and isinstance(cached.get("threads"), int) and 1 <= cached["threads"] <= cores:
        kept = ThreadChoice(cached["threads"], f"{cached.get('reason')} (measured {cached.get('measured_at')})")
        if not cached.get("busy"):
            return kept
        others = others_load(BUSY_CHECK_S)
        if others > BUSY_MACHINE_CORES:
            kept.reason += (f"; timed on a busy machine and still busy ({others:.1f} cores used by other "
                            "processes): kept until a quiet start times it again")
            log.info("worker threads from a busy machine's timing", threads=kept.threads, reason=kept.reason)
            return kept
        why = "again: the last timing ran on a busy machine, and it is quiet now"
    counts = [cores - 1, cores]
    log.info(f"timing the model on different thread counts ({why})",
             model=model_dir, threads=counts, budget_s=PROBE_BUDGET_S)
    busy = False
    try:
        step_s, others = probe(model_dir, counts)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("could not time the model; choosing threads by its size", error=str(e))
        # kept like a measured answer: timing it again would fail again, and cost every start
        choice = ThreadChoice(auto_threads(0, cores, weight_bytes), f"timing failed ({e}): by size")
    else:
        choice = choose_threads(step_s, cores, service_cpu_per_step())
        busy = others > BUSY_MACHINE_CORES
        if busy:
            choice.reason += (f"; other processes used {others:.1f} cores meanwhile: timed again on the first "
                              "quiet start")
    write_cache(key, {"threads": choice.threads, "reason": choice.reason, "busy": busy,
                      "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    log.info("worker threads chosen", threads=choice.threads, reason=choice.reason)
    return choice


def probe(model_dir: str, counts: list[int]) -> tuple[dict[int, float], float]:
    """Decode step seconds per thread count, timed in a child process (its own torch, its own threads), and
    how many cores other processes kept busy meanwhile (0 where /proc/stat is missing)."""
    busy0, wall0 = machine_busy_s(), time.monotonic()
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-m", "phaseserve.workers.thread_probe", model_dir, out.name,
                               ",".join(map(str, counts)), str(PROBE_BUDGET_S)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT_S, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            raise ValueError(f"exit code {proc.returncode}: {lines[-1] if lines else 'no output'}")
        step_s = {int(n): float(t) for n, t in json.loads(Path(out.name).read_text()).items()}
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
    others = max(0.0, machine_busy_s() - busy0 - ours) / max(1e-9, time.monotonic() - wall0)
    return step_s, others


def others_load(seconds: float) -> float:
    """How many cores other processes keep busy, sampled over `seconds` (0 where /proc/stat is missing)."""
    busy0, own0, wall0 = machine_busy_s(), _own_cpu_s(), time.monotonic()
    time.sleep(seconds)
    others = machine_busy_s() - busy0 - (_own_cpu_s() - own0)
    return max(0.0, others) / max(1e-9, time.monotonic() - wall0)


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy_s() -> float:
    """CPU seconds every process has spent so far (/proc/stat's first line, less idle and iowait)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def service_cpu_per_step(batch: int = PROBE_BATCH) -> float:
    """The rest of the service's CPU per step at `batch` decodes, scaled by how fast this machine runs Python."""
    return SERVICE_CPU_PER_TOKEN_S * batch * python_work_s() / PYTHON_WORK_REFERENCE_S


def python_work_s(rounds: int = 5) -> float:
    """Seconds for a fixed piece of the service's kind of work: 200 TokenBatch-like messages packed and
    unpacked (msgpack), and a dict per event (the fastest of `rounds`)."""
    import msgpack

    events = [[f"seq-{i:04d}", 100 + i, [17], None, None] for i in range(PROBE_BATCH)]
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for step in range(200):
            body = msgpack.unpackb(msgpack.packb({"step_id": step, "worker_id": "w", "events": events}))
            by_seq = {ev[0]: (ev[1], len(ev[2])) for ev in body["events"]}
            msgpack.packb([[k, v] for k, v in by_seq.items()])
        best = min(best, time.perf_counter() - t)
    return best


def cache_path() -> Path:
    from phaseserve.models.model_source import cache_dir

    return cache_dir() / "threads.json"


def cache_key(model_dir: str, files: list[Path], cores: int) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "unknown")
    stamp = ",".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)
    # a CPU level cap (kernels/cpu_isa.py) runs other kernels and dtype: a step of its own to time
    cap = os.environ.get("PHASESERVE_CPU_ISA", "auto").strip().lower() or "auto"
    level = "" if cap == "auto" else f"|level cap {cap}"
    return f"{cpu}|{cores} cores{level}|{Path(model_dir).resolve()}|{stamp}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(key: str, entry: dict) -> None:
    """Atomically (a launcher and a worker may race): read, add, write a temp file, rename."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache()
        data[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache: measure again next time
        log.warning("could not save the thread choice", path=str(path), error=str(e))
