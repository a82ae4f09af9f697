"""Grammar engines side by side on our models' tokenizers: llguidance against xgrammar.

For each tokenizer (the bundled model's, the default SmolLM2's) and each engine: the compile time of every
schema in bench.grammar_schemas (from the schema to a matcher ready for its first mask; a fresh compiler, so
no cache helps), and the time of one token mask, walking a matcher through the tokens of each schema's
valid instance (mask, then consume the next token: what a sampler does per step).

    python -m bench.bench_grammar [--rounds 3] [--engines llguidance,xgrammar]

`--step-cost` measures instead what the masks cost a worker: process CPU seconds of a decode step of 16
sequences on the default model, all free against all constrained by NESTED, alternating rounds (CPU
time, not wall time, so other load on the machine does not blur it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.grammar_schemas import NESTED, SCHEMAS
from phaseserve.models import model_source
from phaseserve.models.tokenizer import Tokenizer


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _instances() -> list[tuple[str, dict, str]]:
    cases = [(name, schema, json.dumps(inst, separators=(",", ":"))) for name, (schema, inst) in SCHEMAS.items()]
    nested_inst = {"name": "Rex", "kind": "dog", "owner": {"city": "Oslo", "age": 30}, "toys": ["ball"]}
    return cases + [("nested", NESTED, json.dumps(nested_inst, separators=(",", ":")))]


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        import llguidance
        import llguidance.torch as lt
        self.llg, self.lt = llguidance, lt
        with open(f"{tok.path}/tokenizer.json") as f:
            self.tokenizer = llguidance.LLTokenizer(f.read(), n_vocab=tok.vocab_size,
                                                    eos_token=sorted(tok.eos_token_ids))
        self.bitmask = lt.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, schema: dict):
        m = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False}))
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m) -> None:
        self.lt.fill_next_token_bitmask(m, self.bitmask)

    def consume(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=f"{tok.path}/tokenizer.json")
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                            stop_token_ids=sorted(tok.eos_token_ids))
        self.bitmask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return self.xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                       separators=(",", ":")))

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def consume(self, m, token: int) -> None:
        assert m.accept_token(token)


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def run(tokenizer: Tokenizer, engine_name: str, rounds: int) -> dict:
    engine = ENGINES[engine_name](tokenizer)
    compile_ms, mask_us = [], []
    for _ in range(rounds):
        for _, schema, text in _instances():
            t = time.perf_counter()
            m = engine.compile(schema)
            compile_ms.append((time.perf_counter() - t) * 1e3)
            for token in tokenizer.encode(text, add_special_tokens=False):
                t = time.perf_counter()
                engine.mask(m)
                mask_us.append((time.perf_counter() - t) * 1e6)
                engine.consume(m, token)
    return {"compile_ms_p50": statistics.median(compile_ms), "compile_ms_max": max(compile_ms),
            "mask_us_p50": statistics.median(mask_us), "mask_us_p99": _pct(mask_us, 0.99),
            "schemas": len(_instances()), "masks": len(mask_us)}


def step_cost(model: str, rounds: int, batch: int = 16, steps: int = 25) -> None:
    from phaseserve import grammar
    from phaseserve.params import SamplingParams
    from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.runner import ModelRunner

    path = str(model_source.resolve_model(model).path)
    tok = Tokenizer(path)
    runner = ModelRunner(path, num_blocks=batch * 32)
    prompt = tok.encode("Describe a pet as JSON.")

    def one(spec, seed: int) -> float:
        params = SamplingParams(max_tokens=steps + 5, temperature=1.0, seed=seed, ignore_eos=True)
        ids = [f"s{i}" for i in range(batch)]
        tables = {s: list(range(i * 32, (i + 1) * 32)) for i, s in enumerate(ids)}
        runner.execute(StepPlan(0, "b", [SeqStart(s, "g", prompt, params, grammar=spec) for s in ids],
                                [ScheduledChunk(s, 0, len(prompt), tables[s]) for s in ids]))
        cpu = []
        for step in range(steps):
            t = time.process_time()
            result = runner.execute(StepPlan(step + 1, "b", [], [ScheduledChunk(s, len(prompt) + step, 1, tables[s])
                                                                  for s in ids]))
            cpu.append(time.process_time() - t)
            if any(e.finish_reason for e in result.events):
                break  # a document done: the batch would shrink
        runner.reset()
        return statistics.median(cpu)

    costs: dict[str, list[float]] = {"free": [], "constrained": []}
    for r in range(rounds):
        costs["free"].append(one(None, r))
        costs["constrained"].append(one(grammar.json_schema(NESTED), r))
    free, constrained = statistics.median(costs["free"]), statistics.median(costs["constrained"])
    print(f"| {model} | {batch} | {free * 1e3:.2f} ms | {constrained * 1e3:.2f} ms | {constrained / free:.3f}x |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--models", default="bundled,smollm2")
    p.add_argument("--step-cost", action="store_true", help="CPU a decode step, free against constrained")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.step_cost:
        print("| model | batch | CPU a step, free | constrained (NESTED) | ratio |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for model in args.models.split(","):
            step_cost(model, args.rounds)
        return
    print("| tokenizer | vocab | engine | compile p50 (ms) | compile max (ms) | mask p50 (us) | mask p99 (us) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        tok = Tokenizer(str(model_source.resolve_model(model).path))
        for engine in args.engines.split(","):
            r = run(tok, engine, args.rounds)
            print(f"| {model} | {tok.vocab_size} | {engine} | {r['compile_ms_p50']:.2f} | {r['compile_ms_max']:.2f} "
                  f"| {r['mask_us_p50']:.0f} | {r['mask_us_p99']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
