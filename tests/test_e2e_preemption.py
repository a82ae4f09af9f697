"""Preemption end to end: a stack whose KV cache holds far fewer blocks than its concurrent
requests need must preempt (recompute) instead of failing, and still produce exactly what the
in-process engine produces; a prompt the whole cache cannot hold is refused with a 400."""

from __future__ import annotations

import asyncio

import openai
import pytest

from e2e_reference import engine_texts, metric, prompts
from e2e_stack import running_stack, wait_for
from phaseserve.kv_admission import KVCapacity
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.workers.kv_cache import bytes_per_block
from phaseserve.workers.loader import read_config, resolve_dtype

NUM_BLOCKS = 16
BLOCK_SIZE = 16
MAX_TOKENS = 60  # prompt + 60 tokens ~ 5 blocks per sequence; 6 of them need ~30 > 16
NUM_REQUESTS = 6
# float32: a recompute re-prefills prompt + outputs, and in bf16 the prefill and decode attention kernels
# round differently, so greedy text may fork after a preemption (docs/architecture.md, "Faults"; bench.faults
# measures it); in float32 it is exact, which is what this test holds the scheduler to
DTYPE = "float32"


@pytest.fixture(scope="module")
def small_kv_stack(e2e_model, tmp_path_factory):
    cfg = read_config(e2e_model)
    per_block = bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE,
                                resolve_dtype(DTYPE, cfg, "cpu"))
    with running_stack(e2e_model, tmp_path_factory.mktemp("small-kv-logs"), block_size=BLOCK_SIZE,
                       kv_cache_memory=NUM_BLOCKS * per_block, dtype=DTYPE) as running:
        yield running


async def test_preemption_keeps_outputs_exact(small_kv_stack):
    s = small_kv_stack
    # /health says a worker is alive; the scheduler adopts it on its next look (heartbeat interval)
    assert wait_for(lambda: metric(s.base_url, "kv_blocks_total") == NUM_BLOCKS, 10)
    ps = prompts(NUM_REQUESTS)

    async def one(client, prompt):
        r = await client.completions.create(model=s.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
        return r.choices[0].text

    async with openai.AsyncOpenAI(base_url=s.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        texts = await asyncio.gather(*(one(client, p) for p in ps))
    assert metric(s.base_url, "num_preemptions") > 0, "the KV budget was meant to force preemptions"
    assert texts == engine_texts(s.model_dir, ps, MAX_TOKENS, dtype=DTYPE)
    # the client has its last token before the scheduler has read that step's result and freed the blocks
    assert wait_for(lambda: metric(s.base_url, "kv_blocks_used") == 0, 10)


async def test_a_prompt_beyond_the_kv_cache_is_400_and_one_at_its_limit_runs(small_kv_stack):
    """Within the context but more than the KV cache holds is bad input: a 400 in OpenAI's shape before it is
    queued. A prompt of exactly the largest admissible length runs: the gateway's limit is the scheduler's."""
    s = small_kv_stack
    assert wait_for(lambda: metric(s.base_url, "kv_blocks_total") == NUM_BLOCKS, 10)
    tokenizer = Tokenizer.from_folder(str(s.model_dir))
    context = read_config(s.model_dir).max_position_embeddings
    cap = KVCapacity(NUM_BLOCKS, BLOCK_SIZE, context)  # the scheduler runs the default watermark
    long_prompt = "hello world"
    while len(tokenizer.encode(long_prompt)) <= NUM_BLOCKS * BLOCK_SIZE:  # more than the cache, less than the context
        long_prompt += " hello world"
    prompt_len = len(tokenizer.encode(long_prompt))
    assert prompt_len + 4 < context
    async with openai.AsyncOpenAI(base_url=s.api_url, api_key="unused", max_retries=0, timeout=60) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model=s.model, prompt=long_prompt, max_tokens=4, stream=stream)
            e = err.value
            assert e.status_code == 400 and e.type == "invalid_request_error"
            assert e.code == "context_length_exceeded" and e.param == "prompt"
            assert e.body["message"] == (
                f"This model's KV cache (the largest of its live workers') holds a prompt of at most "
                f"{cap.max_prompt_len(1)} tokens. However, your prompt has {prompt_len} tokens. Please reduce the "
                f"length of the prompt.")

        ids = tokenizer.encode(long_prompt * 2)
        limit = cap.max_prompt_len(4)
        assert len(ids) > limit + 1
        at_limit = await client.completions.create(model=s.model, prompt=ids[:limit], max_tokens=4,
                                                   extra_body={"ignore_eos": True})
        assert at_limit.usage.prompt_tokens == limit and at_limit.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError) as err:  # one more token: its completion no longer fits
            await client.completions.create(model=s.model, prompt=ids[:limit + 1], max_tokens=4)
        assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"

        ok = await client.completions.create(model=s.model, prompt="short", max_tokens=3,
                                             extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 3
    assert s.alive()
