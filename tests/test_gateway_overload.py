"""Overload and abuse at the gateway, over real sockets against a real Redis; the test plays the
worker (as in test_gateway_http.py): a burst against a small Redis pool, 429 + Retry-After by requests and by
queued prompt tokens, the priority range, bearer API keys, a password-protected Redis."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from phaseserve.redis_server import EmbeddedRedis
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import Keys, SubmitRequest, TokenEvent
from test_gateway_http import (GATEWAY_ID, MODEL, RequestsReader, add_worker, assert_openai_error, publish,
                               start_gateway, text_model)  # noqa: F401 (text_model is a fixture)


class Gw:
    def __init__(self, url, redis_url, model_dir, http):
        self.url, self.http = url, http
        self.redis = aioredis.Redis.from_url(redis_url)
        self.keys = Keys("t")
        self.tok = Tokenizer(str(model_dir))

    def oai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture
async def make_gw(redis_server, text_model):
    made = []

    async def make(*flags: str, redis_url: str | None = None) -> Gw:
        url_ = redis_url or redis_server
        runner, url = await start_gateway(url_, text_model, *flags)
        http = aiohttp.ClientSession()
        g = Gw(url, url_, text_model, http)
        made.append((runner, g))
        return g

    yield make
    for runner, g in made:
        await runner.cleanup()
        await g.http.close()
        await g.redis.aclose()


async def echo_worker(g: Gw, count: int, text: str = "Hi there") -> list[SubmitRequest]:
    """Answer `count` submits, each with `text` in one step (finish: length)."""
    reader, ids, subs = RequestsReader(g), g.tok.encode(text, add_special_tokens=False), []
    while len(subs) < count:
        sub = await reader.next(timeout=60)
        if isinstance(sub, SubmitRequest):
            subs.append(sub)
            await publish(g, TokenEvent(sub.request_id, 0, ids, "length"))
    return subs


async def sse_text(http: aiohttp.ClientSession, url: str, body: dict, headers=None) -> tuple[int, str]:
    async with http.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status != 200:
            return r.status, await r.text()
        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return r.status, text


async def test_a_burst_of_streams_waits_for_a_small_redis_pool_instead_of_failing(make_gw):
    n = 150
    g = await make_gw("--redis-max-connections", "2", "--max-waiting-requests", str(n))
    await add_worker(g)
    worker = asyncio.create_task(echo_worker(g, n))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        results = await asyncio.gather(*[sse_text(http, g.url, {"model": MODEL, "prompt": f"p{i}", "max_tokens": 4})
                                         for i in range(n)])
    subs = await asyncio.wait_for(worker, 30)
    assert [r for r in results if r != (200, "Hi there")] == []
    assert len({s.request_id for s in subs}) == n
    # the gateway held at most its pool (2) + its subscriber connection; the test's own client is 1 more
    clients = await g.redis.client_list()
    assert len(clients) <= 2 + 1 + 1, [c.get("cmd") for c in clients]


async def test_429_with_retry_after_by_requests_and_by_queued_prompt_tokens(make_gw):
    g = await make_gw("--max-waiting-requests", "2", "--max-queued-prompt-tokens", "10", "--retry-after", "7")
    await add_worker(g)
    reader = RequestsReader(g)
    body = {"model": MODEL, "max_tokens": 4, "stream": True}
    first = await g.http.post(g.url + "/v1/completions", json={**body, "prompt": [5] * 8})
    sub1 = await reader.next()
    # 8 prompt tokens queued: 5 more exceed the 10 allowed
    async with g.http.post(g.url + "/v1/completions", json={**body, "prompt": [5] * 5}) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "7"
        err = await r.json()
        assert_openai_error(err, "rate_limit_error", None, "rate_limit_exceeded")
        assert "prompt tokens queued" in err["error"]["message"]
    # the first token arrives: its prompt is no longer queued, the second request is let in
    await publish(g, TokenEvent(sub1.request_id, 0, [7]))
    assert (await first.content.readline()).startswith(b"data: {")
    second = await g.http.post(g.url + "/v1/completions", json={**body, "prompt": [5] * 5})
    assert second.status == 200
    await reader.next()
    # two requests in flight: the third is refused by count
    with pytest.raises(openai.RateLimitError) as e:
        await g.oai().completions.create(model=MODEL, prompt=[5], max_tokens=1)
    assert e.value.response.headers["Retry-After"] == "7" and "in flight" in e.value.message
    first.close()
    second.close()


async def test_priority_outside_the_operators_range_is_400(make_gw):
    g = await make_gw("--priority-min", "-2", "--priority-max", "3")
    await add_worker(g)
    for priority in (-3, 4):
        async with g.http.post(g.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "hi", "priority": priority}) as r:
            assert r.status == 400
            err = await r.json()
            assert_openai_error(err, "invalid_request_error", "priority")
            assert "between -2 and 3" in err["error"]["message"]
    worker = asyncio.create_task(echo_worker(g, 1))
    async with g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "priority": -2}) as r:
        assert r.status == 200
    assert (await worker)[0].priority == -2


async def test_api_keys_401_in_openai_format_and_the_right_key_with_the_openai_client(make_gw, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nsk-from-file\n")
    g = await make_gw("--api-key", "sk-one, sk-two", "--api-key-file", str(key_file))
    await add_worker(g)
    with pytest.raises(openai.AuthenticationError) as e:
        await g.oai("sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/v1/nothing", "get")):
        async with g.http.request(method, g.url + path, json={}) as r:  # no Authorization header
            assert r.status == 401, path
            assert_openai_error(await r.json(), "invalid_request_error")
        async with g.http.request(method, g.url + path, json={}, headers={"Authorization": "Bearer sk-on"}) as r:
            assert r.status == 401, path
            assert_openai_error(await r.json(), "invalid_request_error", None, "invalid_api_key")
    for path in ("/health", "/metrics", "/openapi.json"):  # stay open
        async with g.http.get(g.url + path) as r:
            assert r.status == 200, path
    worker = asyncio.create_task(echo_worker(g, 2))
    for key in ("sk-two", "sk-from-file"):
        resp = await asyncio.wait_for(g.oai(key).completions.create(model=MODEL, prompt="hi", max_tokens=4), 30)
        assert resp.choices[0].text == "Hi there"
    await worker
    assert [m.id for m in (await g.oai("sk-one").models.list()).data] == [MODEL]


async def test_a_password_protected_redis_is_used_through_the_url(make_gw):
    with EmbeddedRedis(requirepass="p@ss/word") as server:
        assert "p%40ss%2Fword@" in server.url
        g = await make_gw(redis_url=server.url)
        await add_worker(g)
        async with g.http.get(g.url + "/health") as r:
            assert r.status == 200 and (await r.json())["token_channel"] is True
        worker = asyncio.create_task(echo_worker(g, 1))
        status, text = await sse_text(g.http, g.url, {"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert (status, text) == (200, "Hi there")
        await worker
        # the same server without the password in the url: refused, answered 503 (never a traceback)
        g2 = await make_gw(redis_url=f"redis://{server.host}:{server.port}/0")
        async with g2.http.post(g2.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 503, await r.text()


def test_rediss_urls_give_tls_connections():
    from phaseserve.gateway.backend import Backend

    b = Backend("rediss://:secret@redis.example:6380/2", Keys("t"), GATEWAY_ID, max_connections=3)
    pool = b.redis.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection" and pool.max_connections == 3
    assert pool.connection_kwargs["password"] == "secret" and pool.connection_kwargs["db"] == 2
