"""bench.speculative's bookkeeping: each cell's own prompts, rounds compared with their own baseline, and the
per-request / per-phase timeline joined from the client's results and the worker's step lines."""

import json

from bench import spec_timeline
from bench.speculative import add_ratios, build_parser, cell_args
from phaseserve.stack.benchmark.models import resolve_model


def test_each_cell_gets_its_own_prompts_so_no_cell_runs_on_anothers_prefix_cache():
    args = build_parser().parse_args(["--model", "bundled"])
    model = resolve_model("bundled")
    a = cell_args("copy", 1, args, model, "off", "http://x", args.seed + 0)
    b = cell_args("copy", 16, args, model, "off", "http://x", args.seed + 1)
    assert a.seed != b.seed
    from phaseserve.stack.benchmark.cli import build_specs, _vocab
    pa, _ = build_specs(a, _vocab(a, model))
    pb, _ = build_specs(b, _vocab(b, model))
    assert [s.prompt for s in pa] != [s.prompt for s in pb[:len(pa)]]


def test_a_repeated_cell_is_compared_with_the_same_round_of_its_baseline():
    cells = [{"config": cfg, "workload": "copy", "concurrency": 16, "tpot_p50_ms": t, "output_tok_s": x}
             for cfg, t, x in (("off", 10.0, 100.0), ("ngram", 5.0, 150.0), ("off", 20.0, 50.0),
                               ("ngram", 10.0, 60.0))]
    add_ratios(cells)
    assert [c["round"] for c in cells] == [0, 0, 1, 1]
    assert cells[1]["tok_s_vs_off"] == 1.5 and cells[3]["tok_s_vs_off"] == 1.2


def _step(t, decodes, prefill, spec=None):
    line = {"event": "step", "timestamp": t, "step_ms": 10.0, "decodes": decodes, "prefill_tokens": prefill}
    if spec:
        line.update(draft_slots=sum(d for d, _ in spec.values()), drafted=sum(d for d, _ in spec.values()),
                    kept=sum(k for _, k in spec.values()), spec=spec)
    return json.dumps(line)


def test_the_timeline_sums_each_requests_drafts_and_cuts_phases_at_the_last_first_token_and_first_finish(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "not json",
        _step("2026-01-01T00:00:00.500000Z", 0, 400),
        _step("2026-01-01T00:00:01.500000Z", 2, 0, {"r1-0": [3, 2]}),
        _step("2026-01-01T00:00:02.500000Z", 1, 0, {"r2-0": [4, 4]}),
        _step("2026-01-01T00:00:02.700000Z", 1, 0, {"r2-0": [4, 1]}),
    ]) + "\n")
    steps = spec_timeline.read_step_lines(log)
    assert len(steps) == 4
    wall0 = steps[0]["t"] - 0.5
    reqs = [{"success": True, "prompt_len": 8, "output_tokens": 5, "itl": [0.1, 0.1], "start_time": 100.0,
             "ttft": 1.0, "latency": 2.0, "request_id": "r1", "cached_tokens": 0},
            {"success": True, "prompt_len": 8, "output_tokens": 9, "itl": [0.1], "start_time": 100.0,
             "ttft": 1.2, "latency": 3.0, "request_id": "r2", "cached_tokens": 4}]
    rows = spec_timeline.per_request(reqs, steps, 100.0)
    assert [(r["drafted"], r["kept"], r["events"]) for r in rows] == [(3, 2, 3), (8, 5, 2)]
    ph = {p["phase"]: p for p in spec_timeline.phases(rows, steps, wall0, 3.0)}
    assert (ph["prefill"]["to_s"], ph["full"]["to_s"], ph["tail"]["to_s"]) == (1.2, 2.0, 3.0)
    assert ph["prefill"]["prefill_tokens"] == 400 and ph["full"]["drafted"] == 3
    assert ph["tail"]["steps"] == 2 and ph["tail"]["kept"] == 5


def test_the_workers_step_line_says_each_sequences_drafts_verified_and_kept():
    from phaseserve.wire import ScheduledChunk, StepPlan, StepResult, TokenEvent
    from phaseserve.workers.service import draft_fields

    plan = StepPlan(7, "w", [], [ScheduledChunk("a", 10, 1, [0], num_draft=4), ScheduledChunk("b", 20, 1, [1],
                                                                                            num_draft=2),
                                 ScheduledChunk("c", 30, 1, [2])])
    result = StepResult(7, "w", [TokenEvent("a", 3, [5, 6, 7]), TokenEvent("b", 4, [8]), TokenEvent("c", 5, [9])],
                        drafted={"a": 3, "b": 2})
    assert draft_fields(plan, result) == {"draft_slots": 6, "drafted": 5, "kept": 2,
                                          "spec": {"a": [3, 2], "b": [2, 0]}}
    plain = StepPlan(8, "w", [], [ScheduledChunk("c", 31, 1, [2])])
    assert draft_fields(plain, StepResult(8, "w", [TokenEvent("c", 6, [1])])) == {}
