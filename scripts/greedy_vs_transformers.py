"""Greedy tokens over HTTP against `transformers` on the same weights: the correctness check for a real model.

    python scripts/greedy_vs_transformers.py                       # SmolLM2-135M-Instruct (the default), float32
    python scripts/greedy_vs_transformers.py --model path/to/x.gguf --dtype float32

Starts the whole stack (`phaseserve up`'s own code, embedded Redis), sends each prompt through the chat
template as a `/v1/completions` request of token ids at temperature 0 with the official `openai` client,
and runs `transformers`' greedy `generate` on the same ids (a GGUF dequantized by transformers' own
reader). Prints one line per prompt and exits non-zero unless every continuation is identical.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
]


def transformers_greedy(model, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    import torch

    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    ids = out[0, len(prompt_ids):].tolist()
    return ids[:next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]


def load_transformers(folder: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    gguf = folder / "weights.gguf"
    if gguf.exists():  # a GGUF served through its prepared folder: transformers reads the GGUF itself
        real = gguf.resolve()
        return AutoModelForCausalLM.from_pretrained(real.parent, gguf_file=real.name, dtype=dt).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dt).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what `phaseserve up --model` takes (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", help="phaseserve's --quantization (none: same math "
                        "as transformers' dequantized weights)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    import openai

    from phaseserve import settings
    from phaseserve.stack.launcher import Stack, health_url
    from phaseserve.redis_server import free_port
    from phaseserve.models.tokenizer import Tokenizer

    model = settings.resolve_model(args.model, "greedy_vs_transformers")
    tok = Tokenizer.from_folder(model.path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    print(f"model {model.name} ({model.path}), dtype {args.dtype}, {len(prompts)} prompts x {args.max_tokens} tokens",
          flush=True)

    print("transformers: loading and generating ...", flush=True)
    hf = load_transformers(Path(model.path), args.dtype)
    expected = [transformers_greedy(hf, ids, args.max_tokens, set(tok.eos_token_ids)) for ids in prompts]
    del hf

    values = vars(settings.parse("up", []))
    extra = {"quantization": args.quantization} if "quantization" in values else {}
    values.update(model=model.path, served_model_name=model.name, port=free_port(), dtype=args.dtype,
                  kv_cache_memory=256 << 20, redis_url=None, log_level="warning", **extra)
    log = tempfile.NamedTemporaryFile(prefix="greedy-vs-transformers-", suffix=".log", delete=False)
    stack = Stack(values, output=log)
    url = health_url(values["host"], values["port"])
    failures = 0
    try:
        print("phaseserve: starting the stack ...", flush=True)
        stack.start()
        stack.wait_healthy(url, 600, threading.Event())
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        for text, ids, want in zip(PROMPTS, prompts, expected):
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=args.max_tokens, temperature=0,
                                          logprobs=0)
            got_text = r.choices[0].text
            want_text = tok.decode(want)
            same = got_text == want_text
            failures += not same
            print(f"{'same' if same else 'DIFFERENT'}  {text!r}\n   phaseserve:   {got_text!r}\n"
                  f"   transformers: {want_text!r}", flush=True)
    finally:
        stack.stop()
        log.close()
    print(f"{len(prompts) - failures}/{len(prompts)} identical (stack log: {log.name})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
