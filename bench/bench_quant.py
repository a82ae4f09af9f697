"""Weight-only quantization: decode/prefill speed, memory and held-out perplexity of none (bf16), int8, int4.

    python -m bench.bench_quant [--model smollm2 | DIR | FILE.gguf] [--modes none,int8,int4] [--rounds 2] [--threads 1]
                                [--dtype bfloat16 | float32] [--decode-b1-only]

A mode is a --quantization value, optionally with an --activation-quant one after a colon: `--model smollm2
--dtype float32 --modes auto,auto:int8` compares the GGUF's weights as stored with float32 activations (auto)
and with int8 activations (auto:int8). (`none` dequantizes a GGUF's blocks: the same values, so the int4
weights' own effect needs a model whose unquantized weights are at hand, e.g. `--model bundled --modes
none,int4,int4:int8`.)

--model: anything `phaseserve up --model` takes (smollm2, a folder, a GGUF); default: a random bf16 model with
SmolLM2-135M's shapes (built once into the temp dir; its perplexity says nothing about quality, only how
far each mode moves it). Speed (--rounds 0: none): every mode's model loaded in this process, the modes measured in turn for
--rounds rounds (side by side on a busy machine), the best round counts: decode tok/s at batch 1 and 16
(CONTEXT tokens of context per sequence) and prefill tok/s (one PREFILL-token prompt). Memory and
quality: each mode once more in a fresh process, so its resident memory after load is its own; the
bytes of the weights as held; perplexity on held-out text: Python's own stdlib files that the bundled
model held out of its training (phaseserve/bundled_model/eval.json), first --ppl-tokens tokens; greedy
agreement: the share of those positions where a mode's most likely next token is the first mode's (and, for a
mode with int8 activations, the same weights' without them).
Beside them, this machine's memory bandwidth and GEMM rate in --dtype (bench/bench_model.py's
measurements), and a batch-1 decode step's time over its floor (the weight bytes a step reads / that bandwidth). --dtype float32: the activations of a CPU without AVX512-BF16 (with PHASESERVE_CPU_ISA=avx2,
what such a CPU runs). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from bench.bench_model import RunnerBench, machine_line, measure_bandwidth, measure_matmul
from bench.bench_model import best as best_of
from bench.bench_model import weight_bytes as step_weight_bytes
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan

CONTEXT = 128
DECODE_BATCHES = (1, 16)
PREFILL = 256
PPL_CHUNK = 256
ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def random_smollm2(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / "phaseserve-bench-random-smollm2-shapes"
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPES)).to(torch.bfloat16).save_pretrained(path)
        sys.path.insert(0, str(ROOT / "tests"))
        from model_factory import write_tokenizer  # a byte-level BPE padded to the vocab

        write_tokenizer(path, SMOLLM2_SHAPES["vocab_size"])
    return path


def model_folder(model: str | None) -> Path:
    """None: a random bf16 model of SmolLM2's shapes; else anything --model takes (smollm2, a GGUF, ...)."""
    if model is None:
        return random_smollm2(Path(tempfile.gettempdir()))
    from phaseserve.models import model_source

    try:
        return Path(model_source.resolve_model(model).path)
    except model_source.ModelNotFound as e:
        raise SystemExit(f"bench_quant: {e}") from None


def held_out_text() -> tuple[str, list[str]]:
    """The stdlib files the bundled model held out of training, concatenated."""
    names = json.loads((ROOT / "phaseserve" / "bundled_model" / "eval.json").read_text())["held_out_paths"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = [n for n in names if (stdlib / n).is_file()]
    return "\n\n".join((stdlib / n).read_text(errors="replace") for n in found), found


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def split_mode(mode: str) -> tuple[str, str]:
    """"auto:int8" -> ("auto", "int8"): the --quantization and --activation-quant of a mode."""
    quantization, _, activations = mode.partition(":")
    return quantization, activations or "none"


class QuantBench(RunnerBench):
    def __init__(self, path: Path, mode: str, threads: int, dtype: str = "bfloat16"):
        from phaseserve.workers.runner import ModelRunner

        quantization, activations = split_mode(mode)
        self.runner = ModelRunner(path, dtype=dtype, kv_cache_memory_bytes=160 << 20,
                                  quantization=quantization, num_threads=threads, activation_quant=activations)
        self.step = 0
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)

    def weight_bytes(self) -> int:
        m = self.runner.model
        linears = [m.lm_head] + [t for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        embed = m.embed.nbytes() if hasattr(m.embed, "kind") else m.embed.nbytes
        return sum(t.nbytes() for t in linears) + embed

    @torch.inference_mode()
    def perplexity(self, ids: list[int]) -> tuple[float, list[int]]:
        """exp(mean NLL) of every next token, the sequence prefilled in PPL_CHUNK-token chunks; and the most
        likely next token at each position."""
        r = self.runner
        blocks = list(range(-(-len(ids) // r.block_size)))
        self._exec(starts=[SeqStart("ppl", "g", ids, self.params)])
        nll, pos, top = 0.0, 0, []
        while pos < len(ids) - 1:
            n = min(PPL_CHUNK, len(ids) - 1 - pos)
            inp, _ = r.packer.pack([ScheduledChunk("ppl", pos, n, blocks[:-(-(pos + n) // r.block_size)])])
            inp.logits_indices = torch.arange(n)
            logits = r.model.forward(inp, r.kv)
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[pos + 1:pos + 1 + n]),
                                                     reduction="sum").item()
            top += logits.argmax(-1).tolist()
            pos += n
        self._exec(releases=["ppl"])
        return math.exp(nll / (len(ids) - 1)), top


def speeds(bench: QuantBench, repeats: int, decode_only: bool = False, timer=None) -> dict:
    out = {f"decode_{b}": b / bench.decode_step_time(b, repeats, timer=timer)
           for b in (DECODE_BATCHES[:1] if decode_only else DECODE_BATCHES)}
    if not decode_only:
        out["prefill"] = PREFILL / bench.prefill_time(PREFILL, max(3, repeats // 4))
    return out


def child(args) -> dict:
    """Memory and perplexity of one mode, alone in this process."""
    path = Path(args.model)
    bench = QuantBench(path, args.child, args.threads, args.dtype)
    m = bench.runner.model
    out = {"mode": args.child, "rss": rss_bytes(), "weights": bench.weight_bytes(),
           "linear_kinds": sorted({getattr(lin, "kind", args.dtype) for layer in m.layers
                                   for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}),
           "lm_head": getattr(m.lm_head, "kind", args.dtype), "activation_quant": m.activation_quant}
    from tokenizers import Tokenizer

    text, _ = held_out_text()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    ids = ids[: min(args.ppl_tokens, bench.runner.max_model_len)]
    out["ppl"], out["top"] = bench.perplexity(ids)
    out["ppl_tokens"] = len(ids)
    return out


def run_child(folder: Path, mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_quant", "--child", mode, "--model", str(folder),
           "--threads", str(args.threads), "--ppl-tokens", str(args.ppl_tokens), "--dtype", args.dtype]
    env = dict(os.environ, PHASESERVE_LOG_LEVEL="warning")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"bench_quant: mode {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf file; default: random SmolLM2 shapes")
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--rounds", type=int, default=3,
                   help="speed: each mode this many times, in turn; best counts (0: perplexity only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20, help="decode steps timed per batch size (median)")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the activations' dtype")
    p.add_argument("--decode-b1-only", action="store_true",
                   help="speed: batch-1 decode steps only, the fastest of --repeats (on a busy machine the step's "
                        "own time), against its floor")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    folder = model_folder(args.model)
    modes = args.modes.split(",")
    torch.set_num_threads(args.threads)
    bw, flops = measure_bandwidth(), measure_matmul(getattr(torch, args.dtype))
    print(f"machine: {bw / 1e9:.1f} GB/s memory read, {flops / 1e9:.0f} GFLOP/s {args.dtype} GEMM (2048^3), "
          f"{args.threads} thread(s); {machine_line()}; model {folder}", flush=True)
    benches = {mode: QuantBench(folder, mode, args.threads, args.dtype) for mode in modes} if args.rounds else {}
    best: dict[str, dict] = {mode: {} for mode in modes}
    for _ in range(args.rounds):
        bw = max(bw, measure_bandwidth())  # the machine's bandwidth: a busy neighbour only lowers a reading
        for mode, bench in benches.items():
            r = speeds(bench, args.repeats, args.decode_b1_only, best_of if args.decode_b1_only else None)
            b = best[mode]
            for k, v in r.items():
                b[k] = max(b.get(k, 0.0), v)
    for mode, bench in benches.items():  # a decode step reads every weight but the embedding table
        best[mode]["floor_1"] = step_weight_bytes(bench.runner) / bw
    del benches
    if args.rounds:
        print(f"memory read, best of the rounds: {bw / 1e9:.1f} GB/s (the floors' bandwidth)")
    for mode in modes:
        best[mode].update(run_child(folder, mode, args))
    _, files = held_out_text()
    print(f"perplexity text: {len(files)} held-out stdlib files ({', '.join(files[:3])}, ...), "
          f"first {best[modes[0]]['ppl_tokens']} tokens")
    base = best[modes[0]]
    print(f"| mode | linears / lm_head | activations | decode b1 tok/s | b1 step / its floor | decode b16 tok/s "
          f"| prefill tok/s | weights MB | RSS MB | perplexity (vs {modes[0]}) | greedy agreement with {modes[0]} "
          f"| with the same weights' float activations |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        r = best[mode]

        def rel(k):
            return f"{r[k]:.1f} ({r[k] / base[k]:.2f}x)" if k in r and k in base else "-"

        def agreement(other: dict) -> str:
            return f"{sum(a == b for a, b in zip(r['top'], other['top'])) / len(r['top']):.2%}"

        quantization, activations = split_mode(mode)
        float_twin = best.get(quantization) if activations != "none" else None
        floor = f"{1 / r['decode_1'] / r['floor_1']:.2f}x" if "decode_1" in r else "-"
        print(f"| {mode} | {'+'.join(r['linear_kinds'])} / {r['lm_head']} | {r['activation_quant']} | {rel('decode_1')} "
              f"| {floor} | {rel('decode_16')} | {rel('prefill')} | {r['weights'] / 1e6:.0f} | {r['rss'] / 1e6:.0f} "
              f"| {r['ppl']:.3f} ({r['ppl'] / base['ppl'] - 1:+.2%}) | {agreement(base)} "
              f"| {agreement(float_twin) if float_twin else '-'} |")


if __name__ == "__main__":
    main()
