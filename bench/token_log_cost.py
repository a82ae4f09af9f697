"""`python -m bench.token_log_cost`: what the durable token log adds to the relay's per-step pipeline.

Replays the relay's write pipeline (workers/relay.py: PUBLISH of the step's TokenBatch, XADD of the
StepResult, XACK + XDEL of the plan) against an embedded Redis, with and without the token-log XADDs
(phaseserve/token_log.py), alternating the two in rounds. Reports the relay's time per step (client
Python + the round trip) and Redis's CPU per step, for steps of --seqs decodes of one token each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis

from phaseserve import token_log
from phaseserve.redis_server import EmbeddedRedis
from phaseserve.wire import FIELD, STREAM_MAXLEN, Keys, StepResult, TokenBatch, TokenEvent


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def run_steps(client: redis.Redis, keys: Keys, seqs: int, steps: int, start_step: int, with_log: bool) -> float:
    t0 = time.perf_counter()
    for step in range(start_step, start_step + steps):
        events = [TokenEvent(f"req{with_log}-{i}", step, [1000 + i]) for i in range(seqs)]
        batch = TokenBatch(step, "w", events).to_wire()
        result = StepResult(step, "w", events, seqs).to_wire()
        pipe = client.pipeline(transaction=False)
        if with_log:
            token_log.append_batch(pipe, keys, batch)
        pipe.publish(keys.gateway_channel("g"), batch)
        pipe.xadd(keys.results, {FIELD: result}, maxlen=STREAM_MAXLEN, approximate=True)
        pipe.xack(keys.steps("w"), keys.worker_group, b"0-1")
        pipe.xdel(keys.steps("w"), b"0-1")
        token_log.raise_unexpected(pipe.execute(raise_on_error=False))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.token_log_cost", description=__doc__)
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=500, help="steps per round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    with EmbeddedRedis() as server:
        client, keys = redis.Redis.from_url(server.url), Keys("bench")
        for seqs in args.seqs:
            wall = {False: [], True: []}
            cpu = {False: [], True: []}
            step = 0
            for _ in range(args.rounds):
                for with_log in (False, True):
                    c0 = redis_cpu(client)
                    wall[with_log].append(run_steps(client, keys, seqs, args.steps, step, with_log) / args.steps)
                    cpu[with_log].append((redis_cpu(client) - c0) / args.steps)
                    step += args.steps
            w0, w1 = statistics.median(wall[False]) * 1e3, statistics.median(wall[True]) * 1e3
            c0, c1 = statistics.median(cpu[False]) * 1e3, statistics.median(cpu[True]) * 1e3
            print(f"{seqs} sequences a step: relay {w0:.3f} -> {w1:.3f} ms a step (+{w1 - w0:.3f} ms, x{w1 / w0:.2f}); "
                  f"redis CPU {c0:.3f} -> {c1:.3f} ms a step")
        client.flushall()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
