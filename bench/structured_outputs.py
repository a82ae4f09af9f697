"""Structured outputs on the whole stack: what a JSON-schema constraint costs a stream.

One command, one stack: rounds of 16 concurrent streams constrained by a JSON schema (bench.grammar_schemas'
NESTED: a nested object, an array, an enum, required fields), each followed by the same 16 streams free
(same prompts, `ignore_eos`, each stream's max_tokens = the tokens its constrained twin produced, so both
batches carry the same token profile); rounds alternate so drift on a shared machine hits both alike.
Reports TPOT p50 of each kind and their ratio, the schema compile time (p50, max) of bench.grammar_schemas'
real schemas with the code the gateway runs (phaseserve.grammar.check on the served model's tokenizer),
and the mask time per token (p50, p99) from the stack's /metrics histogram. Every constrained output is
checked against the schema (jsonschema). With a stack of its own, also the worker's CPU a model step for
each kind (phaseserve.stack.benchmark.proc_cpu: CPU time, which other load on a shared machine does not change).

    python -m bench.structured_outputs [--model smollm2] [--streams 16] [--rounds 3] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import jsonschema

from bench.grammar_schemas import NESTED, SCHEMAS
from bench.servers import phaseserve_server
from phaseserve import grammar
from phaseserve.stack.benchmark.proc_cpu import ProcessTreeCPU
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.models import model_source
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.redis_server import free_port

PROMPTS = ["Describe a pet as JSON.", "Invent a dog and its owner.", "A bird's record, please.",
           "Give me a cat profile.", "Make up an animal with toys.", "Describe your neighbour's pet.",
           "A pet from a story.", "Describe a shelter animal."]
NAME = "bench-model"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, seed: int, max_tokens: int,
                  constrained: bool) -> tuple[str, int, float | None]:
    """(text, completion tokens, TPOT in seconds or None for a single token)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED}}
    else:
        body["ignore_eos"] = True
    first = last = None
    text, tokens = "", 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for _, data in sse_messages(resp):
            if data is None:
                break
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for c in data.get("choices", []):
                if c["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text += c["delta"]["content"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
    return text, tokens, tpot


class _WorkerCPU:
    """Worker CPU seconds and model steps over runs of one kind (phaseserve.stack.benchmark.proc_cpu; none without a server pid)."""

    def __init__(self, server_pid: int | None):
        self.server_pid, self.seconds, self.steps = server_pid, 0.0, 0

    def measure(self):
        return ProcessTreeCPU(self.server_pid) if self.server_pid else contextlib.nullcontext()

    def add(self, cpu) -> None:
        if isinstance(cpu, ProcessTreeCPU) and cpu.steps:
            self.seconds += cpu.by_role().get("worker", 0.0)
            self.steps += cpu.steps

    @property
    def per_step(self) -> float | None:
        return self.seconds / self.steps if self.steps else None


async def _rounds(url: str, streams: int, rounds: int, max_tokens: int, server_pid: int | None) -> dict:
    tpot = {"constrained": [], "free": []}
    cpu = {"constrained": _WorkerCPU(server_pid), "free": _WorkerCPU(server_pid)}
    invalid = 0
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for r in range(rounds):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
            seeds = [r * 1000 + i for i in range(streams)]
            with cpu["constrained"].measure() as measured:
                done = await asyncio.gather(*(_stream(session, url, p, s, max_tokens, True)
                                              for p, s in zip(prompts, seeds)))
            cpu["constrained"].add(measured)
            for text, _, t in done:
                try:
                    jsonschema.validate(json.loads(text), NESTED)
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
                if t is not None:
                    tpot["constrained"].append(t)
            with cpu["free"].measure() as measured:
                free = await asyncio.gather(*(_stream(session, url, p, s, max(n, 1), False)
                                              for p, s, (_, n, _) in zip(prompts, seeds, done)))
            cpu["free"].add(measured)
            tpot["free"] += [t for _, _, t in free if t is not None]
            print(f"round {r + 1}/{rounds}: constrained TPOT p50 {statistics.median(tpot['constrained']) * 1e3:.1f} ms, "
                  f"free {statistics.median(tpot['free']) * 1e3:.1f} ms", flush=True)
    return {"tpot": tpot, "invalid": invalid, "outputs": streams * rounds,
            "cpu_per_step": {k: v.per_step for k, v in cpu.items()}}


def compile_times(model_path: str) -> list[float]:
    tok = Tokenizer(model_path)
    engine_tok = grammar.engine_tokenizer(f"{model_path}/tokenizer.json", tok.vocab_size,
                                          tuple(sorted(tok.eos_token_ids)))
    schemas = [s for s, _ in SCHEMAS.values()] + [NESTED]
    grammar.check(grammar.json_schema(NESTED), engine_tok)  # the engine's one-time set-up is not a compile
    return [grammar.check(grammar.json_schema(s), engine_tok) for s in schemas]


def mask_quantiles(url: str) -> tuple[float, float, int]:
    """(p50, p99, count) of phaseserve_grammar_mask_seconds, interpolated in its buckets as Prometheus'
    histogram_quantile does."""
    body = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    buckets = []
    for line in body.splitlines():
        if line.startswith("phaseserve_grammar_mask_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.split()[-1])))
    total = buckets[-1][1] if buckets else 0

    def q(x: float) -> float:
        rank, prev_bound, prev_count = x * total, 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if bound == float("inf"):
                    return prev_bound
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-12)
            prev_bound, prev_count = bound, count
        return prev_bound

    return (q(0.5), q(0.99), int(total)) if total else (0.0, 0.0, 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="what `phaseserve up --model` takes (default: the default model)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--url", default=None, help="a running stack serving the model as 'bench-model' (else one is started)")
    args = p.parse_args(argv)
    model = model_source.resolve_model(args.model)
    server = None
    url = args.url
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="bench-structured-")) / "stack.log"
        server = phaseserve_server(Path(model.path), free_port(), NAME, log).start()
        url = server.url
    try:
        result = asyncio.run(_rounds(url, args.streams, args.rounds, args.max_tokens,
                                     server.proc.pid if server is not None else None))
        mask_p50, mask_p99, masks = mask_quantiles(url)
    finally:
        if server is not None:
            server.stop()
    compiles = compile_times(model.path)
    c, f = statistics.median(result["tpot"]["constrained"]), statistics.median(result["tpot"]["free"])
    print(f"\nmodel {model.name}, {args.streams} streams x {args.rounds} rounds each kind")
    print("| figure | value |")
    print("| --- | ---: |")
    print(f"| TPOT p50, constrained (JSON schema) | {c * 1e3:.2f} ms |")
    print(f"| TPOT p50, free (same token counts) | {f * 1e3:.2f} ms |")
    print(f"| ratio constrained / free | {c / f:.3f}x |")
    cc, cf = result["cpu_per_step"]["constrained"], result["cpu_per_step"]["free"]
    if cc and cf:  # CPU time: what other load on the machine does not change
        print(f"| worker CPU a step, constrained / free | {cc * 1e3:.2f} ms / {cf * 1e3:.2f} ms = {cc / cf:.3f}x |")
    print(f"| constrained outputs valid | {result['outputs'] - result['invalid']} / {result['outputs']} |")
    print(f"| schema compile p50 / max ({len(compiles)} schemas) | {statistics.median(compiles) * 1e3:.2f} ms / "
          f"{max(compiles) * 1e3:.2f} ms |")
    print(f"| mask time per token p50 / p99 (/metrics, {masks} masks) | {mask_p50 * 1e6:.1f} us / "
          f"{mask_p99 * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
