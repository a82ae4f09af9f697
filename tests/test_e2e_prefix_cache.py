"""Prefix caching seen from a client: the official openai client against whole stacks (cache on, the default,
and --no-enable-prefix-caching), over real sockets. Each response's usage says how many prompt tokens were
cached (OpenAI's usage.prompt_tokens_details.cached_tokens, in the streamed final usage chunk too),
/metrics counts the queries and hits, and the text is the same either way."""

from __future__ import annotations

import re
import time

import openai
import pytest
import requests

from e2e_stack import running_stack

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you are not sure. "
          "Prefer plain words to jargon, and give one example when it helps. ") * 3


def chat(client: openai.OpenAI, model: str, history: list[dict], **kw):
    return client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0.0, **kw)


def metric(base_url: str, name: str) -> float:
    text = requests.get(base_url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def conversation(client: openai.OpenAI, model: str, stream_last: bool = False) -> tuple[list[str], list]:
    """Three turns resending the history, then the same question with n = 3."""
    history = [{"role": "system", "content": SYSTEM}]
    answers, usages = [], []
    for question in ("What is a prefix?", "And a suffix?", "Give an example of both."):
        history.append({"role": "user", "content": question})
        r = chat(client, model, history)
        answers.append(r.choices[0].message.content)
        usages.append(r.usage)
        history.append({"role": "assistant", "content": answers[-1]})
    r = chat(client, model, history[:2], n=3)
    answers += [c.message.content for c in r.choices]
    usages.append(r.usage)
    if stream_last:
        chunks = list(chat(client, model, history[:4], stream=True, stream_options={"include_usage": True}))
        answers.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        usages.append(chunks[-1].usage)
    return answers, usages


@pytest.fixture(scope="module")
def stacks(e2e_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("prefix-cache-logs")
    # float32: a cached prefix then gives the same bits as computing it (bf16 decodes and prefills round apart)
    with running_stack(e2e_model, logs, dtype="float32") as on, \
            running_stack(e2e_model, logs, dtype="float32", enable_prefix_caching=False) as off:
        yield on, off


def test_cached_tokens_are_reported_and_the_text_does_not_change(stacks):
    on, off = stacks
    with openai.OpenAI(base_url=on.api_url, api_key="x", max_retries=0, timeout=120) as c_on, \
            openai.OpenAI(base_url=off.api_url, api_key="x", max_retries=0, timeout=120) as c_off:
        answers_off, usages_off = conversation(c_off, off.model, stream_last=True)
        answers_on, usages_on = conversation(c_on, on.model, stream_last=True)
    assert answers_on == answers_off
    assert all(u.prompt_tokens_details.cached_tokens == 0 for u in usages_off)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages_on]
    prompts = [u.prompt_tokens for u in usages_on]
    assert cached[0] == 0  # nothing was cached before the first turn
    # later turns find the previous turn's prompt (at least the system prompt's full blocks) cached
    assert all(c >= 64 and c < p for c, p in zip(cached[1:3], prompts[1:3])), (cached, prompts)
    assert cached[3] >= 64  # n = 3 after turn 1's prompt: the whole system prompt + question
    assert cached[4] >= 64  # the streamed final usage chunk carries it too
    # the scheduler's stats reach /metrics a moment after the last answer
    deadline = time.monotonic() + 10
    while metric(on.base_url, "phaseserve_prefix_cache_hits") < sum(cached) and time.monotonic() < deadline:
        time.sleep(0.1)
    queries, hits = metric(on.base_url, "phaseserve_prefix_cache_queries"), metric(on.base_url,
                                                                                 "phaseserve_prefix_cache_hits")
    assert hits >= sum(cached) and queries >= sum(prompts) and hits < queries
    assert metric(on.base_url, "phaseserve_kv_blocks_cached") > 0
    assert metric(off.base_url, "phaseserve_prefix_cache_hits") == 0
