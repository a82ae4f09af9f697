"""LoRA adapters against the base model on one stack, side by side: streams spread over several adapters, and the
same number of streams on the base model, in alternating rounds.

  python -m bench.lora --model bundled                      # 16 streams over 4 adapters vs 16 on the base model
  python -m bench.lora --model smollm2 --rounds 4 --rank 16

One `phaseserve up` serves the model and `--adapters` random LoRA adapters (PEFT's format, rank `--rank` on
every linear of every layer, written into a temporary folder and served with --lora-modules). Each round runs
both arms one after the other, in alternating order (base first in even rounds): `--streams` concurrent
streaming completions of random token-id prompts (`--input-len` in, `--output-len` out, greedy, ignore_eos),
on the base model, or request i on adapter i % adapters. A first round of both arms warms up (adapters
loaded, kernels compiled) and is not counted. Prints per arm output tok/s (over the arm's wall time), TTFT
and ITL p50/p99, and the ratio of the LoRA arm's tok/s to the base arm's; writes the JSON into --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.servers import phaseserve_server
from phaseserve.stack.benchmark.loadgen import ClientConfig, OpenAIStreamClient, run_load
from phaseserve.stack.benchmark.metrics import RequestResult, calculate_metrics
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.stack.benchmark.workloads import RequestSpec
from phaseserve.redis_server import free_port

TABLE = (("output tok/s", "output_throughput", "{:.1f}"), ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
         ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"), ("ITL p50 ms", "median_itl_ms", "{:.1f}"),
         ("ITL p99 ms", "p99_itl_ms", "{:.1f}"), ("failed", "failed", "{}"))
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled",
                   help="bundled, small-200m, smollm2, or anything `phaseserve up --model` takes")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=16, help="concurrent streams per arm")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (each runs both arms)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for `phaseserve up` (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def write_adapter(folder: Path, model_dir: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter on every linear of every layer, in PEFT's format (no peft needed to write one)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for block, modules in MODULES.items():
            for m in modules:
                n_in, n_out = shapes[m]
                name = f"base_model.model.model.layers.{layer}.{block}.{m}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [m for ms in MODULES.values() for m in ms], "task_type": "CAUSAL_LM"}))
    return folder


def prompts(n: int, length: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


async def run_arm(session: aiohttp.ClientSession, url: str, models: list[str], batch: list[list[int]],
                  output_len: int) -> tuple[list[RequestResult], float]:
    """One wave: request i on models[i % len(models)], all at once."""
    clients = {m: OpenAIStreamClient(ClientConfig(url, m), session) for m in models}
    specs = [RequestSpec("completions", p, len(p), output_len, group=models[i % len(models)])
             for i, p in enumerate(batch)]
    return await run_load(lambda s: clients[s.group].send(s), specs, None, float("inf"))


async def bench(url: str, base: str, adapters: list[str], args, vocab: int) -> dict:
    rng = np.random.default_rng(args.seed)
    arms = {"base": [base], "lora": adapters}
    results: dict[str, list[RequestResult]] = {"base": [], "lora": []}
    seconds = {"base": 0.0, "lora": 0.0}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = ("base", "lora") if rnd % 2 == 0 else ("lora", "base")
            for arm in order:
                out, wall = await run_arm(session, url, arms[arm], prompts(args.streams, args.input_len, vocab, rng),
                                          args.output_len)
                failed = [r.error for r in out if not r.success]
                if failed:
                    raise RuntimeError(f"{arm} arm, round {rnd}: {len(failed)} failed, e.g. {failed[0]}")
                if rnd > 0:
                    results[arm] += out
                    seconds[arm] += wall
                print(f"round {rnd} {arm}: {sum(r.output_tokens for r in out) / wall:.1f} tok/s", flush=True)
    return {arm: calculate_metrics(results[arm], seconds[arm]) for arm in arms}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base = "bench-model"
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        names = [f"adapter{k}" for k in range(args.adapters)]
        modules = [f"{n}={write_adapter(Path(tmp) / n, Path(model_dir), args.rank, args.seed + k)}"
                   for k, n in enumerate(names)]
        extra = ["--lora-modules", *modules, "--max-loras", str(args.adapters),
                 "--max-lora-rank", str(args.rank), *args.phaseserve_arg]
        proc = phaseserve_server(Path(model_dir), free_port(), base, out / f"lora-{tag}.log", extra=extra)
        proc.start(args.startup_timeout)
        try:
            metrics = asyncio.run(bench(proc.url, base, names, args, vocab))
        finally:
            proc.stop()
    ratio = metrics["lora"]["output_throughput"] / metrics["base"]["output_throughput"]
    print(f"\nmodel {model_dir} | {args.streams} streams, {args.input_len} in, {args.output_len} out, "
          f"{args.rounds} rounds | LoRA arm: {args.adapters} adapters of rank {args.rank} on every linear")
    print("| arm | " + " | ".join(h for h, _, _ in TABLE) + " |")
    print("| --- " * (len(TABLE) + 1) + "|")
    for arm in ("base", "lora"):
        print(f"| {arm} | " + " | ".join(f.format(metrics[arm][k]) for _, k, f in TABLE) + " |")
    print(f"LoRA / base output tok/s: {ratio:.2f}x")
    path = out / f"lora-{tag}.json"
    path.write_text(json.dumps({"model": str(model_dir), "args": vars(args), "metrics": metrics, "ratio": ratio},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
