"""KV transfer cost: bytes per token, and a 2,000-token prompt's KV moved through Redis and shared memory.

    python -m bench.bench_kv_transfer [--tokens 2000] [--rounds 5] [--skip-prefill]

For each KV shape (the bundled model, SmolLM2-135M, the 200M random Llama of bench_model), a random
cache is filled and one sequence's blocks are sent then received (sequentially, one process: send =
export + writes, receive = reads + checksum + scatter into other block ids), through an embedded
redis-server on loopback and through /dev/shm; Redis and shared memory alternate round by round; figures
are best-of-rounds (the machine's capability) with the median total beside it (what sharing the cores costs). Beside them: the machine's memory read bandwidth (bench_model's measurement), an
in-process export + import (the copy floor). The sender ships the prompt in pieces of
PIECE_BLOCKS blocks, as a chunked prefill would stream them, and, unless --skip-prefill, the prefill speed of the bundled
and 200M models (chunk 512), for the break-even: transferring a token's KV pays while it costs less than
prefilling that token again.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from tqdm import tqdm

from bench.bench_model import build_random_model, measure_bandwidth
from phaseserve.params import SamplingParams
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.cpu_memory import keep_heap_memory
from phaseserve.workers.kv_cache import KVCache, bytes_per_block
from phaseserve.workers.kv_transfer.redis_transport import RedisKVReceiver, RedisKVSender
from phaseserve.workers.kv_transfer.shm_transport import ShmKVReceiver, ShmKVSender

BUNDLED = Path(__file__).resolve().parent.parent / "phaseserve" / "bundled_model"
BLOCK_SIZE = 16
PIECE_BLOCKS = 32  # one 512-token prefill chunk's blocks per send_blocks call


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, 1, self.dtype)


SHAPES = [
    KVShape("bundled (6 layers, 4 KV heads x 32)", 6, 4, 32),
    KVShape("SmolLM2-135M (30 layers, 3 KV heads x 64)", 30, 3, 64),
    KVShape("random-200m (16 layers, 8 KV heads x 64)", 16, 8, 64),
]


def random_cache(shape: KVShape, num_blocks: int) -> KVCache:
    cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size=BLOCK_SIZE,
                    num_blocks=num_blocks, dtype=shape.dtype)
    for t in cache.k + cache.v:
        t.normal_()
    return cache


def timed_transfer(make_sender, receiver, src: KVCache, dst: KVCache, n_blocks: int, tokens: int) -> tuple[float, float]:
    tid = "bench-" + uuid.uuid4().hex
    src_ids = list(range(n_blocks))
    dst_ids = list(range(n_blocks, 2 * n_blocks))
    t0 = time.perf_counter()
    sender = make_sender(tid, src, src_ids)
    for a in range(0, n_blocks, PIECE_BLOCKS):  # as a chunked prefill streams them
        sender.send_blocks(a, min(a + PIECE_BLOCKS, n_blocks))
    sender.finish(tokens)
    t1 = time.perf_counter()
    receiver.receive(tid, dst, dst_ids, timeout=60)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def bench_shape(shape: KVShape, tokens: int, rounds: int, client: redis.Redis, shm_dir: Path) -> list[list[str]]:
    n_blocks = -(-tokens // BLOCK_SIZE)
    src = random_cache(shape, 2 * n_blocks)
    dst = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size=BLOCK_SIZE,
                  num_blocks=2 * n_blocks, dtype=shape.dtype)
    nbytes = src.export_nbytes(n_blocks)
    ways = {
        "redis": (lambda tid, c, ids: RedisKVSender(client, tid, c, ids), RedisKVReceiver(client)),
        "shm": (lambda tid, c, ids: ShmKVSender(tid, c, ids, directory=shm_dir), ShmKVReceiver(directory=shm_dir)),
    }
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    copy_times = []
    ids = list(range(n_blocks))
    for _ in tqdm(range(rounds + 1), desc=shape.name.split(" ")[0], leave=False):  # first round: warm-up
        for way, (make_sender, receiver) in ways.items():
            times[way].append(timed_transfer(make_sender, receiver, src, dst, n_blocks, tokens))
        t = time.perf_counter()
        dst.import_blocks(list(range(n_blocks, 2 * n_blocks)), src.export_blocks(ids))
        copy_times.append(time.perf_counter() - t)
    # best-of is the machine's capability; the median shows what sharing two cores with other work costs
    rows = []
    for way, ts in times.items():
        totals = [a + b for a, b in ts[1:]]
        send, recv = min(a for a, _ in ts[1:]), min(b for _, b in ts[1:])
        best = min(totals)
        rows.append([shape.name, way, f"{shape.bytes_per_token}", f"{nbytes / 2**20:.1f}", f"{send * 1e3:.1f}",
                     f"{recv * 1e3:.1f}", f"{best * 1e3:.1f}", f"{statistics.median(totals) * 1e3:.1f}",
                     f"{nbytes / best / 1e9:.2f}", f"{best / tokens * 1e6:.2f}"])
    copy = min(copy_times[1:])
    rows.append([shape.name, "in-process export+import", f"{shape.bytes_per_token}", f"{nbytes / 2**20:.1f}", "", "",
                 f"{copy * 1e3:.1f}", f"{statistics.median(copy_times[1:]) * 1e3:.1f}", f"{nbytes / copy / 1e9:.2f}",
                 f"{copy / tokens * 1e6:.2f}"])
    return rows


def prefill_us_per_token(path: Path, chunk: int = 512, repeats: int = 3) -> float:
    """Best time of one `chunk`-token prefill step from position 0, per token."""
    from phaseserve.workers.runner import ModelRunner

    runner = ModelRunner(path, dtype="bfloat16", num_blocks=chunk // BLOCK_SIZE + 1)
    table = list(range(chunk // BLOCK_SIZE))
    prompt = list(range(3, 3 + chunk))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for i in range(repeats + 1):
        plan = StepPlan(i, "w", [SeqStart(f"s{i}", "gw", prompt, params)], [ScheduledChunk(f"s{i}", 0, chunk, table)],
                        [f"s{i - 1}"] if i else [])
        t = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - t)
    return min(times[1:]) / chunk * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length whose KV is moved")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per transport (best and median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--skip-prefill", action="store_true", help="skip the prefill-speed measurement")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    keep_heap_memory()  # as a worker process does: staging buffers reuse heap pages instead of faulting new ones
    bw = measure_bandwidth()
    print(f"machine: {torch.get_num_threads()} threads, memory read {bw / 1e9:.1f} GB/s")
    rows = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        client = redis.Redis.from_url(server.url)
        for shape in SHAPES:
            rows += bench_shape(shape, args.tokens, args.rounds, client, Path(shm_dir))
        client.close()
    header = ["KV shape", "transport", "bytes/token", "MiB moved", "send ms (best)", "receive ms (best)",
              "total ms (best)", "total ms (median)", "GB/s (best)", "us/token (best)"]
    print(f"\n{args.tokens}-token prompt, block size {BLOCK_SIZE}, bf16; sent in pieces of {PIECE_BLOCKS} blocks; send and receive sequential (no overlap)\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if not args.skip_prefill:
        print("\nprefill (chunk 512, bf16, from position 0):")
        print(f"  bundled: {prefill_us_per_token(BUNDLED):.1f} us/token")
        with tempfile.TemporaryDirectory() as tmp:
            print(f"  random-200m: {prefill_us_per_token(build_random_model(Path(tmp))):.1f} us/token")


if __name__ == "__main__":
    main()
