"""End to end over real sockets: the official openai client against the whole stack
(embedded Redis + scheduler + worker + gateway subprocesses), see the `stack` fixture."""

from __future__ import annotations

import json

import aiohttp
import pytest

MAX_TOKENS = 8


def test_models_lists_the_served_model(client, stack):
    ids = [m.id for m in client.models.list().data]
    assert ids == [stack.model]


def test_text_completion_non_streamed_with_usage(client, stack, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == stack.model
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
    assert isinstance(choice.text, str) and choice.text


def test_text_completion_streamed_equals_non_streamed(client, stack):
    kwargs = dict(model=stack.model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS
    assert usage[0].prompt_tokens == whole.usage.prompt_tokens


def test_chat_completion_non_streamed_and_streamed(client, stack, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    kwargs = dict(model=stack.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion"
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert whole.usage.completion_tokens == MAX_TOKENS

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.usage.total_tokens for c in chunks if c.usage] == [whole.usage.total_tokens]


def test_stop_string_cuts_the_text(client, stack):
    base = dict(model=stack.model, prompt="Hello world! Paged attention", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    assert len(full) >= 6, f"need some text to pick a stop string from: {full!r}"
    stop = full[3:5]  # two characters that occur after the start: the reply must end just before them
    expected = full[: full.index(stop)]
    r = client.completions.create(stop=[stop], **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected
    streamed = client.completions.create(stop=[stop], stream=True, **base)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_n_2_gives_two_choices(client, stack):
    r = client.completions.create(model=stack.model, prompt="The quick", max_tokens=MAX_TOKENS, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    # greedy: both sequences are the same text
    assert r.choices[0].text == r.choices[1].text
    assert r.usage.completion_tokens == 2 * MAX_TOKENS

    chunks = list(client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS, n=2,
        temperature=1.0, seed=7, stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())


def test_a_tiny_temperature_is_greedy_not_a_nan_stop(client, stack):
    """A temperature below 1e-5 samples greedy: divided by 1e-31 the logits overflowed to NaN and the stream
    ended at once with 'stop'."""
    kwargs = dict(model=stack.model, prompt="Once upon a time", max_tokens=MAX_TOKENS,
                  extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kwargs).choices[0]
    for temperature in (1e-31, 1e-40):
        tiny = client.completions.create(temperature=temperature, **kwargs).choices[0]
        assert (tiny.finish_reason, tiny.text) == ("length", greedy.text), temperature


# ---------------------------------------------------------------- bad input: 4xx in OpenAI's shape


def _bad_requests(model: str, long_prompt: str) -> list[tuple[str, str, bytes, int, str | None]]:
    """(name, path, raw body, expected status, expected param)."""
    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
        ("json not an object", "/v1/chat/completions", b"[1, 2, 3]", 400, None),
        ("missing prompt", "/v1/completions", j({"model": model}), 400, "prompt"),
        ("missing messages", "/v1/chat/completions", j({"model": model}), 400, "messages"),
        ("ill-typed max_tokens", "/v1/completions", j({"model": model, "prompt": "hi", "max_tokens": "ten"}),
         400, "max_tokens"),
        ("ill-typed messages", "/v1/chat/completions", j({"model": model, "messages": "hello"}), 400, "messages"),
        ("temperature out of range", "/v1/completions", j({"model": model, "prompt": "hi", "temperature": 5}),
         400, "temperature"),
        ("top_p out of range", "/v1/chat/completions",
         j({"model": model, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}), 400, "top_p"),
        ("negative max_tokens", "/v1/completions", j({"model": model, "prompt": "hi", "max_tokens": -3}),
         400, "max_tokens"),
        ("prompt longer than the context", "/v1/completions", j({"model": model, "prompt": long_prompt}),
         400, None),
        ("unknown model", "/v1/completions", j({"model": "no-such-model", "prompt": "hi"}), 404, "model"),
        # refused by its length in characters, before it is tokenized
        ("prompt longer in characters than the context can hold", "/v1/completions",
         j({"model": model, "prompt": "x" * 900_000}), 400, "prompt"),
        # integers wider than 64 bits, named (not a 500 when the request is packed for the wire)
        ("seed beyond 64 bits", "/v1/completions", j({"model": model, "prompt": "hi", "seed": 1 << 70}),
         400, "seed"),
        ("top_k beyond 64 bits", "/v1/chat/completions", j({**chat, "top_k": 1 << 64}), 400, "top_k"),
        ("stop_token_ids beyond 64 bits", "/v1/completions",
         j({"model": model, "prompt": "hi", "stop_token_ids": [1 << 65]}), 400, "stop_token_ids"),
        ("stop_token_ids outside the vocabulary", "/v1/chat/completions",
         j({**chat, "stop_token_ids": [1, 10_000_000]}), 400, "stop_token_ids"),
        ("too many stop_token_ids", "/v1/completions",
         j({"model": model, "prompt": "hi", "stop_token_ids": [1] * 125_000}), 400, "stop_token_ids"),
        # chat_template_kwargs that collide with the template's own arguments
        ("chat_template_kwargs sets messages", "/v1/chat/completions",
         j({**chat, "chat_template_kwargs": {"messages": []}}), 400, "chat_template_kwargs"),
        ("chat_template_kwargs sets add_generation_prompt", "/v1/chat/completions",
         j({**chat, "chat_template_kwargs": {"add_generation_prompt": False}}), 400, "chat_template_kwargs"),
        ("oversized body", "/v1/completions", j({"model": model, "prompt": "x" * (2 << 20)}), 413, None),
    ]


async def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(stack, client):
    long_prompt = "hello world " * 4000  # far past any context the test models have
    async with aiohttp.ClientSession(base_url=stack.base_url) as http:
        for name, path, body, status, param in _bad_requests(stack.model, long_prompt):
            async with http.post(path, data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, f"{name}: {r.status} {await r.text()}"
                err = (await r.json())["error"]
                assert isinstance(err["message"], str) and err["message"], name
                assert err["type"] == "invalid_request_error", name
                if param is not None:
                    assert err["param"] == param, f"{name}: {err}"
    r = client.completions.create(model=stack.model, prompt="still alive", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert stack.alive()
