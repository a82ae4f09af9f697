"""The scaling bench: its quick path end to end against `phaseserve up` on the bundled model, and the
steady decode step it reads from streamed gaps."""

import json

import pytest

from bench.scaling import _ints, main, steady_decode_step
from bench.scaling_report import best_vllm, format_tables, growth


def stream(start, ttft, gaps, tokens=None):
    return {"success": True, "start_time": start, "ttft": ttft, "itl": list(gaps), "latency": ttft + sum(gaps),
            "output_tokens": tokens or len(gaps) + 1}


def test_steady_step_uses_only_gaps_with_every_request_decoding():
    # b's first token comes at 0.5, a ends at 1.0: only a's gaps inside [0.5, 1.0] (0.1 each) and b's
    # inside it count; a's early 0.3 gap (prefill of b mixed in) and b's late 0.9 gap (a gone) do not
    a = stream(0.0, 0.1, [0.3, 0.1, 0.1, 0.1, 0.1, 0.1])  # tokens at 0.1 0.4 0.5 0.6 0.7 0.8 0.9 (ends 0.9)
    b = stream(0.0, 0.5, [0.1, 0.1, 0.1, 0.9])  # tokens at 0.5 0.6 0.7 0.8 1.7
    step, used, merged = steady_decode_step([a, b])
    assert step == pytest.approx(0.1) and used == 4 + 3 and merged == 0
    # a request whose chunks carry several tokens says nothing per token: left out, and most such: no figure
    c = stream(0.0, 0.1, [0.2, 0.2, 0.2], tokens=8)
    assert steady_decode_step([a, b, c])[0] == pytest.approx(0.1) and steady_decode_step([a, b, c])[2] == 1
    assert steady_decode_step([c, c, a])[0] is None
    # one merged pair among eleven chunks: kept, each gap shared by 12/11 tokens
    d = stream(0.0, 0.5, [0.11] * 9 + [0.2], tokens=12)
    assert steady_decode_step([d])[0] == pytest.approx(sum([0.11] * 9 + [0.2]) / 10 / (12 / 11))
    # no stretch where both decode: the first ends before the second starts
    late = stream(5.0, 0.1, [0.1, 0.1])
    assert steady_decode_step([a, late]) == (None, 0, 0)
    assert steady_decode_step([]) == (None, 0, 0)


def test_tables_give_ratios_against_the_best_vllm_mode_and_the_growth_verdict():
    def run(label, server, tok_s, steps):
        return {"label": label, "server": server,
                "concurrency": [{"concurrency": 4, "output_tok_s": tok_s, "tpot_p50_ms": 10.0, "tpot_p99_ms": 20.0,
                                 "load_avg": 1.0, "failed": 0, "merged_chunks": 0}],
                "context": [{"context": c, "tpot_p50_ms": s, "step_ms": s, "requests": 16} for c, s in zip((128, 4096), steps)]}

    runs = [run("phaseserve", "phaseserve", 300.0, (10.0, 15.0)), run("vllm-auto", "vllm", 100.0, (20.0, 50.0)),
            run("vllm-all", "vllm", 200.0, (25.0, 40.0))]
    vllm = best_vllm(runs)
    assert vllm["concurrency"][0]["output_tok_s"] == 200.0
    assert [r["step_ms"] for r in vllm["context"]] == [20.0, 40.0]
    report = {"runs": runs, "vllm": vllm, "engine": None, "concurrency_levels": [4], "context_levels": [128, 4096],
              "settings": {"context_batch": 16}, "notes": [],
              "machine": {"cpus": 2, "threads": 2, "memory_read_gb_s": 20.0, "bf16_gemm_gflop_s": 300.0,
                          "load_avg": [1.0, 1.0, 1.0]},
              "growth": {"phaseserve": growth(runs[0]["context"]), "vllm": growth(vllm["context"])}}
    text = format_tables(report)
    assert "20.0 GB/s" in text and "300 GFLOP/s" in text
    # K/V floor: 16 sequences x 4096 tokens x 32 KiB (small-200m's K/V per token) at 20 GB/s
    report["kv_bytes_per_token"] = 32 << 10
    assert "| 4096 | 15.0 / 15.0 | 50.0 / 50.0 | 40.0 / 40.0 | 0.38x | 107.4 |" in format_tables(report)
    assert "| 4 | **phaseserve / vLLM** | **1.50x** |" in text
    assert "| 4096 | 15.0 / 15.0 | 50.0 / 50.0 | 40.0 / 40.0 | 0.38x |" in text
    assert "phaseserve: 1.50x from context 128 to 4096 (+5.0 ms)" in text
    assert "vllm: 2.00x from context 128 to 4096 (+20.0 ms)" in text
    assert "grows slower than vLLM's in ratio and less in milliseconds" in text
    # a level with failed requests (not a full batch) or no step leaves the span both servers measured
    runs[1]["context"][1]["failed"] = runs[2]["context"][1]["failed"] = 3
    assert growth(best_vllm(runs)["context"]) is None
    assert growth(runs[0]["context"], {128}) is None  # one context is no span


def test_levels_parse_strictly():
    assert _ints("1,4, 16") == (1, 4, 16)
    import argparse

    for bad in ("", "a", "0", "4,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _ints(bad)


def test_bad_input_is_a_message_not_a_traceback(capsys):
    assert main(["--servers", "sglang", "--no-engine"]) == 2
    assert "unknown server" in capsys.readouterr().err
    assert main(["--model", "bundled", "--contexts", "32", "--context-output-len", "64"]) == 2
    assert "must exceed" in capsys.readouterr().err


def test_quick_scaling_run_against_phaseserve_up(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    code = main(["--model", "bundled", "--servers", "phaseserve", "--quick", "--out-dir", str(tmp_path),
                 "--png", str(png)])
    text = capsys.readouterr().out
    logs = "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert code == 0, text + logs
    report = json.loads(next(tmp_path.glob("scaling-*[0-9].json")).read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert report["concurrency_levels"] == [1, 4] and report["context_levels"] == [64, 128]
    # measured figures, not checked against a speed (a benchmark's business): present and positive
    assert report["machine"]["memory_read_gb_s"] > 0 and report["machine"]["bf16_gemm_gflop_s"] > 0
    (run,) = report["runs"]
    assert run["label"] == "phaseserve" and report["vllm"] is None
    for row, level in zip(run["concurrency"], (1, 4)):
        assert row["concurrency"] == level and row["failed"] == 0 and row["requests"] == max(2 * level, 4)
        assert row["output_tok_s"] > 0 and 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"] < 10_000
    for row, context in zip(run["context"], (64, 128)):
        assert row["context"] == context and row["failed"] == 0 and row["requests"] == 4
        assert row["step_ms"] is not None and 0 < row["step_ms"] < 10_000 and row["step_gaps"] > 0
    assert [r["context"] for r in report["engine"]] == [64, 128]
    assert all(0 < r["step_ms"] < 10_000 for r in report["engine"])
    assert set(report["growth"]) == {"phaseserve", "phaseserve engine"}
    assert report["kv_bytes_per_token"] == 6 * 2 * 4 * 32 * 2  # bundled: 6 layers, 4 KV heads of 32, bf16
    # the printed markdown: one row per level, the machine's figures above
    assert "memory read" in text and "GFLOP/s" in text
    assert sum(line.startswith("| 1 | phaseserve |") or line.startswith("| 4 | phaseserve |")
               for line in text.splitlines()) == 2
    assert any(line.startswith("| 128 | ") for line in text.splitlines())
    # the saved report replots from its saved requests, with the same decode steps
    assert main(["--recompute", str(next(tmp_path.glob("scaling-*[0-9].json"))), "--png", str(tmp_path / "re.png")]) == 0
    again = json.loads(next(tmp_path.glob("scaling-*.recomputed.json")).read_text())
    assert [r["step_ms"] for r in again["runs"][0]["context"]] == [r["step_ms"] for r in run["context"]]
    assert (tmp_path / "re.png").read_bytes()[:4] == b"\x89PNG"


def test_vllm_never_sees_this_checkouts_pythonpath(tmp_path, monkeypatch):
    import sys

    from bench.servers import vllm_server

    monkeypatch.setenv("PYTHONPATH", "/some/checkout")
    proc = vllm_server(tmp_path, 1, "m", tmp_path / "v.log", vllm_bin=sys.executable, threads="all", model_len=64)
    assert "PYTHONPATH" not in proc.env  # its `kernels` import would find phaseserve's package
    assert proc.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
