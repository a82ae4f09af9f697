"""How often a recomputed greedy stream forks from the stream it replaces.

Recovery (a worker lost, a scheduler fail-over, a lost step) re-admits a sequence with prompt + the
outputs already confirmed and prefills them in one pass. The decode steps that produced those outputs
ran the same positions one at a time, in other batches. On the native CPU ops a position's logits have
the same bits either way (one numerics, docs/decisions.md), so no stream should fork in either dtype; on
paths without that promise (the torch path: PHASESERVE_NATIVE=0) a near-tie can flip the argmax, and the
stream takes another path from there.

`python -m bench.recompute_forks [--model DIR] [--dtype bfloat16 float32] [--streams 16] [--max-tokens 64]`
runs `streams` greedy prompts to `max-tokens` in the in-process engine, then for each cut k re-admits
every stream with its first k outputs (as recovery does) and counts the continuations that differ,
and where (tokens after the cut until the first difference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tqdm import tqdm

from phaseserve.models.model_source import bundled_model_path
from phaseserve.params import SamplingParams
from phaseserve.stack.engine import Engine
from phaseserve.wire import SubmitRequest

SUBJECTS = ["The quick brown fox", "Hello world!", "Once upon a time", "Paged attention keeps",
            "A small language model", "The lazy dog", "Numbers like 0123", "There was a CPU"]


def prompts(n: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]}{' and more' * (i // len(SUBJECTS))}" for i in range(n)]


def resume(engine: Engine, prompt_ids: list[list[int]], outputs: list[list[int]],
           params: SamplingParams) -> list[list[int]]:
    """Every stream re-admitted with its confirmed outputs, run to the end: the full outputs."""
    sched, runner = engine.scheduler, engine.runner
    got = {}
    for i, (p, out) in enumerate(zip(prompt_ids, outputs)):
        rid = f"resume-{time.monotonic_ns()}-{i}"
        sched.add_request(SubmitRequest(rid, "local", p, params), output_ids=list(out))
        got[rid] = list(out)
    while sched.has_unfinished():
        result = runner.execute(sched.schedule())
        for ev in result.events:
            if ev.seq_id in got and ev.offset == len(got[ev.seq_id]):
                got[ev.seq_id].extend(ev.token_ids)
        sched.update(result)
    tail = sched.schedule()
    if tail is not None:
        sched.update(runner.execute(tail))
    return list(got.values())


def measure(model: str, dtype: str, streams: int, max_tokens: int, cuts: list[int], progress) -> list[dict]:
    engine = Engine(model, dtype=dtype, num_blocks=max(64, streams * (max_tokens // 16 + 4)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts = prompts(streams)
    prompt_ids = [engine.encode(t) for t in texts]
    original = [c.token_ids for c in engine.generate(prompt_ids, params)]
    rows = []
    for k in cuts:
        resumed = resume(engine, prompt_ids, [o[:k] for o in original], params)
        forks = [next(j for j in range(k, max_tokens) if r[j] != o[j]) - k
                 for o, r in zip(original, resumed) if r != o]
        rows.append({"dtype": dtype, "cut": k, "streams": streams, "forked": len(forks),
                     "median_tokens_to_fork": statistics.median(forks) if forks else None})
        progress.update(1)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recompute_forks", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path(), help="model folder (default: the bundled model)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cuts", type=int, nargs="+", default=[4, 16, 32, 48],
                   help="outputs confirmed when the recompute happens")
    args = p.parse_args(argv)
    bad = [k for k in args.cuts if not 0 < k < args.max_tokens]
    if bad:
        p.error(f"--cuts must be between 1 and --max-tokens - 1, got {bad}")
    rows = []
    with tqdm(total=len(args.dtype) * len(args.cuts), desc="recompute", file=sys.stderr) as progress:
        for dtype in args.dtype:
            rows += measure(args.model, dtype, args.streams, args.max_tokens, args.cuts, progress)
    print("| dtype | outputs before the recompute | streams forked | median tokens from the cut to the fork |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        med = "—" if r["median_tokens_to_fork"] is None else r["median_tokens_to_fork"]
        print(f"| {r['dtype']} | {r['cut']} | {r['forked']} / {r['streams']} | {med} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
