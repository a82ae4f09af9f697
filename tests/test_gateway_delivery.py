"""Delivery that cannot lose tokens, and SSE resume, over real sockets against a real Redis; the
test plays the worker and its relay: it writes each event to the token log (phaseserve/token_log.py, as the
relay does) and publishes it, or deliberately does not publish it (a message pub/sub lost)."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import msgpack
import openai
import pytest
import redis
import redis.asyncio as aioredis
import sseclient

from phaseserve import token_log
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import CancelRequest, GatewayInfo, Keys, SequenceProgress, SubmitRequest, TokenBatch, TokenEvent
from gateway_client import RESUME, post_resume, read_sse
from test_gateway_http import MODEL, RequestsReader, add_worker, assert_openai_error, start_gateway, text_model  # noqa: F401

REPLY = "The quick brown fox jumps"


class Gw:
    def __init__(self, url, gateway_id, redis_url, model_dir, http):
        self.url, self.gateway_id, self.http = url, gateway_id, http
        self.redis = aioredis.Redis.from_url(redis_url)
        self.keys = Keys("t")
        self.tok = Tokenizer(str(model_dir))


@pytest.fixture
async def make_gw(redis_server, text_model):
    made = []

    async def make(gateway_id: str = "gw-a", *flags: str) -> Gw:
        runner, url = await start_gateway(redis_server, text_model, "--gateway-id", gateway_id,
                                          "--max-waiting-requests", "8", *flags)
        g = Gw(url, gateway_id, redis_server, text_model, aiohttp.ClientSession())
        made.append((runner, g))
        return g

    yield make
    for runner, g in made:
        await g.http.close()
        await runner.cleanup()
        await g.redis.aclose()


async def emit(g: Gw, ev: TokenEvent, publish: bool = True) -> None:
    """What the relay does for one event: the token log first, then (unless 'lost') the pub/sub message."""
    async with g.redis.pipeline(transaction=False) as pipe:
        token_log.append_event(pipe, g.keys, ev.to_list())
        if publish:
            pipe.publish(g.keys.gateway_channel(g.gateway_id), TokenBatch(0, "w1", [ev]).to_wire())
        await pipe.execute()




def texts(data: list[dict]) -> str:
    return "".join(d["choices"][0]["text"] for d in data if d.get("choices"))


async def test_token_log_refuses_a_second_entry_for_an_offset_and_nothing_after_an_abort(redis_server):
    r, keys = redis.Redis.from_url(redis_server), Keys("t")
    pipe = r.pipeline(transaction=False)
    for ev in (TokenEvent("s", 0, [1, 2]), TokenEvent("s", 2, [3]), TokenEvent("s", 0, [1, 2]),
               TokenEvent("s", 1, [2])):  # the last two: a replayed step after a worker died
        token_log.append_event(pipe, keys, ev.to_list())
    results = pipe.execute(raise_on_error=False)
    token_log.raise_unexpected(results)  # refused duplicates are not errors
    assert sum(token_log.is_duplicate(x) for x in results) == 2
    entries = r.xrange(keys.token_log("s"))
    assert [e[0] for e in entries] == [b"2-0", b"3-0"]
    assert [token_log.decode_entry(f).token_ids for _, f in entries] == [[1, 2], [3]]
    assert 0 < r.ttl(keys.token_log("s")) <= 300
    # "everything from offset 2": XREAD from read_from(2)
    got = r.xread({keys.token_log("s"): token_log.read_from(2)})
    assert [token_log.decode_entry(f).offset for _, f in got[0][1]] == [2]
    pipe = r.pipeline(transaction=False)
    token_log.append_abort(pipe, keys, "s", 3)
    token_log.append_event(pipe, keys, TokenEvent("s", 3, [4]).to_list())  # a worker late after the cancel
    results = pipe.execute(raise_on_error=False)
    assert token_log.is_duplicate(results[-1])
    last = token_log.decode_entry(r.xrange(keys.token_log("s"))[-1][1])
    assert last.finish_reason == "abort" and last.token_ids == []
    # the relay's way: a whole step's TokenBatch in one script call, duplicates refused inside it
    pipe = r.pipeline(transaction=False)
    token_log.append_batch(pipe, keys, TokenBatch(7, "w1", [TokenEvent("u", 0, [9]), TokenEvent("v", 0, [8]),
                                                           TokenEvent("u", 1, [10], "stop")]).to_wire())
    token_log.append_batch(pipe, keys, TokenBatch(7, "w1", [TokenEvent("u", 1, [10], "stop")]).to_wire())
    token_log.raise_unexpected(pipe.execute(raise_on_error=False))
    assert [token_log.decode_entry(f).token_ids for _, f in r.xrange(keys.token_log("u"))] == [[9], [10]]
    assert r.xrange(keys.token_log("u"))[-1][0] == b"2-0" and r.xlen(keys.token_log("v")) == 1
    assert 0 < r.ttl(keys.token_log("u")) <= 300
    # what a recovering scheduler reads back as the confirmed output (up to the abort), and that both ended
    assert token_log.replay(r.xrange(keys.token_log("s"))) == ([1, 2, 3], True)
    assert token_log.replay(r.xrange(keys.token_log("u"))) == ([9, 10], True)
    with pytest.raises(redis.ResponseError):  # any other error is still raised
        token_log.raise_unexpected([redis.ResponseError("WRONGTYPE Operation against a key")])
    r.close()


async def test_a_gap_in_pubsub_is_filled_from_the_token_log(make_gw):
    g = await make_gw("gw-a", "--token-silence-timeout", "30")  # only the gap may trigger the fill
    await add_worker(g)
    reader = RequestsReader(g)
    ids = g.tok.encode(REPLY, add_special_tokens=False)
    resp = await g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                              "max_tokens": 50})
    sub = await reader.next()
    for off, t in enumerate(ids):
        last = off == len(ids) - 1
        # tokens 2 and 3 are lost on pub/sub; the next message shows the gap
        await emit(g, TokenEvent(sub.request_id, off, [t], "length" if last else None), publish=off not in (2, 3))
    _, data = await asyncio.wait_for(read_sse(resp), 10)
    assert texts(data) == REPLY and data[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_silent_channel_is_read_from_the_token_log(make_gw):
    g = await make_gw("gw-a", "--token-silence-timeout", "0.2")
    await add_worker(g)
    reader = RequestsReader(g)
    ids = g.tok.encode(REPLY, add_special_tokens=False)
    resp = await g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    sub = await reader.next()
    # nothing published at all (e.g. the gateway was resubscribing): the log alone carries the tokens
    await emit(g, TokenEvent(sub.request_id, 0, ids, "length"), publish=False)
    _, data = await asyncio.wait_for(read_sse(resp), 10)
    assert texts(data) == REPLY


async def test_a_stalled_request_gets_an_error_after_the_deadline_and_is_cancelled(make_gw):
    g = await make_gw("gw-a", "--request-progress-timeout", "0.5", "--token-silence-timeout", "0.1")
    await add_worker(g)
    reader = RequestsReader(g)
    resp = await g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    sub = await reader.next()
    await emit(g, TokenEvent(sub.request_id, 0, g.tok.encode("The", add_special_tokens=False)))
    _, data = await asyncio.wait_for(read_sse(resp), 10)  # then nothing: the worker hangs
    assert texts(data) == "The"
    assert_openai_error(data[-1], "server_error", None, "timeout")
    assert "no progress for 0.5 s" in data[-1]["error"]["message"]
    cancel = await reader.next()
    assert isinstance(cancel, CancelRequest) and cancel.request_id == sub.request_id
    # a whole (non-streaming) response: 504 in OpenAI's format
    async with g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert r.status == 504
        assert_openai_error(await r.json(), "server_error", None, "timeout")


async def test_the_schedulers_word_that_a_request_is_queued_or_prefilling_is_progress(make_gw):
    """No token for three times the progress timeout, but the scheduler vouches for the sequence all along
    (SequenceProgress: queued, or a long prefill): the request is not given up, and completes."""
    g = await make_gw("gw-a", "--request-progress-timeout", "0.5", "--token-silence-timeout", "0.1")
    await add_worker(g)
    reader = RequestsReader(g)
    resp = await g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                              "max_tokens": 50})
    sub = await reader.next()
    for _ in range(8):
        await g.redis.publish(g.keys.gateway_channel(g.gateway_id), SequenceProgress([sub.request_id]).to_wire())
        await asyncio.sleep(0.2)
    await emit(g, TokenEvent(sub.request_id, 0, g.tok.encode(REPLY, add_special_tokens=False), "length"))
    _, data = await asyncio.wait_for(read_sse(resp), 10)
    assert texts(data) == REPLY and data[-1]["choices"][0]["finish_reason"] == "length"


async def test_sse_resume_on_another_gateway_gets_exactly_the_rest_and_starts_nothing_new(make_gw):
    a = await make_gw("gw-a", "--resume-grace", "30")
    b = await make_gw("gw-b")
    await add_worker(a)
    reader = RequestsReader(a)
    ids = a.tok.encode(REPLY, add_special_tokens=False)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 50, "stream_options": {"include_usage": True}}
    first = await a.http.post(a.url + "/v1/completions", json=body, headers=RESUME)
    sub = await reader.next()
    rid = sub.request_id[:-2]
    token = first.headers["X-Resume-Token"]
    half = 6
    for off in range(half):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]]))
    got_ids, data = await asyncio.wait_for(read_sse(first, stop_after=half), 10)
    assert got_ids == [f"{rid}:{token}:{i + 1}" for i in range(half)]
    first.close()  # the client's connection breaks
    # the worker goes on meanwhile: the rest is published to gateway A's channel (and the log)
    for off in range(half, len(ids)):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]], "length" if off == len(ids) - 1 else None))
    async with await post_resume(b.http, b.url + "/v1/completions", body, got_ids[-1]) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == rid
        rest_ids, rest = await asyncio.wait_for(read_sse(r), 10)
    assert texts(data) + texts(rest) == REPLY  # exactly once: nothing repeated, nothing missing
    assert rest_ids[-1] == f"{rid}:{token}:{len(ids) + 1}"  # the finished choice: its offset + 1
    assert rest[-1]["usage"]["completion_tokens"] == len(ids)
    assert all(d["id"] == f"cmpl-{rid}" for d in data + rest)
    # no second generation, and gateway A's grace saw the lease taken by B: nothing cancelled
    assert await a.redis.xlen(a.keys.requests) == 1
    lease = await a.redis.get(a.keys.client_lease(sub.request_id))
    assert lease is None or lease.startswith(b"gw-b:")
    # the heartbeat a scheduler can watch
    info = GatewayInfo.from_wire(await a.redis.get(a.keys.gateway_heartbeat("gw-a")))
    assert info.gateway_id == "gw-a" and info.resume_grace == 30

    # resuming from the last id again: only the end (the finish was seen, so nothing but usage + DONE)
    async with b.http.post(b.url + "/v1/completions", json=body, headers={"Last-Event-ID": rest_ids[-1]}) as r:
        assert r.status == 200  # the finished serving on B released its leases: no 409
        _, again = await asyncio.wait_for(read_sse(r), 10)
    assert texts(again) == "" and again[-1]["usage"]["completion_tokens"] == len(ids)

    # bad ids: 400 (malformed) and 404 (unknown request)
    async with b.http.post(b.url + "/v1/completions", json=body, headers={"Last-Event-ID": "nope"}) as r:
        assert r.status == 400
    async with b.http.post(b.url + "/v1/completions", json=body, headers={"Last-Event-ID": "0" * 32 + f":{token}:3"}) as r:
        assert r.status == 404
        assert_openai_error(await r.json(), "invalid_request_error", None, "resume_not_found")


async def test_a_client_that_does_not_come_back_is_cancelled_after_the_grace(make_gw):
    a = await make_gw("gw-a", "--resume-grace", "0.3")
    await add_worker(a)
    reader = RequestsReader(a)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 50}
    first = await a.http.post(a.url + "/v1/completions", json=body, headers=RESUME)
    sub = await reader.next()
    await emit(a, TokenEvent(sub.request_id, 0, [5]))
    got_ids, _ = await asyncio.wait_for(read_sse(first, stop_after=1), 10)
    first.close()
    cancel = await reader.next()
    assert isinstance(cancel, CancelRequest) and cancel.request_id == sub.request_id
    # a later resume reads the end the cancel wrote to the log: an abort, not an endless wait
    async with a.http.post(a.url + "/v1/completions", json=body, headers={"Last-Event-ID": got_ids[-1]}) as r:
        _, rest = await asyncio.wait_for(read_sse(r), 10)
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert msgpack.unpackb(await a.redis.get(a.keys.gateway_heartbeat("gw-a")))["k"] == "gateway"
    assert isinstance(SubmitRequest, type)


def test_orphan_tracker_cancels_what_has_had_no_lease_for_the_grace():
    from phaseserve.scheduler.client_lease import OrphanTracker

    t = OrphanTracker(grace_s=10)
    assert t.update(["a", "b"], [False, True], now=100) == []
    assert t.update(["a", "b"], [False, True], now=109) == []
    assert t.update(["a", "b"], [True, False], now=111) == []  # a resumed in time; b's clock starts
    assert t.update(["a", "b"], [False, False], now=121.5) == ["b"]
    assert t.update(["a"], [False], now=132) == ["a"]  # b is gone from the running set: forgotten
    assert t.missing_since == {}


async def test_a_resume_on_the_same_gateway_keeps_the_request_when_the_old_connection_ends(make_gw):
    a = await make_gw("gw-a", "--resume-grace", "2.5", "--client-lease-ttl", "0.3")
    await add_worker(a)
    reader = RequestsReader(a)
    ids = a.tok.encode(REPLY, add_special_tokens=False)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 50}
    first = await a.http.post(a.url + "/v1/completions", json=body, headers=RESUME)
    sub = await reader.next()
    for off in range(3):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]]))
    got_ids, head = await asyncio.wait_for(read_sse(first, stop_after=3), 10)
    # the client reconnects before the gateway noticed the old connection is gone: that one keeps the stream
    async with a.http.post(a.url + "/v1/completions", json=body, headers={"Last-Event-ID": got_ids[-1]}) as r:
        assert r.status == 409 and r.headers["Retry-After"] == "1"
    first.close()
    second = await post_resume(a.http, a.url + "/v1/completions", body, got_ids[-1])  # once it has gone
    assert second.status == 200
    await asyncio.sleep(2.6)  # the old serving's grace (several lease TTLs) passes
    for off in range(3, len(ids)):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]], "length" if off == len(ids) - 1 else None))
    _, tail = await asyncio.wait_for(read_sse(second), 10)
    second.close()
    assert texts(head) + texts(tail) == REPLY
    assert await a.redis.xlen(a.keys.requests) == 1  # the submit only: no CancelRequest


async def test_a_chat_stream_with_two_choices_resumes_each_choice_where_it_was(make_gw):
    a = await make_gw("gw-a", "--resume-grace", "30")
    b = await make_gw("gw-b")
    await add_worker(a)
    reader = RequestsReader(a)
    replies = [REPLY, "Hello wörld 🙂 again"]
    toks = [a.tok.encode(t, add_special_tokens=False) for t in replies]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
            "max_tokens": 60}
    first = await a.http.post(a.url + "/v1/chat/completions", json=body, headers=RESUME)
    subs = [await reader.next(), await reader.next()]
    # choice 0 gets 5 tokens, choice 1 gets 2, interleaved
    for off in range(5):
        await emit(a, TokenEvent(subs[0].request_id, off, [toks[0][off]]))
        if off < 2:
            await emit(a, TokenEvent(subs[1].request_id, off, [toks[1][off]]))
    got_ids, head = await asyncio.wait_for(read_sse(first, stop_after=2 + 7), 10)  # 2 role chunks + 7
    first.close()
    for i in range(2):
        start = 5 if i == 0 else 2
        for off in range(start, len(toks[i])):
            await emit(a, TokenEvent(subs[i].request_id, off, [toks[i][off]],
                                     "stop" if off == len(toks[i]) - 1 else None))
    rid = subs[0].request_id[:-2]
    assert got_ids[-1] == f"{rid}:{first.headers['X-Resume-Token']}:5.2"
    async with await post_resume(b.http, b.url + "/v1/chat/completions", body, got_ids[-1]) as r:
        _, tail = await asyncio.wait_for(read_sse(r), 10)
    assert not any(c["choices"][0]["delta"].get("role") for c in tail)  # no second opening chunk

    def text(chunks, i):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c.get("choices") and c["choices"][0]["index"] == i)

    assert [text(head, i) + text(tail, i) for i in range(2)] == replies
    assert sorted(c["choices"][0]["finish_reason"] for c in tail if c["choices"][0]["finish_reason"]) == ["stop"] * 2


async def test_a_gateway_shutting_down_ends_its_open_requests_with_an_error(redis_server, text_model):
    """The gateway stops (SIGTERM, `up` stopping) while a stream and a whole response are open: the stream
    ends with an error event (503 service_unavailable) then [DONE], the whole response is a 503 in OpenAI's
    format, and both sequences are cancelled; neither connection is cut short."""
    runner, url = await start_gateway(redis_server, text_model, "--gateway-id", "gw-down")
    g = Gw(url, "gw-down", redis_server, text_model, aiohttp.ClientSession())
    try:
        await add_worker(g)
        reader = RequestsReader(g)
        resp = await g.http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                                  "max_tokens": 50})
        streamed = await reader.next()
        await emit(g, TokenEvent(streamed.request_id, 0, g.tok.encode("The", add_special_tokens=False)))
        whole = asyncio.create_task(g.http.post(g.url + "/v1/completions",
                                                json={"model": MODEL, "prompt": "y", "max_tokens": 50}))
        waiting = await reader.next()
        stopping = asyncio.create_task(runner.cleanup())
        body = (await asyncio.wait_for(resp.read(), 10)).decode()
        assert body.rstrip().endswith("data: [DONE]"), body
        error = json.loads([line for line in body.splitlines() if line.startswith("data: {")][-1][6:])
        assert_openai_error(error, "server_error", None, "service_unavailable")
        assert "shutting down" in error["error"]["message"]
        r = await asyncio.wait_for(whole, 10)
        assert r.status == 503
        assert_openai_error(await r.json(), "server_error", None, "service_unavailable")
        await asyncio.wait_for(stopping, 15)
        cancels = {(await reader.next()).request_id for _ in range(2)}
        assert cancels == {streamed.request_id, waiting.request_id}
    finally:
        await g.http.close()
        await g.redis.aclose()
# ----------------------------------------------------------------------------- who may resume, and the default wire


async def test_a_resume_needs_the_streams_secret_and_key_and_never_takes_a_connected_clients_stream(make_gw):
    a = await make_gw("gw-a", "--api-key", "victim-key,attacker-key", "--resume-grace", "30")
    await add_worker(a)
    reader = RequestsReader(a)
    ids = a.tok.encode(REPLY, add_special_tokens=False)
    victim_auth = {"Authorization": "Bearer victim-key"}
    body = {"model": MODEL, "prompt": "my secret plan", "stream": True, "max_tokens": 50}
    victim = await a.http.post(a.url + "/v1/completions", json=body, headers={**victim_auth, "X-Resume": "1"})
    sub = await reader.next()
    rid = sub.request_id[:-2]
    assert victim.headers["X-Request-Id"] == rid  # the request id is no secret
    for off in range(3):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]]))
    got_ids, head = await asyncio.wait_for(read_sse(victim, stop_after=3), 10)
    # another client, another key, another prompt: the request id alone, or with a made-up token, resumes nothing
    attacker = {"Authorization": "Bearer attacker-key"}
    other = {**body, "prompt": "anything"}
    token = victim.headers.get("X-Resume-Token", "")
    for guess in (f"{rid}:0", f"{rid}:{'0' * 32}:0", f"{rid}:{token[::-1]}:0"):
        async with a.http.post(a.url + "/v1/completions", json=other,
                               headers={**attacker, "Last-Event-ID": guess}) as r:
            assert r.status in (400, 404), (guess, r.status)
            assert_openai_error(await r.json(), "invalid_request_error", None,
                                None if r.status == 400 else "resume_not_found")
    assert got_ids[-1] == f"{rid}:{token}:3" and len(token) == 32 and token not in rid
    # the stream's own id is bound to the key that submitted it
    async with a.http.post(a.url + "/v1/completions", json=other,
                           headers={**attacker, "Last-Event-ID": got_ids[-1]}) as r:
        assert r.status == 404
    # and even its owner cannot take it from a client still connected: 409, the stream untouched
    async with a.http.post(a.url + "/v1/completions", json=body,
                           headers={**victim_auth, "Last-Event-ID": got_ids[-1]}) as r:
        assert r.status == 409 and int(r.headers["Retry-After"]) >= 1
        assert_openai_error(await r.json(), "invalid_request_error", None, "stream_in_use")
    for off in range(3, len(ids)):
        await emit(a, TokenEvent(sub.request_id, off, [ids[off]], "length" if off == len(ids) - 1 else None))
    _, tail = await asyncio.wait_for(read_sse(victim), 10)
    assert texts(head) + texts(tail) == REPLY
    assert await a.redis.xlen(a.keys.requests) == 1  # the submit only: nothing resumed, nothing cancelled


def vllm_bench_events(raw_chunks: list[bytes]) -> list[dict | None]:
    """The stream as `vllm bench serve` reads it (vllm/benchmarks/lib/endpoint_request_func.py): split at
    blank lines, skip `:` comments, take each message without its `data: ` prefix as JSON ([DONE]: None)."""
    buffer, out = "", []
    for chunk in raw_chunks:
        buffer += chunk.strip().decode() if chunk.strip() else ""
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            message = message.strip()
            if message and not message.startswith(":"):
                payload = message.removeprefix("data: ")
                out.append(None if payload == "[DONE]" else json.loads(payload))
    if buffer.strip():
        payload = buffer.strip().removeprefix("data: ")
        out.append(None if payload == "[DONE]" else json.loads(payload))
    return out


OPENAI_SSE = re.compile(rb"(data: \{[^\n]*\}\n\n)+data: \[DONE\]\n\n")


async def test_the_default_stream_is_openais_wire_byte_for_byte(make_gw):
    g = await make_gw("gw-a")
    await add_worker(g)
    reader = RequestsReader(g)
    ids = g.tok.encode(REPLY, add_special_tokens=False)

    async def answer():
        sub = await reader.next()
        for off, t in enumerate(ids):
            await emit(g, TokenEvent(sub.request_id, off, [t], "length" if off == len(ids) - 1 else None))

    for path, body in (("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = await g.http.post(g.url + path, json={"model": MODEL, "stream": True, "max_tokens": 50, **body})
        await answer()
        chunks = [c async for c in resp.content.iter_any()]
        raw = b"".join(chunks)
        assert OPENAI_SSE.fullmatch(raw), raw[:300]
        assert "X-Resume-Token" not in resp.headers
        # a spec-following SSE parser: every event a plain message with no id
        events = list(sseclient.SSEClient(iter(chunks)).events())
        assert {(e.id, e.event) for e in events} == {(None, "message")}
        assert events[-1].data == "[DONE]"
        parsed = [json.loads(e.data) for e in events[:-1]]
        # vLLM's benchmark client: every message is `data: <json>`
        assert vllm_bench_events(chunks) == parsed + [None]
        got = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "")
                      for c in parsed if c.get("choices"))
        assert got == REPLY

    # the official client, streaming, on both routes
    oai = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
    task = asyncio.create_task(answer())
    stream = await oai.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=50)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    await task
    task = asyncio.create_task(answer())
    stream = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               stream=True, max_tokens=50)
    chat = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await task
    await oai.close()
    assert text == chat == REPLY
