"""The API surface beyond generation basics, over real sockets against a real Redis with no model (the test
plays the worker, as in test_gateway_http.py): several prompts in one completions request, best_of,
continuous usage stats, logit_bias on the wire, /v1/models/{id}, /tokenize, /detokenize, /version."""

from __future__ import annotations

import asyncio

from gateway_client import read_sse
from phaseserve.wire import SubmitRequest, TokenEvent
from test_gateway_http import (MODEL, RequestsReader, add_worker, assert_openai_error, gw, play_text,  # noqa: F401
                               post, publish, text_model)


async def _submits(reader: RequestsReader, count: int) -> list[SubmitRequest]:
    return [await reader.next() for _ in range(count)]


async def test_a_list_of_prompts_gives_prompt_times_n_choices_indexed_as_openai_and_summed_usage(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    prompts = ["Hello there", "Bye"]
    replies = {0: "one", 1: "two two", 2: "three", 3: "four four four"}

    async def worker():
        subs = await _submits(reader, 4)
        # choice i*n+j is the j-th of prompt i; each prompt's choices seeded as that prompt alone would be
        assert [s.prompt_ids for s in subs] == [gw.tok.encode(p) for p in prompts for _ in range(2)]
        assert [s.params.seed for s in subs] == [5, 6, 5, 6]
        for i, s in enumerate(subs):
            await play_text(gw, s.request_id, replies[i])
        return subs

    task = asyncio.create_task(worker())
    resp = await gw.oai.completions.create(model=MODEL, prompt=prompts, n=2, seed=5, max_tokens=20, echo=True)
    subs = await task
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [prompts[i // 2] + replies[i] for i in range(4)]
    assert resp.usage.prompt_tokens == sum(len(gw.tok.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == sum(len(gw.tok.encode(r, add_special_tokens=False))
                                               for r in replies.values())
    assert len({s.request_id.rsplit("-", 1)[0] for s in subs}) == 1

    # token-id lists, streamed, with usage on every chunk (continuous_usage_stats) and in the last one
    task = asyncio.create_task(worker_ids(gw, reader, [[7, 8, 9], [10]], ["ab", "cd ef"]))
    async with gw.http.post(gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": [[7, 8, 9], [10]], "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        _, chunks = await read_sse(r)
    await task
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        prompt_len = 3 if choice["index"] == 0 else 1
        assert c["usage"]["prompt_tokens"] == prompt_len and c["usage"]["completion_tokens"] >= 1
    assert texts == {0: "ab", 1: "cd ef"}
    last_of = {i: [c for c in chunks[:-1] if c["choices"][0]["index"] == i][-1] for i in (0, 1)}
    assert last_of[1]["usage"]["completion_tokens"] == len(gw.tok.encode("cd ef", add_special_tokens=False))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 4


async def worker_ids(gw, reader, prompts, replies):
    subs = await _submits(reader, len(prompts))
    assert [s.prompt_ids for s in subs] == prompts
    for s, reply in zip(subs, replies):
        await play_text(gw, s.request_id, reply)


async def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    per_token = [-2.0, -0.5, -1.0]  # candidate 1 is the best, then 2

    async def worker():
        subs = await _submits(reader, 3)
        # ranking needs each token's logprob: asked of the worker though the client did not
        assert all(s.params.logprobs == 0 for s in subs)
        for s, lp in zip(subs, per_token):
            ids = gw.tok.encode(f"cand{lp}", add_special_tokens=False)
            await publish(gw, TokenEvent(s.request_id, 0, ids, "length", [[lp, []] for _ in ids]))
        return subs

    task = asyncio.create_task(worker())
    resp = await gw.oai.completions.create(model=MODEL, prompt="x", n=2, best_of=3, max_tokens=20)
    await task
    assert [(c.index, c.text) for c in resp.choices] == [(0, "cand-0.5"), (1, "cand-1.0")]
    assert all(c.logprobs is None for c in resp.choices)  # not asked for
    assert resp.usage.completion_tokens == sum(len(gw.tok.encode(f"cand{lp}", add_special_tokens=False))
                                               for lp in per_token)  # every generated token


async def test_logit_bias_reaches_the_worker_as_token_ids(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    task = asyncio.create_task(gw.oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logit_bias={"5": 100, "9": -100.0},
        max_tokens=4, reasoning_effort="low", extra_body={"some_unknown_field": 1}))
    (sub,) = await _submits(reader, 1)
    assert sub.params.logit_bias == {5: 100.0, 9: -100.0}
    await play_text(gw, sub.request_id, "ok")
    assert (await task).choices[0].message.content == "ok"


async def test_models_by_id_tokenize_detokenize_and_version(gw):
    await add_worker(gw, max_model_len=128)
    card = await gw.oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    async with gw.http.get(gw.url + "/v1/models/no/such-model") as r:
        assert r.status == 404
        assert_openai_error(await r.json(), "invalid_request_error", "model", "model_not_found")

    status, body = await post(gw, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and body["tokens"] == gw.tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128 and body["token_strs"] is None
    _, plain = await post(gw, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                            "return_token_strs": True})
    assert plain["tokens"] == gw.tok.encode("Hello world", add_special_tokens=False)
    assert plain["token_strs"] == [gw.tok.hf.id_to_token(t) for t in plain["tokens"]]
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = await post(gw, "/tokenize", {"messages": messages})
    assert chat["tokens"] == gw.tok.encode_chat(messages)
    _, text = await post(gw, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert text == {"prompt": gw.tok.decode(body["tokens"], skip_special_tokens=False)}
    async with gw.http.get(gw.url + "/version") as r:
        assert r.status == 200 and isinstance((await r.json())["version"], str)

    for path, bad, param in [
            ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
            ("/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens")]:
        status, err = await post(gw, path, bad)
        assert status == 400, (path, bad, err)
        assert_openai_error(err, "invalid_request_error", param)
    status, err = await post(gw, "/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404 and err["error"]["param"] == "model"


def test_best_of_ranks_within_each_prompt_and_indexes_choices_prompt_times_n():
    from types import SimpleNamespace

    from phaseserve.gateway.best_of import best_of
    from phaseserve.gateway.output import TokenLogprob

    def out(name, *lps):
        return SimpleNamespace(name=name, index=-1, logprobs=[TokenLogprob(0, lp, [], 0) for lp in lps])

    # two prompts, three candidates each; a short candidate can win on cumulative logprob
    outs = [out("a0", -1, -1), out("a1", -0.5), out("a2", -3), out("b0", -0.1, -0.1), out("b1", -2), out("b2", -0.1)]
    chosen = best_of(outs, per_prompt=3, n=2)
    assert [(o.name, o.index) for o in chosen] == [("a1", 0), ("a0", 1), ("b2", 2), ("b0", 3)]
