"""`phaseserve bench` / `python -m phaseserve.stack.benchmark`: benchmark an OpenAI-compatible server or the in-process engine.

  phaseserve bench --base-url http://127.0.0.1:8000 --model bundled --workload random \\
      --num-prompts 64 --input-len 128 --output-len 64 --concurrency 16 --json-out a.json --plot a.png
  phaseserve bench plot OUT.png a.json b.json ...     (one chart from several saved results)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import structlog

from phaseserve import event_loop
from phaseserve.stack.benchmark import workloads
from phaseserve.stack.benchmark.metrics import DEFAULT_PERCENTILES, calculate_metrics, format_report, parse_goodput
from phaseserve.stack.benchmark.models import NAMES as MODEL_NAMES
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.procs import parse_cpus

log = structlog.get_logger("bench")

WORKLOADS = ("random", "interference", "shared-prefix", "copy")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phaseserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("openai", "engine"), default="openai",
                   help="openai: any OpenAI-compatible HTTP server; engine: phaseserve.stack.engine in this process")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (openai backend)")
    p.add_argument("--model", default="bundled",
                   help=f"model folder or one of {', '.join(MODEL_NAMES)} (tokenizer + vocab; the engine "
                        "loads it; default bundled)")
    p.add_argument("--served-model-name", help="the `model` field to send (default: the server's first /v1/models id)")
    p.add_argument("--tokenizer", help="HF folder with tokenizer.json (default: the --model folder)")
    p.add_argument("--vocab-size", type=int, help="random ids below this, when there is no local tokenizer")
    p.add_argument("--cache-dir", help="where small-200m is built (default ~/.cache/phaseserve/bench)")
    p.add_argument("--label", help="name of this run in tables and plots (default: the backend)")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared-prefix: the unique suffix)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the common prefix")
    p.add_argument("--chat-words", type=int, default=24, help="interference: words per short chat prompt")
    p.add_argument("--long-len", type=int, default=2048, help="interference: tokens of the long prompt")
    p.add_argument("--long-output-len", type=int, default=8, help="interference: tokens the long prompt asks for")
    p.add_argument("--long-every", type=float, default=5.0, help="interference: seconds between long prompts (0: none, the baseline)")
    p.add_argument("--long-max-inflight", type=int, default=4,
                   help="interference: skip a tick while this many long prompts are unanswered")
    p.add_argument("--concurrency", type=int, help="most requests in flight (default: unbounded)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let EOS end a request early (default: ignore_eos=true, exact output lengths)")
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="send prompts as token-id lists, as text, or try ids then text (default)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys: ttft tpot e2el)")
    p.add_argument("--percentiles", default=",".join(f"{x:g}" for x in DEFAULT_PERCENTILES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--api-key", help="bearer token, if the server wants one")
    p.add_argument("--engine-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="engine backend: a keyword argument for Engine(...) (repeatable; ints/floats parsed)")
    p.add_argument("--json-out", help="write the result as JSON here")
    p.add_argument("--plot", help="write a PNG of this result (and of --compare results) here")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON", help="earlier results to plot beside this one")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--client-cpus", type=_cpu_list, default=None, metavar="LIST",
                   help="run the load generator on these CPUs only, e.g. 1, 2,3 or 2-3 (a client on the server's "
                        "machine otherwise takes CPU from whatever core it lands on, the worker's included)")
    return p


def _cpu_list(text: str) -> list[int]:
    try:
        cpus = parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not cpus:
        raise argparse.ArgumentTypeError("give at least one CPU")
    return cpus


def _engine_settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-setting wants KEY=VALUE, got {pair!r}")
        for conv in (int, float):
            try:
                out[key] = conv(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


def _vocab(args, model_dir: Path | None) -> workloads.Vocab | None:
    tok_dir = Path(args.tokenizer) if args.tokenizer else model_dir
    if tok_dir is not None and (tok_dir / "tokenizer.json").is_file():
        vocab = workloads.Vocab.from_model_dir(tok_dir)
        if args.vocab_size:
            vocab = workloads.Vocab(min(args.vocab_size, vocab.size), None, vocab.tokenizer)
        return vocab
    if args.vocab_size:
        return workloads.Vocab(args.vocab_size)
    return None


def build_specs(args, vocab):
    """(main specs, long spec or None) for the chosen workload."""
    needs_vocab = args.workload in ("random", "shared-prefix", "interference", "copy")
    if needs_vocab and vocab is None:
        raise ValueError(f"workload {args.workload!r} needs token ids: pass --tokenizer DIR or --vocab-size N")
    if args.workload == "random":
        return workloads.random_workload(vocab, args.num_prompts, args.input_len, args.output_len, args.seed), None
    if args.workload == "copy":
        return workloads.copy_workload(vocab, args.num_prompts, args.input_len, args.output_len, args.seed), None
    if args.workload == "shared-prefix":
        return workloads.shared_prefix_workload(vocab, args.num_prompts, args.prefix_len, args.input_len,
                                                args.output_len, args.seed), None
    short = workloads.chat_workload(args.num_prompts, args.chat_words, args.output_len, args.seed)
    if args.long_every <= 0:  # the baseline: the same short streams with no long prompt
        return short, None

    def make_long(i: int) -> workloads.RequestSpec:  # i = -1: the test request's own prompt
        return workloads.long_prompt(vocab, args.long_len, args.long_output_len, args.seed + 1000 + i)

    return short, make_long


async def _served_model_name(session, base_v1: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(f"{base_v1}/models", headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base_v1}/models answered {resp.status}; pass --served-model-name")
        data = (await resp.json())["data"]
    if not data:
        raise RuntimeError(f"{base_v1}/models lists no model")
    return data[0]["id"]


async def run_openai(args, specs, make_long, vocab) -> tuple[list, float, dict]:
    import aiohttp
    from tqdm import tqdm

    from phaseserve.stack.benchmark.loadgen import ClientConfig, OpenAIStreamClient, interference_injector, run_load

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # one session for every request; no per-host cap (the benchmark's own semaphore limits concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        cfg = ClientConfig(args.base_url, "", args.temperature, args.ignore_eos, args.api_key, args.timeout)
        cfg.model = args.served_model_name or await _served_model_name(session, cfg.v1, args.api_key)
        client = OpenAIStreamClient(cfg, session)
        client.vocab = vocab
        probe_spec = workloads.RequestSpec(specs[0].api, specs[0].prompt, specs[0].prompt_len, 4)
        await client.probe(probe_spec, args.prompt_format)
        if make_long is not None:
            test_long = make_long(-1)
            await client.probe(workloads.RequestSpec("completions", test_long.prompt, test_long.prompt_len, 1),
                               args.prompt_format)
        log.info("test request ok", model=cfg.model, token_id_prompts=client.token_id_prompts)
        pbar = None if args.no_progress else tqdm(total=len(specs), desc=args.label or "bench", file=sys.stderr)
        background = (interference_injector(client.send, make_long, args.long_every, args.long_max_inflight)
                      if make_long else None)
        try:
            results, duration = await run_load(client.send, specs, args.concurrency, args.request_rate,
                                               args.burstiness, args.seed, pbar, background)
        finally:
            if pbar is not None:
                pbar.close()
        info = {"served_model": cfg.model, "token_id_prompts": client.token_id_prompts}
        if background is not None:
            info["long_prompts_skipped"] = background.skipped
        return results, duration, info


@contextlib.contextmanager
def client_on(cpus: list[int] | None):
    """Run the block on `cpus` (this thread only), then restore: servers started later must not inherit it."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_benchmark(args, cpu_probe=None) -> dict:
    """Run one benchmark as configured by build_parser()'s args; return the JSON-able result.
    `cpu_probe` (bench/proc_cpu.ProcessTreeCPU of the server) is entered around the measured run only; its
    report goes into the result as "cpu"."""
    percentiles = [float(x) for x in str(args.percentiles).split(",") if x.strip()]
    if not percentiles or any(not 0 < p < 100 for p in percentiles):
        raise ValueError("--percentiles wants numbers in (0, 100), e.g. 50,90,99")
    goodput = parse_goodput(args.goodput)
    local = args.model in MODEL_NAMES or Path(args.model).expanduser().exists()
    model_dir = resolve_model(args.model, args.cache_dir) if local else None
    vocab = _vocab(args, model_dir)
    specs, make_long = build_specs(args, vocab)
    if make_long is not None and model_dir is not None:
        limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        if limit and args.long_len + args.long_output_len > limit:
            raise ValueError(f"--long-len {args.long_len} + --long-output-len {args.long_output_len} exceeds the "
                             f"model's {limit} positions; pass a smaller --long-len (e.g. {limit - 64})")

    if args.backend == "engine":
        if model_dir is None:
            raise ValueError("--backend engine needs --model to be a model folder (or bundled / small-200m)")
        if make_long is not None:
            raise ValueError("the engine backend has no streams to interfere with; use random or shared-prefix")
        from phaseserve.stack.benchmark.engine_backend import run_engine, throughput_only

        results, duration = run_engine(str(model_dir), specs, vocab, args.temperature, args.ignore_eos,
                                       _engine_settings(args.engine_setting), args.concurrency)
        info = {"note": "in-process engine: one generate() call, throughput only"}
        metrics = throughput_only(calculate_metrics(results, duration, None, percentiles))
        groups = {}
    else:
        # uvloop: a lighter client takes less CPU from the server it measures (the same client for every server)
        with client_on(args.client_cpus), cpu_probe or contextlib.nullcontext():
            results, duration, info = event_loop.run(run_openai(args, specs, make_long, vocab))
        metrics = calculate_metrics([r for r in results if r.group in ("main", "short")], duration,
                                    goodput, percentiles)
        groups = {}
        if make_long is not None:
            groups = {g: calculate_metrics([r for r in results if r.group == g], duration, goodput, percentiles)
                      for g in ("short", "long")}
            groups["all"] = calculate_metrics(results, duration, goodput, percentiles)

    failed = [r for r in results if not r.success]
    for r in failed[:5]:
        log.warning("request failed", error=r.error[:300])
    workload = {k: getattr(args, k) for k in (
        "workload", "num_prompts", "input_len", "output_len", "concurrency", "request_rate", "burstiness",
        "seed", "temperature", "ignore_eos")}
    if args.workload == "shared-prefix":
        workload["prefix_len"] = args.prefix_len
    if args.workload == "interference":
        workload.update(chat_words=args.chat_words, long_len=args.long_len,
                        long_output_len=args.long_output_len, long_every=args.long_every,
                        long_max_inflight=args.long_max_inflight)
    return {
        "label": args.label or args.backend,
        "backend": args.backend,
        "base_url": args.base_url if args.backend == "openai" else None,
        "model": str(model_dir or args.model),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {**workload, "request_rate": str(args.request_rate)},
        "percentiles": percentiles,
        "goodput_slos_ms": goodput or None,
        **info,
        "metrics": metrics,
        **({"cpu": cpu_probe.report(metrics["total_output_tokens"])} if cpu_probe is not None else {}),
        "groups": groups,
        "requests": [r.to_json() for r in results],
    }


def print_result(result: dict) -> None:
    pct = result["percentiles"]
    if result["backend"] == "engine":
        m = result["metrics"]
        print(f"{' ' + result['label'] + ' (in-process engine, throughput only) ':=^60}")
        for k in ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput"):
            print(f"{k + ':':<42}{m[k]:>12.2f}")
        return
    title = result["label"] + (" - short streams" if result["groups"] else "")
    print(format_report(title, result["metrics"], pct))
    if "long" in result["groups"]:
        if result["groups"]["long"]["completed"] + result["groups"]["long"]["failed"] == 0:
            print("no long prompt was sent: the short streams finished within --long-every")
        else:
            print(format_report(result["label"] + " - long prompts", result["groups"]["long"], pct))
    if result.get("cpu"):
        from phaseserve.stack.benchmark.proc_cpu import format_cpu

        print(format_cpu(result["cpu"]))


def write_outputs(result_or_results, json_out: str | None, plot_out: str | None, compare=()) -> None:
    from phaseserve.stack.benchmark.plot import load_results, plot_results

    runs = result_or_results if isinstance(result_or_results, list) else [result_or_results]
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        payload = runs[0] if len(runs) == 1 else {"runs": runs}
        Path(json_out).write_text(json.dumps(payload, indent=1))
        print(f"wrote {json_out}")
    if plot_out:
        plot_results(load_results(compare) + runs, plot_out, title=runs[0]["workload"]["workload"])
        print(f"wrote {plot_out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plot":
        if len(argv) < 3:
            print("usage: phaseserve bench plot OUT.png RESULT.json [RESULT.json ...]", file=sys.stderr)
            return 2
        from phaseserve.stack.benchmark.plot import load_results, plot_results

        plot_results(load_results(argv[2:]), argv[1])
        print(f"wrote {argv[1]}")
        return 0
    args = build_parser().parse_args(argv)
    try:
        result = run_benchmark(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"phaseserve bench: {e}", file=sys.stderr)
        return 2
    print_result(result)
    write_outputs(result, args.json_out, args.plot, args.compare)
    return 0 if result["metrics"]["completed"] else 1
