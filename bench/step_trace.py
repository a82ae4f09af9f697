"""Where a worker's steps went: a summary of its per-step log lines.

    python -m bench.step_trace WORKER_LOG [--long-context 1024]

The worker logs one line per step at debug level (`step_id`, `decodes`, `prefill_tokens`, `context`: the
furthest position a prefill chunk reaches, `step_ms`: the model step). Run the stack with
`--log-level debug --log-json true`; `bench.side_by_side` keeps each server's log in its --out-dir:

    python -m bench.side_by_side --model bundled --servers phaseserve --workload interference ... \\
        --phaseserve-arg=--log-level=debug --phaseserve-arg=--log-json=true --out-dir runs/trace

Steps are grouped into decodes only, steps with prefill ending before --long-context and steps with
prefill beyond it (chunks deep in a long prompt); for each: count, share of the busy time, step time
percentiles, mean decodes and prefill tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Group:
    name: str
    ms: list[float] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)


def read_steps(path: str) -> list[dict]:
    steps = []
    with open(path, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "step" and "step_ms" in rec:
                steps.append(rec)
    return steps


def summarize(steps: list[dict], long_context: int) -> list[Group]:
    groups = {k: Group(k) for k in ("decodes only", f"prefill, context < {long_context}",
                                    f"prefill, context >= {long_context}")}
    names = list(groups)
    for s in steps:
        name = names[0] if not s["prefill_tokens"] else names[1] if s["context"] < long_context else names[2]
        g = groups[name]
        g.ms.append(s["step_ms"])
        g.decodes.append(s["decodes"])
        g.prefill.append(s["prefill_tokens"])
    return [g for g in groups.values() if g.ms]


def table(groups: list[Group]) -> str:
    busy = sum(sum(g.ms) for g in groups) or 1.0
    rows = ["| steps | count | share of busy time | p50 / p90 / max ms | decodes (mean) | prefill tokens (mean) |",
            "| --- | --: | --: | --- | --: | --: |"]
    for g in groups:
        p50, p90 = np.percentile(g.ms, [50, 90])
        rows.append(f"| {g.name} | {len(g.ms)} | {sum(g.ms) / busy:.0%} | {p50:.1f} / {p90:.1f} / {max(g.ms):.1f} "
                    f"| {np.mean(g.decodes):.1f} | {np.mean(g.prefill):.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a worker's log file (JSON lines, debug level)")
    ap.add_argument("--long-context", type=int, default=1024,
                    help="prefill steps reaching this position or beyond are reported apart")
    args = ap.parse_args(argv)
    steps = read_steps(args.log)
    if not steps:
        print(f"{args.log}: no step lines (run the worker with --log-level debug --log-json true)", file=sys.stderr)
        return 1
    print(f"{len(steps)} steps, {sum(s['step_ms'] for s in steps) / 1e3:.1f} s in the model")
    print(table(summarize(steps, args.long_context)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
