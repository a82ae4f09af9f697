"""The benchmark client drives the real phaseserve stack, and the in-process engine backend runs."""

import json

import pytest

from phaseserve.stack.benchmark.cli import main as bench_main
from e2e_stack import running_stack
from model_factory import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bench-model"), "llama", max_position_embeddings=512)


def test_bench_against_phaseserve_up(model_dir, tmp_path, capsys):
    out = tmp_path / "served.json"
    with running_stack(model_dir, tmp_path) as stack:
        code = bench_main(["--base-url", stack.base_url, "--model", str(model_dir), "--num-prompts", "8",
                           "--input-len", "16", "--output-len", "8", "--concurrency", "4", "--no-progress",
                           "--json-out", str(out)])
        text = capsys.readouterr().out
        assert code == 0, text + stack.logs()[-3000:]
    r = json.loads(out.read_text())
    m = r["metrics"]
    assert r["served_model"] == stack.model
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == 64  # ignore_eos + max_tokens honoured: exactly 8 tokens each
    assert m["total_input_tokens"] == 8 * 16
    assert 0 < m["p50_ttft_ms"] <= m["p50_e2el_ms"]
    assert m["mean_tpot_ms"] > 0 and m["output_throughput"] > 0
    assert all(q["success"] and len(q["itl"]) >= 1 for q in r["requests"])


def test_engine_backend_reports_throughput_only(model_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    code = bench_main(["--backend", "engine", "--model", str(model_dir), "--num-prompts", "6", "--input-len", "16",
                       "--output-len", "8", "--concurrency", "4", "--engine-setting", "dtype=float32",
                       "--engine-setting", "num_blocks=64", "--json-out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 6 and m["total_output_tokens"] == 48
    assert m["output_throughput"] == pytest.approx(48 / m["duration"])
    assert "p99_ttft_ms" not in m  # one generate() call has no per-token timing
    assert "throughput only" in text
