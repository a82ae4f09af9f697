"""How many steps and requests per second one scheduler sustains, and where it saturates.

`python -m bench.scheduler_load --workers 1,8,64 [--seconds 10] [--seqs-per-worker 16]`

For each worker count, a fresh stack: an embedded Redis, a real scheduler process (`python -m phaseserve.scheduler`,
what `phaseserve scheduler` runs) and fake workers that cost nothing to run a step. The fake workers join
as real ones do (workers/relay.py: consumer group on `steps:<id>` first, then the `workers` set and a
WorkerInfo heartbeat key) and answer every plan at once with a StepResult: one token (a fixed id) per
chunk that reaches the end of its sequence's known tokens, finishing at max_tokens, published to the
gateway's channel as a TokenBatch like a worker's. A fake gateway in this process keeps
`seqs-per-worker x workers` requests in flight (SubmitRequest on `requests`, as gateway/submissions.py does;
a new one for each that finishes), so every worker always has work, or with `--rate R` submits R a
second whatever finishes (the "in flight" column is then what was left unfinished at the end).

The fake workers of one "fleet" process share one XREADGROUP over all their streams and one write
pipeline, so their own cost stays small beside the scheduler's (a real worker makes one round trip per
step of its own). They write no token log (workers/relay.py does): Redis does that much less work here.

Measured over `--seconds` after a warm-up: plans answered per second (steps/s, all workers), requests
completed per second, and the CPU (psutil, in cores) of the scheduler process, redis-server, the fake
workers and this gateway, plus the whole machine's; the verdict says which one is the limit (a process
at >= 90% of a core) or that the step ping-pong (latency) is.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import redis.asyncio as aioredis
from tqdm import tqdm

from bench.scheduler_load_fakes import FakeGateway, LoadConfig, fleet_process
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import Keys

ROOT = Path(__file__).resolve().parent.parent
SATURATED = 0.9  # cores: a process at this much of one core is the bottleneck


# ---------------------------------------------------------------------------- one run


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def busy_seconds(t) -> float:
    """A CPU's time spent on anything but idling (psutil.cpu_times entry)."""
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def all_cpu() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far: pid -> (name, seconds)."""
    out = {}
    for p in psutil.process_iter(["name"]):
        try:
            out[p.pid] = (p.info["name"], cpu_seconds(p))
        except psutil.Error:
            pass
    return out


def others_cpu(before: dict, after: dict, exclude: set[int], wall: float) -> list[tuple[str, float]]:
    """The busiest processes that are not ours between two `all_cpu()` snapshots: (name[pid], cores)."""
    busy = [(f"{name}[{pid}]", (secs - before.get(pid, (name, 0.0))[1]) / wall)  # new ones: all of theirs
            for pid, (name, secs) in after.items() if pid not in exclude]
    return sorted((b for b in busy if b[1] >= 0.05), key=lambda b: -b[1])[:5]


async def run_load(cfg: LoadConfig, redis_proc: psutil.Process, seconds: float, warmup: float,
                   num_fleets: int, log_dir: Path, pin: bool = False, rate: float = 0.0) -> dict:
    keys = Keys(cfg.prefix)
    log_path = log_dir / f"scheduler-{cfg.num_workers}.log"
    with open(log_path, "wb") as log_file:
        sched = subprocess.Popen(
            [sys.executable, "-m", "phaseserve.scheduler", "--redis-url", cfg.redis_url, "--key-prefix", cfg.prefix,
             "--heartbeat-interval", str(cfg.heartbeat_interval), "--log-level", "warning"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log_file, stderr=subprocess.STDOUT)
    if pin:
        psutil.Process(sched.pid).cpu_affinity([0])
    ctx = mp.get_context("spawn")
    stop_fleets = ctx.Event()
    ids = [f"fake-{i:03d}" for i in range(cfg.num_workers)]
    fleets = []
    for f in range(num_fleets):
        counter = ctx.Value("q", 0)
        proc = ctx.Process(target=fleet_process, args=(cfg, ids[f::num_fleets], counter, stop_fleets), daemon=True)
        proc.start()
        fleets.append((proc, counter))
    gw = FakeGateway(cfg, cfg.seqs_per_worker * cfg.num_workers, rate)
    stop_gw, ready = asyncio.Event(), asyncio.Event()
    gw_task = asyncio.create_task(gw.run(stop_gw, ready))
    try:
        await ready.wait()
        client = aioredis.from_url(cfg.redis_url)
        deadline = time.monotonic() + 30
        while await client.scard(keys.workers) < cfg.num_workers or not await client.exists(keys.scheduler_alive()):
            if time.monotonic() > deadline or sched.poll() is not None:
                raise RuntimeError(f"the scheduler or the fake workers did not come up; see {log_path}")
            await asyncio.sleep(0.1)
        await client.aclose()
        await asyncio.sleep(warmup)
        procs = {"scheduler": psutil.Process(sched.pid), "redis": redis_proc,
                 "fake workers": [psutil.Process(p.pid) for p, _ in fleets], "gateway": psutil.Process()}

        def sample() -> tuple[float, int, int, dict]:
            cpu = {}
            for name, p in procs.items():
                cpu[name] = sum(cpu_seconds(q) for q in p) if isinstance(p, list) else cpu_seconds(p)
            return time.monotonic(), sum(c.value for _, c in fleets), gw.finished, cpu

        sys_before, every_before = psutil.cpu_times(percpu=True), all_cpu()
        t0, steps0, done0, cpu0 = sample()
        await asyncio.sleep(seconds)
        t1, steps1, done1, cpu1 = sample()
        sys_after, every_after = psutil.cpu_times(percpu=True), all_cpu()
        wall = t1 - t0
        per_cpu = [(busy_seconds(a) - busy_seconds(b)) / wall for a, b in zip(sys_after, sys_before)]
        cores = {name: (cpu1[name] - cpu0[name]) / wall for name in cpu0}
        if sched.poll() is not None:
            raise RuntimeError(f"the scheduler exited (code {sched.returncode}); see {log_path}")
        return {"workers": cfg.num_workers, "concurrency": gw.next_id - gw.finished if rate else gw.concurrency, "seconds": wall,
                "steps_per_s": (steps1 - steps0) / wall, "requests_per_s": (done1 - done0) / wall,
                "errors": gw.errors, "cores": cores, "machine_cores": sum(per_cpu),
                "per_cpu": per_cpu, "pinned": pin,
                "others": others_cpu(every_before, every_after,
                                     {sched.pid, redis_proc.pid, os.getpid(), *(p.pid for p, _ in fleets)}, wall)}
    finally:
        stop_gw.set()
        await asyncio.gather(gw_task, return_exceptions=True)
        sched.send_signal(signal.SIGTERM)
        try:
            sched.wait(10)
        except subprocess.TimeoutExpired:
            sched.kill()
            sched.wait()
        stop_fleets.set()
        for p, _ in fleets:
            p.join(10)
            if p.is_alive():
                p.kill()


def verdict(r: dict) -> str:
    c = r["cores"]
    name, top = max(((n, v) for n, v in c.items()), key=lambda x: x[1])
    if top >= SATURATED:
        return f"{name} CPU ({top:.2f} core)"
    if r["pinned"] and r["per_cpu"][0] >= SATURATED:
        return f"CPU 0, the scheduler's, full ({r['per_cpu'][0]:.2f}; the rest is other jobs)"
    if r["machine_cores"] >= 0.85 * psutil.cpu_count():  # every process waits for a core now and then
        return f"the machine ({r['machine_cores']:.2f} of {psutil.cpu_count()} cores busy)"
    return "latency (step ping-pong; no process saturated)"


def print_table(results: list[dict]) -> None:
    head = (f"{'workers':>7} {'in flight':>9} {'steps/s':>8} {'req/s':>7} {'sched CPU':>9} {'us/step':>7} "
            f"{'steps/s/core':>12} {'redis':>6} {'fakes':>6} {'gw':>5} {'others':>6} {'machine':>7} {'per CPU':>9}  saturates")
    print(head)
    print("-" * len(head))
    for r in results:
        c = r["cores"]
        per_step = c["scheduler"] / r["steps_per_s"] if r["steps_per_s"] else float("nan")
        others = r["machine_cores"] - sum(c.values())
        print(f"{r['workers']:>7} {r['concurrency']:>9} {r['steps_per_s']:>8.0f} {r['requests_per_s']:>7.0f} "
              f"{c['scheduler']:>9.2f} {per_step * 1e6:>7.0f} {1 / per_step:>12.0f} {c['redis']:>6.2f} "
              f"{c['fake workers']:>6.2f} {c['gateway']:>5.2f} {others:>6.2f} {r['machine_cores']:>7.2f} {'/'.join(f'{b:.2f}' for b in r['per_cpu']):>9}  {verdict(r)}")
    print("CPU in cores over the measured window. us/step: scheduler CPU per plan sent; steps/s/core: what one\n"
          "scheduler core would send at that cost. others: the rest of the machine (other users' jobs); machine:\n"
          f"every process, of {psutil.cpu_count()} cores; per CPU: each one's busy fraction.")


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--workers: a comma-separated list of integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--workers: every count must be >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler_load", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,8,64", help="fake worker counts, comma-separated (default 1,8,64)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per count")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--seqs-per-worker", type=int, default=16, help="requests kept in flight per worker")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="submit this many requests a second instead (open loop; 0: keep the workers full)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--fleets", type=int, default=1, help="processes the fake workers are spread over")
    ap.add_argument("--pin", action="store_true",
                    help="the scheduler alone on the first CPU, Redis, fake workers and gateway on the rest")
    args = ap.parse_args(argv)
    counts = parse_counts(args.workers)
    if args.rate < 0:
        raise SystemExit("--rate must be >= 0")
    for name in ("seconds", "seqs_per_worker", "prompt_tokens", "output_tokens", "fleets"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    results = []
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "phaseserve-scheduler-load"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {psutil.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before the runs"
          + (", scheduler pinned to CPU 0, the rest to CPUs 1+" if args.pin else ""))
    rest = list(range(1, psutil.cpu_count()))
    if args.pin:
        if not rest:
            raise SystemExit("--pin needs at least 2 CPUs")
        os.sched_setaffinity(0, rest)  # this gateway, and the fake workers and Redis it starts, inherit it
    with EmbeddedRedis() as server:
        redis_proc = psutil.Process(server.proc.pid)
        for n in tqdm(counts, desc="worker counts", unit="run"):
            cfg = LoadConfig(server.url, f"load{n}", n, args.prompt_tokens, args.output_tokens, args.seqs_per_worker)
            r = asyncio.run(run_load(cfg, redis_proc, args.seconds, args.warmup, min(args.fleets, n), log_dir,
                                     args.pin, args.rate))
            results.append(r)
    print()
    print_table(results)
    print("\nbusiest other processes during each measured window (cores):")
    for r in results:
        print(f"  {r['workers']} workers: " + (", ".join(f"{n} {c:.2f}" for n, c in r["others"]) or "none"))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if any(r["errors"] for r in results):
        print("errors:", {r["workers"]: r["errors"] for r in results})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
