"""Prefix caching on a shared-prefix chat mix: phaseserve with its cache off, on, and vLLM with its prefix
caching on, one after the other on the same machine, with the same client.

  python -m bench.prefix_cache                                    # the full run (vLLM: PHASESERVE_BENCH_VLLM)
  python -m bench.prefix_cache --servers phaseserve-off,phaseserve-on --system-tokens 200 --turns 3 \\
      --sessions 2 --concurrency 1,2 --max-tokens 8               # a smoke run, phaseserve only

The mix: every chat starts with the same system prompt (--system-tokens, at least 1,000 by default), then
--turns user turns; each turn resends the whole history (system, every question and answer so far) and
asks for --max-tokens tokens (greedy, ignore_eos). At each --concurrency C, max(C, --sessions) chats run, C at
a time, each one turn after another; each concurrency level has chats of its own (only the system prompt is
shared between levels). Reported per server and level: TTFT p50/p99 over all turns, TTFT p50 of the first
turn and of the later ones (a resent history: what the cache is for), output tok/s over the level's wall
time, and the hit rate the server's /metrics counted over the level (hits / queries, in tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from bench.safetensors_folder import safetensors_folder
from bench.servers import DEFAULT_VLLM, VLLM_THREAD_MODES, phaseserve_server, vllm_server
from phaseserve.stack.benchmark.loadgen import ClientConfig, OpenAIStreamClient
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.stack.benchmark.workloads import RequestSpec
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.redis_server import free_port

SERVERS = ("phaseserve-off", "phaseserve-on", "vllm")
# (hits, queries) counters in each server's /metrics, in tokens
HIT_METRICS = {"phaseserve": ("phaseserve_prefix_cache_hits", "phaseserve_prefix_cache_queries"),
               "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}
WORDS = ("the model reads each request and answers within the limits that the operator set for latency and "
         "cost while the scheduler keeps every worker busy and no stream stalls behind a long prompt").split()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="what `phaseserve up --model` takes (default: SmolLM2)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, from {', '.join(SERVERS)}")
    p.add_argument("--system-tokens", type=int, default=1024, help="the shared system prompt's length, at least")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=40, help="each question's length, about")
    p.add_argument("--max-tokens", type=int, default=64, help="each answer's length")
    p.add_argument("--sessions", type=int, default=4, help="chats per concurrency level, at least (else C)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--vllm-bin", default=DEFAULT_VLLM, help="[env PHASESERVE_BENCH_VLLM]")
    p.add_argument("--vllm-threads", choices=VLLM_THREAD_MODES, default="auto")
    p.add_argument("--vllm-kv-gib", type=int, default=2)
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for both phaseserve runs (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(tokenizer: Tokenizer, min_tokens: int) -> str:
    """Plain sentences, deterministic, until the tokenizer counts at least `min_tokens`."""
    rng = random.Random(1234)
    text = "You are the assistant of a service team. Follow these notes.\n"
    while len(tokenizer.encode(text, add_special_tokens=False)) < min_tokens:
        text += f"Note {rng.randrange(1000)}: {words(rng, 24)}.\n"
    return text


def scrape(url: str, names: tuple[str, str]) -> tuple[float, float]:
    """(hits, queries) summed over every series of the two counters; (0, 0) where a server has none."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = []
    for name in names:
        vals = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
        out.append(sum(float(v) for v in vals))
    return out[0], out[1]


async def run_level(url: str, model: str, system: str, concurrency: int, args, level_seed: int) -> dict:
    """max(C, --sessions) chats, C at a time; returns the level's figures."""
    n_sessions = max(concurrency, args.sessions)
    rng = random.Random(level_seed)
    questions = [[f"Chat {level_seed}-{s}, question {t}: {words(rng, args.user_tokens)}?"
                  for t in range(args.turns)] for s in range(n_sessions)]
    results: list[tuple[int, object]] = []  # (turn, RequestResult)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        client = OpenAIStreamClient(ClientConfig(url, model), session)

        async def chat(s: int) -> None:
            async with sem:
                history = [{"role": "system", "content": system}]
                for t, q in enumerate(questions[s]):
                    history.append({"role": "user", "content": q})
                    r = await client.send(RequestSpec("chat", list(history), 0, args.max_tokens))
                    if not r.success:
                        raise RuntimeError(f"chat {s} turn {t} failed: {r.error}")
                    results.append((t, r))
                    history.append({"role": "assistant", "content": r.generated_text})

        t0 = time.perf_counter()
        await asyncio.gather(*(chat(s) for s in range(n_sessions)))
        wall = time.perf_counter() - t0
    ttft_ms = np.array([r.ttft for _, r in results]) * 1e3
    first = [r.ttft * 1e3 for t, r in results if t == 0]
    later = [r.ttft * 1e3 for t, r in results if t > 0]
    return {"concurrency": concurrency, "sessions": n_sessions, "requests": len(results),
            "p50_ttft_ms": float(np.percentile(ttft_ms, 50)), "p99_ttft_ms": float(np.percentile(ttft_ms, 99)),
            "p50_ttft_first_turn_ms": float(np.median(first)),
            "p50_ttft_later_turns_ms": float(np.median(later)) if later else None,
            "output_tok_s": sum(r.output_tokens for _, r in results) / wall,
            "mean_prompt_tokens": float(np.mean([r.prompt_len for _, r in results])), "wall_s": wall}


def start_server(kind: str, model_dir: Path, port: int, name: str, log_path: Path, args):
    if kind == "vllm":
        proc = vllm_server(safetensors_folder(model_dir), port, name, log_path, vllm_bin=args.vllm_bin,
                           threads=args.vllm_threads, kv_cache_gib=args.vllm_kv_gib, model_len=args.max_model_len,
                           dtype=args.vllm_dtype)
        proc.cmd.append("--enable-prefix-caching")
        return proc
    extra = list(args.phaseserve_arg) + (["--no-enable-prefix-caching"] if kind == "phaseserve-off" else [])
    return phaseserve_server(model_dir, port, name, log_path, model_len=args.max_model_len, extra=extra)


def format_table(rows: list[dict]) -> str:
    head = ("server", "C", "TTFT p50 ms", "TTFT p99 ms", "1st turn p50", "later turns p50", "output tok/s", "hit rate")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        later = r["p50_ttft_later_turns_ms"]
        hit = r["hit_rate"]
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['p50_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                     f"{r['p50_ttft_first_turn_ms']:.1f} | {'-' if later is None else f'{later:.1f}'} | "
                     f"{r['output_tok_s']:.1f} | {'-' if hit is None else f'{hit:.1%}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in SERVERS for s in servers):
        print(f"prefix_cache: servers must come from {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = resolve_model(args.model)
    system = system_prompt(Tokenizer.from_folder(str(model_dir)), args.system_tokens)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    rows: list[dict] = []
    for kind in servers:
        port = free_port()
        proc = start_server(kind, model_dir, port, "bench-model", out / f"prefix-cache-{tag}-{kind}.log", args)
        proc.start(args.startup_timeout)
        try:
            names = HIT_METRICS["vllm" if kind == "vllm" else "phaseserve"]
            for i, c in enumerate(levels):
                before = scrape(proc.url, names)
                row = asyncio.run(run_level(proc.url, "bench-model", system, c, args, args.seed * 100 + i))
                hits, queries = (a - b for a, b in zip(scrape(proc.url, names), before))
                row.update(server=kind, hit_rate=hits / queries if queries else None)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            proc.stop()
    print(f"\nmodel {model_dir} | system prompt >= {args.system_tokens} tokens, {args.turns} turns, "
          f"{args.max_tokens} tokens an answer")
    print(format_table(rows))
    path = out / f"prefix-cache-{tag}.json"
    path.write_text(json.dumps({"model": str(model_dir), "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
