"""One benchmark cell request by request and phase by phase: what sets its wall time, and where speculation
ran. Pure: it joins the client's per-request results with the worker's per-step log lines (debug level, JSON:
`step_ms`, `decodes`, `prefill_tokens`, and with speculation `drafted`, `kept`, `spec` per sequence), both
already read. `bench.speculative --per-request` prints it for every phaseserve cell.

Phases of a cell, from the client's clock: `prefill` until the last request's first token (the wave's prompts
are being computed; decodes run beside them), `full` until the first request finishes (every request
decoding), `tail` until the last finishes (fewer and fewer decoding). Speculation can only shorten the
decode parts, so a cell whose wall time is mostly `prefill` cannot gain much from it.
"""

from __future__ import annotations

from datetime import datetime

from bench.step_trace import read_steps


def read_step_lines(path) -> list[dict]:
    """The worker's step lines of a JSON log (bench/step_trace.read_steps), each with `t`: its wall time in
    seconds (the step's end)."""
    steps = [s for s in read_steps(path) if "timestamp" in s]
    for s in steps:
        s["t"] = datetime.fromisoformat(s["timestamp"].replace("Z", "+00:00")).timestamp()
    return steps


def per_request(requests: list[dict], steps: list[dict], perf0: float) -> list[dict]:
    """Each successful request (bench/metrics.RequestResult.to_json()) with times relative to the run's start
    (`perf0`, perf_counter), its streamed events and the drafts its worker verified and kept (steps' `spec`,
    keyed by sequence id: the request id and choice index)."""
    spec: dict[str, list[int]] = {}
    for s in steps:
        for seq_id, (drafted, kept) in (s.get("spec") or {}).items():
            tot = spec.setdefault(seq_id, [0, 0])
            tot[0] += drafted
            tot[1] += kept
    rows = []
    for i, r in enumerate(requests):
        if not r.get("success"):
            continue
        start = r["start_time"] - perf0
        drafted, kept = spec.get(f"{r.get('request_id', '')}-0", [0, 0])
        rows.append({"index": i, "prompt": r["prompt_len"], "cached": r.get("cached_tokens"),
                     "output": r["output_tokens"], "events": len(r["itl"]) + 1, "start_s": start,
                     "first_token_s": start + r["ttft"], "finish_s": start + r["latency"], "ttft_s": r["ttft"],
                     "e2e_s": r["latency"], "drafted": drafted, "kept": kept})
    return rows


def phases(rows: list[dict], steps: list[dict], wall0: float, duration_s: float) -> list[dict]:
    """The cell cut at the last first token and the first finish (client clock; `wall0`: the run's start on
    the log's clock), with the worker's steps that ended in each: their count, time, decodes, prefill tokens,
    drafts verified and kept, and the output tokens the client received in it."""
    if not rows:
        return []
    cuts = [0.0, max(r["first_token_s"] for r in rows), min(r["finish_s"] for r in rows), duration_s]
    names = ("prefill", "full", "tail")
    out = []
    for name, lo, hi in zip(names, cuts, cuts[1:]):
        hi = max(hi, lo)
        mine = [s for s in steps if lo <= s["t"] - wall0 < hi]
        out.append({"phase": name, "from_s": lo, "to_s": hi, "steps": len(mine),
                    "step_s": sum(s["step_ms"] for s in mine) / 1e3,
                    "decodes": sum(s["decodes"] for s in mine), "prefill_tokens": sum(s["prefill_tokens"] for s in mine),
                    "draft_slots": sum(s.get("draft_slots", 0) for s in mine),
                    "drafted": sum(s.get("drafted", 0) for s in mine), "kept": sum(s.get("kept", 0) for s in mine)})
    return out


def format_requests(rows: list[dict]) -> str:
    head = (f"{'req':>3} {'prompt':>6} {'cached':>6} {'out':>4} {'events':>6} {'start':>6} {'TTFT':>6} "
            f"{'finish':>6} {'E2E':>6} {'drafted':>7} {'kept':>5}")
    lines = [head + "   (seconds from the run's start; ordered by finish)", "-" * len(head)]
    for r in sorted(rows, key=lambda r: r["finish_s"]):
        cached = "-" if r["cached"] is None else str(r["cached"])
        lines.append(f"{r['index']:>3} {r['prompt']:>6} {cached:>6} {r['output']:>4} {r['events']:>6} "
                     f"{r['start_s']:>6.2f} {r['ttft_s']:>6.2f} {r['finish_s']:>6.2f} {r['e2e_s']:>6.2f} "
                     f"{r['drafted']:>7} {r['kept']:>5}")
    return "\n".join(lines)


def format_phases(ph: list[dict]) -> str:
    head = (f"{'phase':<8} {'from':>6} {'to':>6} {'steps':>5} {'step s':>7} {'decodes':>7} {'prefill':>7} "
            f"{'slots':>6} {'drafted':>7} {'kept':>5} {'dec/step':>8}")
    lines = [head, "-" * len(head)]
    for p in ph:
        per = p["decodes"] / p["steps"] if p["steps"] else 0.0
        lines.append(f"{p['phase']:<8} {p['from_s']:>6.2f} {p['to_s']:>6.2f} {p['steps']:>5} {p['step_s']:>7.2f} "
                     f"{p['decodes']:>7} {p['prefill_tokens']:>7} {p['draft_slots']:>6} {p['drafted']:>7} "
                     f"{p['kept']:>5} {per:>8.1f}")
    return "\n".join(lines)
