"""How long one decode step of a model takes per torch thread count, in a process of its own: what
phaseserve/cpus.py measures to choose a worker's threads (it runs `python -m phaseserve.workers.thread_probe MODEL_DIR
OUT.json 1,2 BUDGET_S` and reads OUT.json)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from phaseserve.cpus import PROBE_BATCH, PROBE_BUDGET_S


def measure_step_times(model_dir: str, thread_counts: list[int], *, budget_s: float = PROBE_BUDGET_S,
                       batch: int = PROBE_BATCH, context: int = 16, max_rounds: int = 4,
                       steps: int = 3) -> dict[int, float]:
    """Seconds per decode step of this model at `batch` sequences of `context` tokens, per thread count: the
    fastest step over rounds of `steps` (thread counts alternate, so a neighbour's burst hits them alike; the
    fastest, since another process's work is what the service term adds). Rounds go on while the timing has
    taken less than `budget_s` (at least one, at most `max_rounds`). Loads the model with the worker's
    defaults (and compiles its native ops, on a first start) before the timing. A short context: its
    prefill is the fixed cost of the timing, and a decode step of a small context is mostly the linears."""
    import torch

    from phaseserve.params import SamplingParams
    from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.runner import ModelRunner

    total_steps = max_rounds * len(thread_counts) * (steps + 1)
    block_size = 16
    per_seq = -(-(context + total_steps + 1) // block_size)
    runner = ModelRunner(model_dir, num_blocks=batch * per_seq, block_size=block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    seqs = [f"probe-{i}" for i in range(batch)]
    tables = {s: list(range(i * per_seq, (i + 1) * per_seq)) for i, s in enumerate(seqs)}
    step_id = 0

    def run(**kw) -> None:
        nonlocal step_id
        step_id += 1
        runner.execute(StepPlan(step_id, "probe", **kw))

    prompts = [torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist() for _ in seqs]
    run(starts=[SeqStart(s, "probe", p, params) for s, p in zip(seqs, prompts)],
        chunks=[ScheduledChunk(s, 0, context, tables[s]) for s in seqs])

    def decode() -> float:
        t = time.perf_counter()
        run(chunks=[ScheduledChunk(s, len(runner.seqs[s].token_ids) - 1, 1, tables[s]) for s in seqs])
        return time.perf_counter() - t

    times: dict[int, float] = {}
    started = time.perf_counter()
    for _ in range(max_rounds):
        if times and time.perf_counter() - started >= budget_s:
            break
        for n in thread_counts:
            torch.set_num_threads(n)
            decode()  # warm-up: OpenMP starts its threads
            times[n] = min(times.get(n, float("inf")), *(decode() for _ in range(steps)))
    return times


def main(argv: list[str] | None = None) -> int:
    """`python -m phaseserve.workers.thread_probe MODEL_DIR OUT.json 1,2 [BUDGET_S]`: step seconds per thread count into
    OUT.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        print("usage: python -m phaseserve.workers.thread_probe MODEL_DIR OUT.json THREADS[,THREADS...] [BUDGET_S]",
              file=sys.stderr)
        return 2
    model_dir, out, counts = args[:3]
    budget_s = float(args[3]) if len(args) == 4 else PROBE_BUDGET_S
    times = measure_step_times(model_dir, [int(n) for n in counts.split(",")], budget_s=budget_s)
    Path(out).write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
