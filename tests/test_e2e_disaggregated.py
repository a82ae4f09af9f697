"""`phaseserve up --prefill-workers 1 --decode-workers 1` over real sockets, with the official client:
greedy streams equal the in-process engine token for token, every sequence is handed from the prefill
worker to the decode worker, and /metrics counts the sequences, KV blocks and bytes moved."""

from __future__ import annotations

import asyncio

import openai

from e2e_reference import engine_texts, metric, prompts
from e2e_stack import running_stack, wait_for

MAX_TOKENS = 12


async def _stream_text(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def test_a_disaggregated_stack_equals_the_engine_and_counts_its_handoffs(e2e_model, tmp_path):
    # long prompts too: their KV spans many blocks and several prefill chunks
    ps = prompts(12) + [" ".join(["Paged attention keeps every block"] * 30)]
    with running_stack(e2e_model, tmp_path, prefill_workers=1, decode_workers=1) as stack:
        # both adopted by the scheduler (a heartbeat alone is not enough: until the decode worker is
        # adopted, the prefill worker decodes what it starts, as a mixed one)
        assert wait_for(lambda: stack.scheduler_stats().get("num_workers") == 2, 120)
        async with openai.AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client:
            texts = await asyncio.gather(*(_stream_text(client, stack.model, p) for p in ps))
        # handed over when the first token came; received once the decode worker's result is read
        handed = wait_for(lambda: metric(stack.base_url, "kv_handoff_received") >= len(ps), 10)
        assert metric(stack.base_url, "kv_handoff_sequences") == len(ps)
        blocks, moved = metric(stack.base_url, "kv_handoff_blocks"), metric(stack.base_url, "kv_handoff_bytes")
        failed, kept = metric(stack.base_url, "kv_handoff_failed"), metric(stack.base_url, "kv_handoff_kept")
        logs = stack.logs()
        notable = [line for line in logs.splitlines() if "warn" in line or "error" in line or "joined" in line]
        assert handed, (stack.scheduler_stats(), notable[-20:])
    assert texts == engine_texts(e2e_model, ps, MAX_TOKENS), notable[-20:]
    assert failed == 0 and kept == 0
    assert blocks >= len(ps) and moved > 0 and moved % blocks == 0  # whole blocks of one fixed size
    assert "handed to a decode worker" in logs and "transport=shm" in logs
