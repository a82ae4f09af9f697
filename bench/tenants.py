"""`python -m bench.tenants`: one tenant's flood against another's interactive chats, with and without tenants.

Starts `phaseserve up` (default: the bundled model) with `--api-keys-file`, then runs, each on prompts of its
own (so no run finds another's prefixes cached):

- **B alone**: tenant B's `--chats` chat streams, `--turns` turns each (a short question, streamed
  `--chat-tokens` tokens, then the next turn with the history).
- **A alone**: tenant A's `--flood` long prompts (`--flood-words` words, about three tokens a word, streamed
  `--flood-tokens` tokens each), all at once.
- **tenants**: A's flood, and B's chats starting a moment later, A and B separate tenants of equal weight.
- **no tenants**: the same, with A's and B's keys in one tenant (the keys file rewritten; the gateway
  reloads it), which is what a stack without tenants does.

With `--rounds N` the four runs repeat N times in that order, each round on prompts of its own. It prints B's
TTFT and ITL (p50 / p99 over every round's turns pooled) and A's throughput (prompt + completion tokens a
second, from its first request to its last token; the mean of the rounds) for each run, B's p99s under the
flood over B's alone (the target: within 1.5x with tenants), and each round's ratios: B alone's p99 over one
round's few turns is close to its slowest turn, which moves from round to round on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from bench.servers import ServerProcess
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.redis_server import free_port

KEY_A, KEY_B = "sk-bench-tenant-a", "sk-bench-tenant-b"


def keys_file(separate: bool) -> dict:
    tenants = {"tenant-a": {"weight": 1}, "tenant-b": {"weight": 1}}
    return {"tenants": tenants, "keys": [{"name": "a", "key": KEY_A, "tenant": "tenant-a"},
                                         {"name": "b", "key": KEY_B, "tenant": "tenant-b" if separate else "tenant-a"}]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=64, help="tenant A's long prompts, sent at once")
    p.add_argument("--flood-words", type=int, default=450, help="words of each long prompt (~3 tokens a word)")
    p.add_argument("--flood-tokens", type=int, default=16, help="tokens generated for each long prompt")
    p.add_argument("--chats", type=int, default=8, help="tenant B's chat streams")
    p.add_argument("--turns", type=int, default=8, help="turns of each chat")
    p.add_argument("--chat-tokens", type=int, default=24, help="tokens streamed in each turn")
    p.add_argument("--chat-delay", type=float, default=1.0, help="seconds after the flood starts that B starts")
    p.add_argument("--rounds", type=int, default=3, help="times to repeat the four runs (figures pooled)")
    p.add_argument("--flood-only", action="store_true",
                   help="run only A alone, --rounds times (after B's warm-up chats: the worker has seen two "
                        "tenants), to measure what the tenant rules cost a flood (compare --up-arg settings)")
    p.add_argument("--model", default="bundled", help="what `phaseserve up` serves (default: bundled)")
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for `phaseserve up` (repeatable)")
    p.add_argument("--log", default="/tmp/phaseserve-tenants.log", help="where the started stack logs")
    p.add_argument("--json-out", help="write the figures here as JSON")
    return p.parse_args(argv)


async def stream(http: aiohttp.ClientSession, url: str, key: str, path: str, body: dict) -> dict:
    """One streamed request: its send time, token arrival times, and usage."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with http.post(url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                         headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {await r.text()}")
        async for _id, obj in sse_messages(r):
            if obj is None:
                continue
            if "error" in obj:
                raise RuntimeError(f"{path}: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices") or ():
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    return {"sent": t0, "times": times, "usage": usage}


def long_prompt(run: str, i: int, words: int) -> str:
    return f"{run} document {i}: " + " ".join(f"w{(j * 7919 + i * 31) % 997}" for j in range(words))


async def flood(http, url, model, run: str, args) -> dict:
    body = {"model": model, "max_tokens": args.flood_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream(http, url, KEY_A, "/v1/completions",
                                            {**body, "prompt": long_prompt(run, i, args.flood_words)})
                                     for i in range(args.flood)))
    end = max(r["times"][-1] for r in results)
    tokens = sum(r["usage"]["total_tokens"] for r in results)
    return {"seconds": end - t0, "tokens": tokens, "tokens_per_s": tokens / (end - t0)}


async def chat(http, url, model, run: str, i: int, args) -> list[dict]:
    history = [{"role": "system", "content": f"You are assistant {i} of run {run}. Answer briefly."}]
    turns = []
    for t in range(args.turns):
        history.append({"role": "user", "content": f"Question {t} of chat {i}: what comes next?"})
        r = await stream(http, url, KEY_B, "/v1/chat/completions",
                         {"model": model, "messages": history, "max_tokens": args.chat_tokens, "temperature": 0,
                          "ignore_eos": True})
        turns.append(r)
        history.append({"role": "assistant", "content": "..."})
    return turns


async def chats(http, url, model, run: str, args, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    runs = await asyncio.gather(*(chat(http, url, model, run, i, args) for i in range(args.chats)))
    return {"ttft": [r["times"][0] - r["sent"] for turns in runs for r in turns],
            "itl": [b - a for turns in runs for r in turns for a, b in zip(r["times"], r["times"][1:])],
            "tokens": sum(computed_tokens(r["usage"]) for turns in runs for r in turns)}


def computed_tokens(usage: dict) -> int:
    """The tokens a request cost the worker: its prompt's less the cached ones, and its completion's."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"] - cached + usage["completion_tokens"]


def percentiles(b: dict, turns: int) -> dict:
    """B's TTFT and ITL p50 / p99 (seconds) over the turns in `b`, and the TTFT p99 of the chats' first turns
    and of their later ones apart (`b["ttft"]` is chat by chat, `turns` each): a first turn has no cached
    history and comes after B was away, so it waits for the other tenant's steps in flight."""
    out = {f"{k}_p{q}": float(np.percentile(b[k], q)) for k in ("ttft", "itl") for q in (50, 99)}
    first = [t for i, t in enumerate(b["ttft"]) if i % turns == 0]
    later = [t for i, t in enumerate(b["ttft"]) if i % turns] or [float("nan")]
    return {**out, "ttft_first_p99": float(np.percentile(first, 99)), "ttft_later_p99": float(np.percentile(later, 99))}


async def one_round(http, url, model, args, keys_path: Path, r: int) -> dict:
    """B alone, A alone, then both with tenants and without (the keys file rewritten; the gateway reloads it)."""
    if args.flood_only:
        return {"a_alone": await flood(http, url, model, f"a-alone-{r}", args)}
    out = {"b_alone": await chats(http, url, model, f"b-alone-{r}", args),
           "a_alone": await flood(http, url, model, f"a-alone-{r}", args)}
    for name, separate in (("tenants", True), ("no_tenants", False)):
        keys_path.write_text(yaml.safe_dump(keys_file(separate)))
        await asyncio.sleep(2.5)  # the gateway looks at the file every second
        a, b = await asyncio.gather(flood(http, url, model, f"{name}-{r}", args),
                                    chats(http, url, model, f"{name}-{r}", args, args.chat_delay))
        out[name] = {"a": a, "b": b}
    keys_path.write_text(yaml.safe_dump(keys_file(True)))
    await asyncio.sleep(2.5)
    return out


def pooled(rounds: list[dict], turns: int) -> dict:
    """Every round's B turns pooled per run, A's throughput the mean of the rounds."""
    def b_of(r: dict, name: str) -> dict:
        return r[name] if name == "b_alone" else r[name]["b"]

    out: dict = {}
    for name in ("b_alone", "tenants", "no_tenants"):
        b = {k: [x for r in rounds for x in b_of(r, name)[k]] for k in ("ttft", "itl")}
        out[name] = {**percentiles(b, turns), "turns": len(b["ttft"])}
    out["a_alone"] = {"tokens_per_s": float(np.mean([r["a_alone"]["tokens_per_s"] for r in rounds]))}
    for name in ("tenants", "no_tenants"):
        out[name] = {"b": out[name], "a": {"tokens_per_s": float(np.mean([r[name]["a"]["tokens_per_s"]
                                                                         for r in rounds]))}}
    out["tenants"]["a"]["floor"] = float(np.mean([a_floor(r) for r in rounds]))
    return out


def a_floor(r: dict) -> float:
    """The bar for A beside B: 0.9 x (A alone - B's share), B's share being the tokens B's turns cost the
    worker (cached prompt tokens are not computed) a second over A's flood in the tenants run."""
    b_share = r["tenants"]["b"]["tokens"] / r["tenants"]["a"]["seconds"]
    return 0.9 * (r["a_alone"]["tokens_per_s"] - b_share)


async def run_all(url: str, args, keys_path: Path) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        async with http.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}) as r:
            model = (await r.json())["data"][0]["id"]
        await chats(http, url, model, "warmup", argparse.Namespace(**{**vars(args), "chats": 2, "turns": 1}))
        rounds = [await one_round(http, url, model, args, keys_path, r) for r in range(args.rounds)]
    if args.flood_only:
        return {"rounds": rounds}
    return {**pooled(rounds, args.turns), "rounds": rounds}


def round_ratios(r: dict, turns: int) -> str:
    """One round's B TTFT p99, B ITL p99 and A's throughput with tenants over alone, as text."""
    alone, b = percentiles(r["b_alone"], turns), percentiles(r["tenants"]["b"], turns)
    return (f"{b['ttft_p99'] / alone['ttft_p99']:.2f}x, {b['itl_p99'] / alone['itl_p99']:.2f}x, "
            f"{r['tenants']['a']['tokens_per_s'] / r['a_alone']['tokens_per_s']:.2f}x")


def machine() -> str:
    """The CPU the stack and this client share, and how busy the machine was (the ratios move with both)."""
    try:
        model = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":")[1].strip()
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f}"


def report(m: dict) -> str:
    if m["args"]["flood_only"]:
        rates = [r["a_alone"]["tokens_per_s"] for r in m["rounds"]]
        return (f"machine: {m['machine']}\nA alone (flood only): {np.mean(rates):.0f} tokens/s, each round "
                + ", ".join(f"{x:.0f}" for x in rates))
    alone = m["b_alone"]
    lines = [f"machine: {m['machine']}; B's turns per run: {alone['turns']} ({len(m['rounds'])} rounds)",
             "run          B TTFT p50/p99 (s)   B ITL p50/p99 (ms)   A tokens/s   B p99 vs alone (TTFT, ITL)"]
    lines.append(f"B alone      {alone['ttft_p50']:6.3f} / {alone['ttft_p99']:6.3f}     "
                 f"{alone['itl_p50'] * 1e3:6.1f} / {alone['itl_p99'] * 1e3:6.1f}")
    lines.append(f"A alone                                                 {m['a_alone']['tokens_per_s']:8.0f}")
    for name in ("tenants", "no_tenants"):
        a, b = m[name]["a"], m[name]["b"]
        lines.append(f"{name:<12} {b['ttft_p50']:6.3f} / {b['ttft_p99']:6.3f}     {b['itl_p50'] * 1e3:6.1f} / "
                     f"{b['itl_p99'] * 1e3:6.1f}      {a['tokens_per_s']:8.0f}     "
                     f"{b['ttft_p99'] / alone['ttft_p99']:5.2f}x, {b['itl_p99'] / alone['itl_p99']:5.2f}x")
    lines.append(f"A beside B: {m['tenants']['a']['tokens_per_s']:.0f} tokens/s, the bar 0.9 x (A alone - B's share) "
                 f"{m['tenants']['a']['floor']:.0f}")
    b = m["tenants"]["b"]
    lines.append(f"B TTFT p99, chats' first turns / later turns (s): alone {alone['ttft_first_p99']:.3f} / "
                 f"{alone['ttft_later_p99']:.3f}, tenants {b['ttft_first_p99']:.3f} / {b['ttft_later_p99']:.3f} "
                 f"({b['ttft_first_p99'] / alone['ttft_first_p99']:.2f}x / "
                 f"{b['ttft_later_p99'] / alone['ttft_later_p99']:.2f}x)")
    if len(m["rounds"]) > 1:
        lines.append("each round, tenants over alone (B TTFT p99, B ITL p99, A tokens/s):")
        for i, r in enumerate(m["rounds"]):
            lines.append(f"  round {i + 1}: {round_ratios(r, m['args']['turns'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys_path = Path(tmp) / "keys.yaml"
        keys_path.write_text(yaml.safe_dump(keys_file(True)))
        port = free_port()
        cmd = [sys.executable, "-m", "phaseserve.stack.cli", "up", "--model", args.model, "--port", str(port),
               "--api-keys-file", str(keys_path), *args.up_arg]
        server = ServerProcess("phaseserve", cmd, port, Path(args.log)).start()
        try:
            m = asyncio.run(run_all(server.url, args, keys_path))
        finally:
            server.stop()
    m["args"] = {k: v for k, v in vars(args).items() if k not in ("json_out", "log")}
    m["machine"] = machine()
    print(report(m))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(m, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
