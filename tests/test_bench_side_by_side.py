"""The side-by-side runner's table, ratios, workload defaults and vLLM thread settings; plotting saved results."""

import json

import pytest

from bench.cli import main as bench_main
from bench.servers import vllm_thread_env
from bench.side_by_side import bench_args, format_table, ratios


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

    from bench import cli

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
