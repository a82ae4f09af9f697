"""What WAIT costs the submit path: the gateway's `Backend.submit` (client leases + XADD of the request, in
one pipeline) against a primary with one replica watched by sentinels, with and without `WAIT 1` at its end.

`python -m bench.redis_wait [--submits 2000] [--rounds 10]`

Rounds alternate between the two (each round `--submits / --rounds` submits of each), so a machine whose
load changes mid-run weighs on both alike. Prints p50 / p99 / mean of one submit's latency in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid

from phaseserve.gateway.backend import Backend
from phaseserve.params import SamplingParams
from phaseserve.redis_topologies import SentinelSet
from phaseserve.wire import Keys, SubmitRequest

PROMPT = list(range(1, 65))  # 64 prompt tokens: a short chat turn


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def time_submits(backend: Backend, n: int, into: list[float]) -> None:
    for _ in range(n):
        req = SubmitRequest(uuid.uuid4().hex, backend.gateway_id, PROMPT, SamplingParams(max_tokens=16))
        t0 = time.perf_counter()
        await backend.submissions.submit([req])
        into.append(time.perf_counter() - t0)
        backend.leases.drop([req.request_id])


async def run(url: str, submits: int, rounds: int) -> dict[str, list[float]]:
    keys = Keys("bench-wait")
    backends = {"no WAIT": Backend(url, keys, "gw-a", wait_replicas=0),
                "WAIT 1": Backend(url, keys, "gw-b", wait_replicas=1, wait_timeout_s=1.0)}
    times: dict[str, list[float]] = {name: [] for name in backends}
    try:
        for backend in backends.values():  # connections made before the clock runs
            await time_submits(backend, 20, [])
        for _ in range(rounds):
            for name, backend in backends.items():
                await time_submits(backend, max(1, submits // rounds), times[name])
    finally:
        for backend in backends.values():
            await backend.redis.aclose()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--submits", type=int, default=2000, help="submits timed per variant")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    with SentinelSet() as sentinels:
        times = asyncio.run(run(sentinels.url, args.submits, args.rounds))
    print(f"\nBackend.submit, one request of {len(PROMPT)} prompt tokens, primary + 1 replica on loopback "
          f"({args.submits} submits each)")
    print("| submit | p50 (ms) | p99 (ms) | mean (ms) |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {percentile(values, 0.5) * 1e3:.3f} | {percentile(values, 0.99) * 1e3:.3f} "
              f"| {statistics.fmean(values) * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
