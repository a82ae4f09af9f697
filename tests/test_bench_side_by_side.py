"""The side-by-side runner's table, ratios, workload defaults and vLLM thread settings; plotting saved results."""

import json

import pytest

from bench.servers import vllm_thread_env
from bench.side_by_side import bench_args, format_table, ratios
from phaseserve.stack.benchmark.cli import main as bench_main


def run(label, tput, ttft99, tpot99, latency=True):
    m = {"output_throughput": tput, "request_throughput": tput / 64, "failed": 0, "completed": 8}
    if latency:
        for p in (50, 90, 99):
            m.update({f"p{p}_ttft_ms": ttft99 * p / 99, f"p{p}_tpot_ms": tpot99 * p / 99,
                      f"p{p}_itl_ms": tpot99, f"p{p}_e2el_ms": 1000.0})
    return {"label": label, "backend": "engine" if not latency else "openai", "percentiles": [50, 90, 99],
            "workload": {"workload": "random"}, "metrics": m}


def test_ratios_are_against_vllm_and_table_shows_every_run():
    runs = [run("vllm", 100.0, 400.0, 20.0), run("phaseserve", 50.0, 800.0, 30.0), run("engine", 80.0, 0, 0, False)]
    r = ratios(runs)
    assert r["phaseserve/vllm"] == {"output tok/s": 0.5, "TTFT p99": 2.0, "TPOT p99": 1.5}
    assert r["engine/vllm"]["output tok/s"] == 0.8 and r["engine/vllm"]["TTFT p99"] is None
    table = format_table(runs)
    assert "phaseserve" in table.splitlines()[0]
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT p99"))
    assert ttft_row.split()[-3:] == ["400.0", "800.0", "-"]
    assert ratios(runs[1:]) == {}  # no vLLM run, nothing to divide by


def test_workload_a_defaults_and_overrides():
    a = bench_args([], "/m", "vllm", "http://x", "openai", "name")
    assert (a.workload, a.num_prompts, a.input_len, a.output_len, a.concurrency, a.temperature, a.ignore_eos) == \
        ("random", 64, 128, 64, 16, 0.0, True)
    b = bench_args(["--num-prompts=8", "--workload", "interference"], "/m", "vllm", "http://x", "openai", None)
    assert b.num_prompts == 8 and b.workload == "interference" and b.served_model_name is None


def test_vllm_thread_settings():
    assert vllm_thread_env("auto") == {}
    env = vllm_thread_env("all")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    with pytest.raises(ValueError):
        vllm_thread_env("many")


def test_plot_combines_saved_results(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run("vllm", 100.0, 400.0, 20.0)))
    b.write_text(json.dumps({"runs": [run("phaseserve", 50.0, 800.0, 30.0), run("engine", 80.0, 0, 0, False)]}))
    out = tmp_path / "cmp.png"
    assert bench_main(["plot", str(out), str(a), str(b)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert bench_main(["plot", str(out)]) == 2


def test_client_cpus_pin_only_the_run_and_parse_strictly():
    import argparse
    import os

    import pytest

    from phaseserve.stack.benchmark import cli

    assert cli._cpu_list("1") == [1] and cli._cpu_list("3, 2,3") == [2, 3]
    for bad in ("", "a", "1;2", "3-1", "-1", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._cpu_list(bad)
    before = os.sched_getaffinity(0)
    one = min(before)
    with cli.client_on([one]):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == before  # servers started after the run must not inherit it
    with cli.client_on(None):
        assert os.sched_getaffinity(0) == before


def test_compute_ceiling_counts_the_models_matmuls(tmp_path):
    """bench/ceiling.py's FLOPs equal the runner's own count (bench_model's prefill and decode FLOPs) for the
    bundled model, and the ceiling is output tokens over FLOPs / GEMM rate."""
    from pathlib import Path

    from bench.bench_model import RunnerBench, decode_flops, prefill_flops
    from bench.ceiling import ceiling, workload_flops
    from bench.side_by_side import workload_ceiling
    from phaseserve.workers.loader import read_config

    bundled = Path(__file__).resolve().parent.parent / "phaseserve" / "bundled_model"
    cfg = read_config(bundled)
    runner = RunnerBench(bundled, "float32", kv_cache_memory_bytes=1 << 24).runner
    lm_head = 2 * runner.model.lm_head.numel()
    # one prompt of 7 tokens and one output token: the prefill and its lm_head row, nothing else
    assert workload_flops(cfg, 1, 7, 1) == pytest.approx(prefill_flops(runner, 7))
    # each later output token is a decode row: linears and lm_head (decode_flops leaves attention out)
    one_more = workload_flops(cfg, 1, 7, 2) - workload_flops(cfg, 1, 7, 1)
    attention = one_more - decode_flops(runner, 1)
    assert 0 < attention < 0.05 * one_more
    c = ceiling(bundled, 64, 128, 64, gemm=(1e11, 2))
    assert c.output_tok_s == pytest.approx(64 * 64 / (workload_flops(cfg, 64, 128, 64) / 1e11))
    assert "2 threads" in c.describe()
    served = run("phaseserve", 50.0, 800.0, 30.0)
    served["metrics"].update(total_input_tokens=8 * 128, total_output_tokens=8 * 64)
    assert workload_ceiling(bundled, served, (1e11, 2)).output_tok_s == pytest.approx(
        ceiling(bundled, 8, 128, 64, gemm=(1e11, 2)).output_tok_s)
    served["workload"]["workload"] = "interference"
    assert workload_ceiling(bundled, served, (1e11, 2)) is None
