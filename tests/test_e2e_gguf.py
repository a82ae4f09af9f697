"""A GGUF served over HTTP: `--model x.gguf` through the whole stack, greedy tokens equal to transformers
reading the same file (dequantized). The GGUF is written here from a random GQA llama with quantized
weights of each block type the loader keeps, as llama.cpp's converter writes them (tests/gguf_factory.py)."""

from __future__ import annotations

import itertools

import openai
import torch
from transformers import AutoModelForCausalLM

from e2e_stack import running_stack
from gguf_factory import write_gguf
from model_factory import make_model
from phaseserve.models.model_source import resolve_model
from phaseserve.models.tokenizer import Tokenizer

PROMPTS = [[5, 17, 101, 44], [9] * 3 + list(range(20, 60)), [300, 2, 77], [42] * 7]
MAX_TOKENS = 12


def test_a_gguf_file_served_over_http_generates_like_transformers(tmp_path):
    model_dir = make_model(tmp_path, "llama", num_key_value_heads=2)
    types = itertools.cycle(("Q8_0", "Q4_0", "Q4_1", "F32"))
    path = write_gguf(tmp_path / "tiny-llama.Q4_1.gguf", model_dir, types=lambda name: next(types))

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]

    with running_stack(path, tmp_path, dtype="float32", kv_cache_memory=16 << 20) as stack:
        assert stack.model == "tiny-llama.Q4_1"  # the file's own name, never a cache folder's
        client = openai.OpenAI(base_url=stack.api_url, api_key="unused")
        assert [m.id for m in client.models.list()] == [stack.model]
        got = []
        for prompt in PROMPTS:
            r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
            got.append(r.choices[0].logprobs.tokens)  # one text piece per generated token
    tokenizer = Tokenizer.from_folder(resolve_model(str(path)).path)
    assert got == [[tokenizer.token_text(t) for t in ids] for ids in expected]
