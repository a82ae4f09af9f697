"""Run a workload in-process on phaseserve.stack.engine.Engine: no HTTP, no Redis, no separate processes.

Engine.generate(prompts, params) returns only when every prompt is done, so there is no per-token
timing to take: this backend measures throughput only (request, output and total tokens per second).
The difference to the served numbers is what the gateway + Redis + scheduler + worker layers cost.
"""

from __future__ import annotations

import time

import structlog

from phaseserve.stack.benchmark.metrics import RequestResult
from phaseserve.stack.benchmark.workloads import RequestSpec, Vocab

log = structlog.get_logger("bench.engine")


def _output_len(completion) -> int:
    """Token count of one completion, whatever shape the engine returns it in."""
    for attr in ("output_token_ids", "token_ids", "tokens"):
        v = completion.get(attr) if isinstance(completion, dict) else getattr(completion, attr, None)
        if v is not None:
            return len(v)
    if isinstance(completion, (list, tuple)) and all(isinstance(t, int) for t in completion):
        return len(completion)
    raise TypeError(f"cannot count the output tokens of an engine completion of type {type(completion)}")


def run_engine(model_dir: str, specs: list[RequestSpec], vocab: Vocab | None, temperature: float,
               ignore_eos: bool, settings: dict, concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Generate every spec in one Engine.generate call; return per-request results and the wall time.

    `concurrency` becomes the scheduler's max_num_seqs (unless a setting names it), the in-process
    equivalent of the client keeping that many requests in flight."""
    from phaseserve.stack.engine import Engine
    from phaseserve.params import SamplingParams

    if any(s.api != "completions" for s in specs):
        raise ValueError("the engine backend runs the random and shared-prefix workloads only")
    lens = {s.output_len for s in specs}
    if len(lens) != 1:
        raise ValueError("the engine backend needs one output length for every prompt")
    params = SamplingParams(max_tokens=lens.pop(), temperature=temperature, ignore_eos=ignore_eos).validate()
    if concurrency and "max_num_seqs" not in settings:
        settings = {**settings, "max_num_seqs": concurrency}
    engine = Engine(model_dir, **settings)
    prompts = [list(s.prompt) for s in specs]
    # warm up on one prompt (what the served runs' test request does) so load time is not counted
    engine.generate(prompts[:1], params)
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    duration = time.perf_counter() - start
    if len(completions) != len(specs):
        raise RuntimeError(f"engine returned {len(completions)} completions for {len(specs)} prompts")
    results = [RequestResult(group=s.group, success=True, prompt_len=s.prompt_len, output_tokens=_output_len(c),
                             start_time=start, latency=duration) for s, c in zip(specs, completions)]
    return results, duration


def throughput_only(metrics: dict) -> dict:
    """Drop the latency fields: one batch call has no per-request TTFT/TPOT/ITL to report."""
    keep = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput")
    return {k: metrics[k] for k in keep}
