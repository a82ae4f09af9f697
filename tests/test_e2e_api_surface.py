"""End to end with the official openai client against the whole stack on a real model: logit_bias,
several prompts in one completions request, best_of, continuous usage stats, /v1/models/{id},
/tokenize, /detokenize, /version, and the malformed forms of each answered 400/404 in OpenAI's format
while another stream goes on untouched."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_logit_bias_forces_and_bans_a_token_greedy_and_sampled(client, stack, tokenizer):
    prompt = "def main():"
    base = client.completions.create(model=stack.model, prompt=prompt, max_tokens=6, **GREEDY).choices[0].text
    forced = tokenizer.encode("Z", add_special_tokens=False)[0]
    assert tokenizer.decode([forced]) not in base
    for temperature, seed in ((0, None), (1.0, 3), (1.0, None)):
        r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=6, temperature=temperature,
                                      seed=seed, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        assert r.choices[0].text == tokenizer.decode([forced] * 6), (temperature, seed)
    chat = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logit_bias={str(forced): 100}, **GREEDY)
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 4)

    # -100 bans: the greedy first token, and in 8 sampled choices it never shows up
    first = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1, **GREEDY).choices[0].text
    (top,) = tokenizer.encode(first, add_special_tokens=False)
    banned = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1, logit_bias={str(top): -100},
                                       **GREEDY).choices[0].text
    assert banned != first
    sampled = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1, n=8, temperature=1.0,
                                        seed=11, logit_bias={str(top): -100}, extra_body={"ignore_eos": True})
    unbanned = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1, n=8, temperature=1.0,
                                         seed=11, extra_body={"ignore_eos": True})
    assert first in [c.text for c in unbanned.choices]  # the model's favourite, drawn without the ban
    assert first not in [c.text for c in sampled.choices]


def test_several_prompts_in_one_request_match_each_alone(client, stack, tokenizer):
    prompts = ["def add(a, b):", "import os"]
    alone = [client.completions.create(model=stack.model, prompt=p, max_tokens=5, **GREEDY).choices[0].text
             for p in prompts]
    r = client.completions.create(model=stack.model, prompt=prompts, n=2, max_tokens=5, **GREEDY)
    assert [(c.index, c.text) for c in r.choices] == [(i, alone[i // 2]) for i in range(4)]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5

    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=stack.model, prompt=ids, max_tokens=5, **GREEDY)
    assert [c.text for c in by_ids.choices] == alone
    one = client.completions.create(model=stack.model, prompt=ids[1], max_tokens=5, **GREEDY)
    assert one.choices[0].text == alone[1]

    chunks = list(client.completions.create(
        model=stack.model, prompt=prompts, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    texts = ["", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
        assert c.usage is not None and c.usage.prompt_tokens == len(ids[c.choices[0].index])
    assert texts == alone
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 10


def test_continuous_usage_stats_on_every_chat_chunk(client, stack):
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    *per_choice, last = chunks
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in per_choice if c.choices[0].delta.role] == [0, 0]  # opening chunks
    final = {c.choices[0].index: c.usage for c in per_choice if c.choices[0].finish_reason}
    assert {i: u.completion_tokens for i, u in final.items()} == {0: 6, 1: 6}
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == final[0].prompt_tokens  # one prompt, counted once
    plain = list(client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_best_of_returns_n_of_best_of_generated(client, stack):
    r = client.completions.create(model=stack.model, prompt="class Foo:", max_tokens=4, n=2, best_of=4,
                                  temperature=1.0, seed=5, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]  # best first
    assert r.usage.completion_tokens == 4 * 4  # all four generated


def test_models_by_id_tokenize_detokenize_version(client, stack, tokenizer):
    assert client.models.retrieve(stack.model).id == stack.model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    text = "def f(x):\n    return x"
    tok = client.post("/../tokenize", body={"model": stack.model, "prompt": text}, cast_to=object)
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"]) and tok["max_model_len"]
    back = client.post("/../detokenize", body={"model": stack.model, "tokens": tok["tokens"]}, cast_to=object)
    assert back["prompt"].endswith(text)
    assert isinstance(client.get("/../version", cast_to=object)["version"], str)


def _bad_requests(model: str) -> list[tuple[str, str, dict, int, str]]:
    """(name, path, body, expected status, expected param)"""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    return [
        ("logit_bias above 100", "/v1/completions", {**comp, "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
        ("logit_bias below -100", "/v1/chat/completions", {**chat, "logit_bias": {"5": -101}}, 400, "logit_bias"),
        ("logit_bias key not a token id", "/v1/completions", {**comp, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("logit_bias id outside the vocabulary", "/v1/chat/completions",
         {**chat, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("logit_bias not an object", "/v1/completions", {**comp, "logit_bias": [1, 2]}, 400, "logit_bias"),
        ("suffix", "/v1/completions", {**comp, "suffix": "end"}, 400, "suffix"),
        ("best_of below n", "/v1/completions", {**comp, "n": 3, "best_of": 2}, 400, "best_of"),
        ("best_of streamed", "/v1/completions", {**comp, "best_of": 3, "stream": True}, 400, "best_of"),
        ("best_of not an integer", "/v1/completions", {**comp, "best_of": "3"}, 400, "best_of"),
        ("token ids outside the vocabulary in a prompt list", "/v1/completions",
         {**comp, "prompt": [[1, 2], [99999999]]}, 400, "prompt"),
        ("mixed prompt list", "/v1/completions", {**comp, "prompt": ["a", [1]]}, 400, "prompt"),
        ("empty prompt list", "/v1/completions", {**comp, "prompt": []}, 400, "prompt"),
        ("bad reasoning_effort", "/v1/chat/completions", {**chat, "reasoning_effort": "extreme"}, 400,
         "reasoning_effort"),
        ("tokenize with neither prompt nor messages", "/tokenize", {"model": model}, 400, "prompt"),
        ("tokenize with a number", "/tokenize", {"prompt": 12}, 400, "prompt"),
        ("tokenize with both", "/tokenize", {"prompt": "a", "messages": chat["messages"]}, 400, "prompt"),
        ("detokenize ids outside the vocabulary", "/detokenize", {"tokens": [1, 99999999]}, 400, "tokens"),
        ("detokenize a string", "/detokenize", {"tokens": "hello"}, 400, "tokens"),
        ("tokenize for another model", "/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ]


async def test_malformed_forms_are_openai_errors_while_a_stream_goes_on_untouched(stack, client):
    kwargs = dict(model=stack.model, prompt="def main():", max_tokens=48, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    alone = "".join(c.choices[0].text for c in client.completions.create(**kwargs))
    async with openai.AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0) as aclient:
        stream = await aclient.completions.create(**kwargs)
        texts = []

        async def read_stream():
            async for c in stream:
                texts.append(c.choices[0].text)

        reader = asyncio.create_task(read_stream())
        async with aiohttp.ClientSession(base_url=stack.base_url) as http:
            for name, path, body, status, param in _bad_requests(stack.model):
                async with http.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
                    got = await r.json()
                    assert r.status == status, f"{name}: {r.status} {got}"
                assert set(got["error"]) == {"message", "type", "param", "code"}, name
                assert got["error"]["param"] == param and got["error"]["message"], f"{name}: {got}"
                assert "Traceback" not in got["error"]["message"], name
            async with http.get("/v1/models/no-such-model") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        await reader
    assert "".join(texts) == alone  # the stream saw none of it
    for bad, param in (({"logit_bias": {"1": 500}}, "logit_bias"), ({"suffix": "!"}, "suffix"),
                       ({"best_of": 1, "n": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=stack.model, prompt="hi", max_tokens=2, **bad)
        assert e.value.body["param"] == param
    assert client.completions.create(model=stack.model, prompt="still alive", max_tokens=2).usage.completion_tokens
    assert stack.alive()
