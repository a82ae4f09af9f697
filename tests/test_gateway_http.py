"""The gateway over real sockets against a real Redis, with no model: the test plays the worker.

It reads SubmitRequest / CancelRequest from the requests stream and publishes TokenBatch
messages on the gateway's channel, so this checks the gateway's end of the wire contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from phaseserve.redis_server import EmbeddedRedis, free_port
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.kv_admission import KVCapacity
from gateway_client import read_sse, serve_gateway
from phaseserve.wire import (ERROR_QUARANTINED, ERROR_REJECTED, FIELD, CancelRequest, Keys,
                             SubmitRequest, TokenBatch, TokenEvent, WorkerInfo, peek_kind)
from phaseserve.gateway import protocol as P
from text_model_factory import make_text_model

MODEL = "tiny-text"
GATEWAY_ID = "gw-test"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("models") / MODEL)


async def start_gateway(redis_url: str, model_dir, *extra: str):
    return await serve_gateway(["--redis-url", redis_url, "--model", str(model_dir), "--key-prefix", "t",
                                "--gateway-id", GATEWAY_ID, "--max-body-bytes", "65536",
                                "--max-waiting-requests", "2",
                                # a client that goes away is cancelled at once (no wait for a resume)
                                "--resume-grace", "0", *extra])


@pytest.fixture
async def gw(redis_server, text_model):
    runner, url = await start_gateway(redis_server, text_model)
    r = aioredis.Redis.from_url(redis_server)
    keys = Keys("t")
    async with aiohttp.ClientSession() as http:
        yield SimpleNamespace(url=url, redis=r, keys=keys, http=http, tok=Tokenizer(str(text_model)),
                              oai=openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
    await runner.cleanup()
    await r.aclose()


async def add_worker(g, max_model_len: int = 256, worker_id: str = "w1", num_blocks: int = 100, **info_kw) -> None:
    info = WorkerInfo(worker_id, "mixed", MODEL, num_blocks, 16, max_model_len, os.getpid(), time.time(), **info_kw)
    await g.redis.sadd(g.keys.workers, worker_id)
    await g.redis.set(g.keys.worker_heartbeat(worker_id), info.to_wire(), px=60_000)


class RequestsReader:
    """Reads the gateway's messages off the requests stream, in order."""

    def __init__(self, g):
        self.g, self.last = g, "0"

    async def next(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = await self.g.redis.xread({self.g.keys.requests: self.last}, count=1, block=200)
            if got:
                entry_id, fields = got[0][1][0]
                self.last = entry_id
                data = fields[FIELD.encode()]
                kind = peek_kind(data)
                return SubmitRequest.from_wire(data) if kind == "submit" else CancelRequest.from_wire(data)
        raise AssertionError("no message on the requests stream")


async def publish(g, *events: TokenEvent, step: int = 0) -> None:
    await g.redis.publish(g.keys.gateway_channel(GATEWAY_ID), TokenBatch(step, "w1", list(events)).to_wire())


async def play_text(g, seq_id: str, text: str, finish: str = "length", per_step: int = 2,
                    logprobs: bool = False) -> int:
    """Publish `text` as tokens, `per_step` tokens a step, each step also replayed (a duplicate)."""
    ids = g.tok.encode(text, add_special_tokens=False)
    for step, off in enumerate(range(0, len(ids), per_step)):
        chunk = ids[off:off + per_step]
        last = off + per_step >= len(ids)
        lps = [[-0.25, [[t, -0.25], [5, -3.0]]] for t in chunk] if logprobs else None
        ev = TokenEvent(seq_id, off, chunk, finish if last else None, lps)
        await publish(g, ev, step=step)
        if not last:
            await publish(g, ev, step=step)  # a replayed step: the gateway must drop it
    return len(ids)


def assert_openai_error(body: dict, type_: str, param=None, code=None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["param"] == param and body["error"]["code"] == code
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]


# ----------------------------------------------------------------------------- errors


async def post(g, path: str, data, headers=None) -> tuple[int, dict]:
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    async with g.http.post(g.url + path, data=body, headers=headers or {"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def test_http_errors_in_openai_format(gw):
    await add_worker(gw)
    status, body = await post(gw, "/v1/completions", b'{"model": "tiny-text", "prompt": ')
    assert status == 400
    assert_openai_error(body, "invalid_request_error")
    assert "Malformed JSON" in body["error"]["message"]

    status, body = await post(gw, "/v1/chat/completions", {"model": MODEL})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "messages")

    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "max_tokens")

    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 3})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "temperature")

    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": [1, 99999]})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "prompt")

    status, body = await post(gw, "/v1/completions", {"model": "gpt-nope", "prompt": "hi"})
    assert status == 404
    assert_openai_error(body, "invalid_request_error", "model", "model_not_found")

    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000})
    assert status == 413
    assert_openai_error(body, "invalid_request_error", None, "request_too_large")

    async with gw.http.get(gw.url + "/v1/nothing") as r:
        assert r.status == 404
        assert_openai_error(await r.json(), "invalid_request_error", None, "not_found")
    async with gw.http.get(gw.url + "/v1/completions") as r:
        assert r.status == 405
        assert_openai_error(await r.json(), "invalid_request_error", None, "method_not_allowed")

    # the context limit comes from the live workers' heartbeats
    await add_worker(gw, max_model_len=40, worker_id="w-small")
    await asyncio.sleep(0.6)  # the gateway caches the worker list for 0.5 s
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 38})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert "maximum context length is 40 tokens" in body["error"]["message"]

    # the openai client sees the same errors as typed exceptions
    with pytest.raises(openai.NotFoundError) as e:
        await gw.oai.completions.create(model="gpt-nope", prompt="hi")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await gw.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=99)


async def test_a_prompt_no_workers_kv_cache_holds_is_400_before_it_is_queued(gw):
    # 4 blocks of 16 tokens: the KV cache holds far less than the 256-token context
    await add_worker(gw, max_model_len=256, num_blocks=4)
    cap = KVCapacity(4, 16, 256)
    limit = cap.max_prompt_len(1)
    assert 16 < limit < 100
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": [5] * (limit + 1), "max_tokens": 1})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "prompt", "context_length_exceeded")
    assert body["error"]["message"] == (
        f"This model's KV cache (the largest of its live workers') holds a prompt of at most {limit} tokens. "
        f"However, your prompt has {limit + 1} tokens. Please reduce the length of the prompt.")

    # a prompt that fits, with a completion that does not: the completion's parameter is named
    most = cap.max_new_tokens(limit)
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": [5] * limit, "max_tokens": most + 1})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert f"holds your {limit}-token prompt with at most {most} tokens of completion" in body["error"]["message"]

    # the openai client sees it as a typed error; a chat's prompt is its messages
    content = "hello world"
    while len(gw.tok.encode_chat([{"role": "user", "content": content}])) <= limit:
        content += " hello world"
    assert len(gw.tok.encode_chat([{"role": "user", "content": content}])) < 256  # within the context
    with pytest.raises(openai.BadRequestError) as e:
        await gw.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                             stream=True)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "KV cache" in e.value.body["message"]
    assert await gw.redis.xlen(gw.keys.requests) == 0  # none of them reached the scheduler

    # a request without max_tokens still runs: its default completion is what the cache holds, not the context
    reader = RequestsReader(gw)

    async def worker():
        sub = await reader.next()
        prompt_len = len(sub.prompt_ids)
        assert sub.params.max_tokens == cap.max_new_tokens(prompt_len) < 256 - prompt_len
        await play_text(gw, sub.request_id, "Hi there", finish="stop")
        sub = await reader.next()  # the long prompt, once a worker with a larger cache is alive
        assert len(sub.prompt_ids) == limit + 1
        await play_text(gw, sub.request_id, "Fine", finish="length")

    task = asyncio.create_task(worker())
    resp = await gw.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}])
    assert resp.choices[0].message.content == "Hi there" and resp.choices[0].finish_reason == "stop"

    # any live worker that can hold it will do
    await add_worker(gw, max_model_len=256, worker_id="w-big", num_blocks=100)
    await asyncio.sleep(0.6)  # the gateway caches the worker list for 0.5 s
    resp = await gw.oai.completions.create(model=MODEL, prompt=[5] * (limit + 1), max_tokens=1)
    assert resp.choices[0].text == "Fine"
    await task


async def test_a_scheduler_rejection_is_400_with_its_message_in_or_out_of_a_stream(gw):
    """The heartbeat the gateway checked can be stale: the scheduler may still refuse the request."""
    await add_worker(gw)
    reader = RequestsReader(gw)
    message = "request 'r-0': needs up to 9 KV blocks of 16 tokens; the worker has 4 (watermark 0)"

    async def scheduler():
        for _ in range(2):
            sub = await reader.next()
            await publish(gw, TokenEvent(sub.request_id, 0, [], "error", None, message, ERROR_REJECTED))

    task = asyncio.create_task(scheduler())
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "prompt", "context_length_exceeded")
    assert body["error"]["message"] == message

    # a stream's headers are sent before the scheduler answers: the same error comes as its last event
    async with gw.http.post(gw.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
        assert r.status == 200
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
    await task
    assert_openai_error(events[-1], "invalid_request_error", "messages", "context_length_exceeded")
    assert events[-1]["error"]["message"] == message


async def test_a_quarantined_request_is_422_in_or_out_of_a_stream(gw):
    """A request the scheduler dead-lettered (it was running on workers that failed) is a 422, which clients
    do not retry (openai raises UnprocessableEntityError): a retry could take the next workers down."""
    await add_worker(gw)
    reader = RequestsReader(gw)
    message = "request quarantined: it was running on 2 workers that failed"

    async def scheduler():
        for _ in range(2):
            sub = await reader.next()
            await publish(gw, TokenEvent(sub.request_id, 0, [], "error", None, message, ERROR_QUARANTINED))

    task = asyncio.create_task(scheduler())
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert status == 422 and body["error"]["message"] == message
    assert_openai_error(body, "invalid_request_error", None, "request_quarantined")
    async with gw.http.post(gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True}) as r:
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
    assert_openai_error(events[-1], "invalid_request_error", None, "request_quarantined")
    await task


async def test_no_worker_is_503_and_health_follows_heartbeats(gw):
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 503
    assert_openai_error(body, "server_error", None, "service_unavailable")
    async with gw.http.get(gw.url + "/health") as r:
        assert r.status == 503
    await add_worker(gw)
    async with gw.http.get(gw.url + "/health") as r:
        assert r.status == 200 and (await r.json())["workers"] == ["w1"]
    await gw.redis.delete(gw.keys.worker_heartbeat("w1"))  # the heartbeat expired: the worker is dead
    async with gw.http.get(gw.url + "/health") as r:
        assert r.status == 503


async def test_redis_down_is_503(text_model):
    server = EmbeddedRedis().start()
    runner, url = await start_gateway(server.url, text_model)
    try:
        server.stop()
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
                assert r.status == 503
                assert_openai_error(await r.json(), "server_error", None, "service_unavailable")
            async with http.get(url + "/health") as r:
                assert r.status == 503
    finally:
        await runner.cleanup()
        server.stop()


async def test_models_openapi_and_metrics(gw):
    await add_worker(gw, max_model_len=128)
    models = await gw.oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with gw.http.get(gw.url + "/openapi.json") as r:
        doc = await r.json()
    assert doc["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                                "/health", "/metrics"} <= set(doc["paths"])
    assert "temperature" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    await gw.redis.set(gw.keys.scheduler_stats(), __import__("msgpack").packb(
        {"num_waiting": 3, "num_running": 2, "kv_blocks_used": 25, "kv_blocks_total": 100, "num_preemptions": 1,
         "num_waiting_tokens": 700, "handoff_bytes_by_transport": {"redis": 4096}, "num_quarantined": 2,
         "num_sat_out": 7, "updated_at": 1.0}))
    async with gw.http.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert "phaseserve_num_requests_waiting 3.0" in text and "phaseserve_kv_cache_usage_ratio 0.25" in text
    # the names an inference gateway reads (vLLM's, under our prefix), and the demand KEDA scales on
    assert "phaseserve_num_requests_running 2.0" in text and "phaseserve_kv_cache_usage_perc 0.25" in text
    assert "phaseserve_num_prefill_tokens_waiting 700.0" in text
    assert 'phaseserve_kv_handoff_transport_bytes{transport="redis"} 4096.0' in text
    assert 'phaseserve_kv_handoff_transport_bytes{transport="shm"} 0.0' in text
    assert "phaseserve_requests_quarantined 2.0" in text and "phaseserve_num_steps_sat_out 7.0" in text
    assert "phaseserve_workers_alive 1.0" in text and "phaseserve_time_to_first_token_seconds_bucket" in text


async def test_health_and_metrics_show_what_each_worker_computes_with(gw):
    kernels = {"attention": "native avx2", "layer_ops": "torch", "linear": "torch"}
    await add_worker(gw, worker_id="w1", host="h1", dtype="float32", cpu_level="avx2", kernels=kernels)
    await add_worker(gw, worker_id="w2", host="h2", dtype="bfloat16", cpu_level="avx512-bf16",
                     kernels={"attention": "native avx512-bf16"})
    async with gw.http.get(gw.url + "/health") as r:
        info = (await r.json())["worker_info"]
    assert info["w1"] == {"role": "mixed", "host": "h1", "dtype": "float32", "cpu_level": "avx2", "kernels": kernels}
    assert (info["w2"]["dtype"], info["w2"]["kernels"]) == ("bfloat16", {"attention": "native avx512-bf16"})
    async with gw.http.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert ('phaseserve_worker_info{cpu_level="avx2",dtype="float32",host="h1",role="mixed",worker_id="w1"} 1.0'
            in text)
    assert 'phaseserve_worker_kernel_info{family="attention",implementation="native avx2",worker_id="w1"} 1.0' in text
    assert ('phaseserve_worker_kernel_info{family="attention",implementation="native avx512-bf16",worker_id="w2"} '
            '1.0' in text)
    await gw.redis.delete(gw.keys.worker_heartbeat("w2"))  # gone: its series go with it
    async with gw.http.get(gw.url + "/health") as r:  # reads the heartbeats afresh (/metrics reuses that read)
        assert list((await r.json())["worker_info"]) == ["w1"]
    async with gw.http.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert 'worker_id="w2"' not in text and 'worker_id="w1"' in text


# ----------------------------------------------------------------------------- the wire round trip


async def test_chat_stream_round_trip_with_openai_client(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    reply = "Hello wörld 🙂 日本"

    async def worker():
        sub = await reader.next()
        assert isinstance(sub, SubmitRequest) and sub.gateway_id == GATEWAY_ID and sub.request_id.endswith("-0")
        assert sub.params.temperature == 0.0 and sub.params.max_tokens == 50 and sub.params.seed == 7
        assert sub.prompt_ids == gw.tok.encode_chat([{"role": "user", "content": "Say hi"}])
        return sub, await play_text(gw, sub.request_id, reply, finish="stop")

    task = asyncio.create_task(worker())
    stream = await gw.oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], stream=True, temperature=0, max_tokens=50,
        seed=7, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    sub, n_tokens = await task
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert chunks[-1].usage.prompt_tokens == len(sub.prompt_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    await asyncio.sleep(0.1)
    assert await gw.redis.xlen(gw.keys.requests) == 1  # finished by the worker: no CancelRequest


async def test_completion_n2_with_logprobs(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    texts = ["Café au lait", "The quick fox"]

    async def worker():
        subs = [await reader.next(), await reader.next()]
        assert [s.request_id[-2:] for s in subs] == ["-0", "-1"] and [s.params.seed for s in subs] == [3, 4]
        assert subs[0].prompt_ids == [1, 2, 3] and subs[0].params.logprobs == 2
        for s, t in zip(subs, texts):
            await play_text(gw, s.request_id, t, finish="length", logprobs=True)

    task = asyncio.create_task(worker())
    resp = await gw.oai.completions.create(model=MODEL, prompt=[1, 2, 3], n=2, seed=3, logprobs=2, max_tokens=20)
    await task
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == texts
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    ids = gw.tok.encode(texts[0], add_special_tokens=False)
    assert choice.logprobs.tokens == [gw.tok.token_text(t) for t in ids]
    assert choice.logprobs.token_logprobs == [-0.25] * len(ids)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    assert resp.usage.prompt_tokens == 3
    assert resp.usage.completion_tokens == len(ids) + len(gw.tok.encode(texts[1], add_special_tokens=False))


async def test_stop_string_ends_the_stream_and_cancels_the_sequence(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)

    async def worker():
        sub = await reader.next()
        await play_text(gw, sub.request_id, "Go on. STOP here, then more text that must not show", finish="length")
        return sub, await reader.next()

    task = asyncio.create_task(worker())
    stream = await gw.oai.completions.create(model=MODEL, prompt="Say", stream=True, stop=["STOP"], max_tokens=40)
    chunks = [c async for c in stream]
    sub, cancel = await task
    assert "".join(c.choices[0].text for c in chunks) == "Go on. "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(cancel, CancelRequest) and cancel.request_id == sub.request_id and cancel.reason == "stop"


async def test_disconnect_cancels_and_in_flight_limit_is_429(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)
    body = {"model": MODEL, "prompt": "Hello", "stream": True, "max_tokens": 30}
    session = aiohttp.ClientSession()
    first = await session.post(gw.url + "/v1/completions", json=body)
    sub = await reader.next()
    await publish(gw, TokenEvent(sub.request_id, 0, gw.tok.encode("Hi there", add_special_tokens=False)))
    line = await first.content.readline()  # OpenAI's stream: no `id:` line unless the client asks for one
    assert line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["text"] == "Hi there"
    # a non-streaming request also holds a slot; the limit is 2 in flight, so the third is refused
    second = asyncio.create_task(session.post(gw.url + "/v1/completions", json={**body, "stream": False}))
    sub2 = await reader.next()
    status, err = await post(gw, "/v1/completions", body)
    assert status == 429
    assert_openai_error(err, "rate_limit_error", None, "rate_limit_exceeded")
    await session.close()  # both clients go away mid-generation
    cancels = {(await reader.next()).request_id for _ in range(2)}
    assert cancels == {sub.request_id, sub2.request_id}
    second.cancel()


async def test_main_serves_and_stops_on_sigterm(redis_server, text_model):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "phaseserve.gateway", "--redis-url", redis_server, "--model", str(text_model),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        assert r.status == 503  # up, but no worker
                        break
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                    await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_completion_echo_and_worker_error(gw):
    await add_worker(gw)
    reader = RequestsReader(gw)

    async def worker():
        sub = await reader.next()
        await play_text(gw, sub.request_id, " and more", finish="length")
        sub = await reader.next()
        await publish(gw, TokenEvent(sub.request_id, 0, [], "error", None, "prompt does not fit the KV cache"))

    task = asyncio.create_task(worker())
    resp = await gw.oai.completions.create(model=MODEL, prompt="Café", echo=True, max_tokens=5)
    assert resp.choices[0].text == "Café and more"
    with pytest.raises(openai.InternalServerError) as e:
        await gw.oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert "KV cache" in e.value.message
    await task


async def test_a_streams_end_last_event_usage_and_done(gw):
    """The gateway sends a stream's last token event, its usage chunk, [DONE] and the end of the chunked
    body in one write: they come in that order, the last event with its resume id, and nothing after."""
    await add_worker(gw)
    reader = RequestsReader(gw)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    async with gw.http.post(gw.url + "/v1/completions", json=body, headers={"X-Resume": "1"}) as resp:
        sub = await reader.next()
        reads = []
        await publish(gw, TokenEvent(sub.request_id, 0, [5, 6]), step=0)
        reads.append(await resp.content.readany())  # the first event, on its own
        await publish(gw, TokenEvent(sub.request_id, 2, [7], "length"), step=1)
        while chunk := await resp.content.readany():
            reads.append(chunk)
    assert b'"finish_reason":null' in reads[0] and b"[DONE]" not in reads[0]
    tail = b"".join(reads[1:]).decode()
    last_event, usage, done = tail.index('"finish_reason":"length"'), tail.index('"usage":{'), tail.index("[DONE]")
    assert last_event < usage < done and tail.endswith("data: [DONE]\n\n")
    rid, token = sub.request_id.rsplit('-', 1)[0], resp.headers["X-Resume-Token"]
    assert f"id: {rid}:{token}:4\n" in tail  # 3 tokens consumed, plus 1: finished


# ----------------------------------------------------------------------------- abuse: huge prompts


async def _time_stream_chunks(g, sub_request_id: str, resp: aiohttp.ClientResponse, arrivals: list[float]):
    async for line in resp.content:
        if line.startswith(b"data: {"):
            arrivals.append(time.monotonic())


async def test_huge_prompts_are_refused_without_stalling_other_streams(redis_server, text_model):
    """Tokenizing a huge prompt runs off the event loop: while four are tokenized and refused (400), a
    running stream's chunks keep coming; on the loop, the stream stalled for every one of them."""
    runner, url = await start_gateway(redis_server, text_model, "--max-body-bytes", "8MiB",
                                      "--max-waiting-requests", "16", "--max-queued-prompt-tokens", "100000000")
    g = SimpleNamespace(url=url, redis=aioredis.Redis.from_url(redis_server), keys=Keys("t"),
                        tok=Tokenizer(str(text_model)))
    huge = ("hello wörld 🙂 " * 20000)[:250_000]
    t0 = time.perf_counter()
    g.tok.encode(huge)
    tokenize_s = time.perf_counter() - t0  # one huge prompt, on this machine, now
    # a context the prompts fit by characters (so they are tokenized), a KV cache they do not (so 400)
    await add_worker(g, max_model_len=10_000_000, num_blocks=100)
    reader = RequestsReader(g)
    stop = asyncio.Event()
    token = g.tok.encode("a", add_special_tokens=False)[0]
    arrivals: list[float] = []
    try:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True,
                                                                  "max_tokens": 1000})
            sub = await reader.next()

            async def play():  # a token every 10 ms until told to stop
                for off in range(1000):
                    if stop.is_set():
                        break
                    await publish(g, TokenEvent(sub.request_id, off, [token]))
                    await asyncio.sleep(0.01)

            player = asyncio.create_task(play())
            timing = asyncio.create_task(_time_stream_chunks(g, sub.request_id, resp, arrivals))
            await asyncio.sleep(1.0)
            baseline = list(arrivals)
            start = time.monotonic()

            async def refused() -> tuple[int, dict]:
                async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": huge}) as r:
                    return r.status, await r.json()

            answers = await asyncio.gather(*[refused() for _ in range(4)])
            end = time.monotonic()
            await asyncio.sleep(0.3)
            stop.set()
            await player
            timing.cancel()
            resp.close()
    finally:
        await runner.cleanup()
        await g.redis.aclose()
    for status, body in answers:
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    during = [t for t in arrivals if start <= t <= end + 0.3]
    gaps = [b - a for a, b in zip(during, during[1:])]
    base_gaps = sorted(b - a for a, b in zip(baseline, baseline[1:]))
    assert len(during) > 10 and gaps
    # before: one gap of about four tokenizations; now about the baseline's
    assert max(gaps) < tokenize_s / 2, (max(gaps), tokenize_s, base_gaps[len(base_gaps) // 2], max(base_gaps))


async def test_a_prompt_longer_in_characters_than_the_context_can_hold_is_400_untokenized(gw):
    await add_worker(gw, max_model_len=256)
    await asyncio.sleep(0.6)  # the worker list is cached for 0.5 s
    status, body = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "x" * 60_000})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "prompt", "context_length_exceeded")
    assert "characters" in body["error"]["message"]
    status, body = await post(gw, "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "x" * 60_000}]})
    assert status == 400
    assert_openai_error(body, "invalid_request_error", "messages", "context_length_exceeded")


# ----------------------------------------------------------------------------- Redis restarted


async def test_after_redis_restarts_with_its_data_the_next_requests_succeed(text_model, tmp_path):
    """Redis stopped and started again with its data (AOF) under a live gateway: the pooled connections are
    dead, and each command on one is retried on a new connection instead of answering 503."""
    server = EmbeddedRedis(data_dir=str(tmp_path)).start()
    runner, url = await start_gateway(server.url, text_model, "--max-waiting-requests", "64")
    g = SimpleNamespace(redis=aioredis.Redis.from_url(server.url), keys=Keys("t"))
    try:
        await add_worker(g, max_model_len=200)
        async with aiohttp.ClientSession() as http:
            async def models() -> tuple[int, dict]:
                async with http.get(url + "/v1/models") as r:
                    return r.status, await r.json()

            # concurrent requests: the gateway's pool opens a connection for each
            assert [s for s, _ in await asyncio.gather(*[models() for _ in range(20)])] == [200] * 20
            server.stop()
            server.start()
            await asyncio.sleep(0.6)  # the gateway's worker list (cached 0.5 s) is read from Redis again
            answers = await asyncio.gather(*[models() for _ in range(20)])
            assert [s for s, _ in answers] == [200] * 20, answers
            # the data came back: the worker is still known
            assert all(body["data"][0]["max_model_len"] == 200 for _, body in answers)
    finally:
        await runner.cleanup()
        await g.redis.aclose()
        server.stop()


# ----------------------------------------------------------------------------- clients that never read


def _never_reading_client(url: str, body: dict) -> socket.socket:
    """A raw HTTP client that sends a request and then never reads (a small receive buffer fills fast)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


async def _slow_reader_stack(redis_server, text_model, *flags):
    runner, url = await start_gateway(redis_server, text_model, "--max-body-bytes", "8MiB",
                                      "--max-queued-prompt-tokens", "100000000", *flags)
    g = SimpleNamespace(url=url, redis=aioredis.Redis.from_url(redis_server), keys=Keys("t"),
                        tok=Tokenizer(str(text_model)))
    await add_worker(g, max_model_len=10_000_000, num_blocks=20_000)
    # each of the n choices opens with the echoed prompt: megabytes, more than any socket buffer holds
    longest = max(range(g.tok.vocab_size), key=lambda t: len(g.tok.decode([t])))
    echo = {"model": MODEL, "prompt": [longest] * 100_000, "echo": True, "n": P.MAX_N, "stream": True,
            "max_tokens": 1}
    assert len(g.tok.decode(echo["prompt"])) * P.MAX_N > 5_000_000
    return runner, g, echo


async def _cancelled_within(reader: RequestsReader, seq_ids: set[str], timeout: float) -> float:
    start = time.monotonic()
    while seq_ids:
        msg = await reader.next(timeout=max(0.1, timeout - (time.monotonic() - start)))
        if isinstance(msg, CancelRequest):
            seq_ids.discard(msg.request_id)
    return time.monotonic() - start


async def test_clients_that_never_read_are_dropped_within_the_write_deadline(redis_server, text_model):
    """Three streams that never read fill --max-waiting-requests 3: each is dropped when a write waits past
    --client-write-timeout, its request cancelled at once, and a normal client is served (not 429)."""
    runner, g, echo = await _slow_reader_stack(redis_server, text_model, "--max-waiting-requests", "3",
                                               "--client-write-timeout", "1", "--resume-grace", "30")
    reader = RequestsReader(g)
    slow = []
    try:
        for _ in range(3):
            slow.append(await asyncio.to_thread(_never_reading_client, g.url, echo))
        subs = {(await reader.next(timeout=30)).request_id for _ in range(3 * P.MAX_N)}
        # each echo is written at once and blocks: cancelled within the deadline (plus this busy machine's slack)
        assert await _cancelled_within(reader, subs, timeout=10.0) < 10.0
        async with aiohttp.ClientSession() as http:
            async with http.post(g.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 5}) as r:
                assert r.status == 200
                sub = await reader.next()
                await play_text(g, sub.request_id, "Hello there")
                text = "".join(d["choices"][0]["text"] for d in (await read_sse(r))[1])
        assert text == "Hello there"
    finally:
        for s in slow:
            s.close()
        await runner.cleanup()
        await g.redis.aclose()


async def test_a_stream_whose_events_pile_up_past_the_cap_is_dropped(redis_server, text_model):
    """The write deadline is long here; what ends the stream is its events waiting beyond
    --stream-buffer-events while the client does not read."""
    runner, g, echo = await _slow_reader_stack(redis_server, text_model, "--client-write-timeout", "600",
                                               "--stream-buffer-events", "16", "--resume-grace", "30")
    reader = RequestsReader(g)
    client = None
    try:
        client = await asyncio.to_thread(_never_reading_client, g.url, {**echo, "max_tokens": 100})
        subs = {(await reader.next(timeout=30)).request_id for _ in range(P.MAX_N)}
        token = g.tok.encode("a", add_special_tokens=False)[0]
        for off in range(40):
            await publish(g, TokenEvent(min(subs), off, [token]))
            await asyncio.sleep(0.01)
        assert await _cancelled_within(reader, subs, timeout=10.0) < 10.0
    finally:
        if client is not None:
            client.close()
        await runner.cleanup()
        await g.redis.aclose()
