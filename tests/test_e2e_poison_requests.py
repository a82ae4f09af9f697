"""A client with a valid key cannot take the stack down from the gateway (issue 32, the gateway's half), on a
whole stack over sockets with two API keys: an attacker's and a victim's.

- Grammars the engine chokes on (a Lark rule of 2,500 alternatives, `a{1000000000}`, choices past the budget,
  100,000 of them) are 400s naming their field, without a panic's text, while the victim's stream shows no
  gap over 1 s and its own constrained request is proved at once; a 2,001-option choice (once a 500) works.
- A ~1 MB `tools` list is a quick 400, and `/version` answers all along.
- A schema cannot set the engine's options (`x-guidance`).
- Connections that trickle their headers or their body are closed within the timeouts.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from e2e_stack import running_stack
from phaseserve.gateway.limits import MAX_TOOLS
from phaseserve import settings
from phaseserve.models.tokenizer import Tokenizer

ATTACKER, VICTIM = "sk-attacker", "sk-victim"
TIMEOUT_S = 2.0  # the stack's --keepalive-timeout and --body-timeout: slow clients are cut after it
MAX_GAP_S = 1.0
HELLO = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """This module's stack (conftest's has no keys and the default timeouts)."""
    with running_stack(settings.bundled_model_path(), tmp_path_factory.mktemp("poison-logs"),
                       api_key=f"{ATTACKER},{VICTIM}", keepalive_timeout=TIMEOUT_S,
                       body_timeout=TIMEOUT_S) as running:
        yield running


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api_url, api_key=key, max_retries=0, timeout=120)


@contextlib.contextmanager
def victim_stream(stack):
    """The victim's stream runs throughout; yields a function giving its longest gap between chunks so far
    (after its first token)."""
    arrivals: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def run():
        with _client(stack, VICTIM) as client:
            stream = client.chat.completions.create(model=stack.model, messages=HELLO, max_tokens=1800,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                arrivals.append(time.monotonic())
                started.set()
                if stop.is_set():
                    break
            stream.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the victim's stream never started"

    def longest_gap() -> float:
        times = list(arrivals)
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    try:
        yield longest_gap
        assert thread.is_alive() or len(arrivals) > 100, "the victim's stream ended early"
    finally:
        stop.set()
        thread.join(60)


def _refused(stack, key: str, **fields) -> dict:
    """The error body of a chat request that must be a 400."""
    with _client(stack, key) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=stack.model, messages=HELLO, max_tokens=5, **fields)
    return e.value.body


POISON = [  # (what, request fields, the param named, a word of the message)
    ("a Lark rule of 2,500 alternatives (too wide a row once 'w' is sampled)",
     {"extra_body": {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(2500))}},
     "guided_grammar", "row"),
    ("a regex the lexer cannot expand", {"extra_body": {"guided_regex": "a{1000000000}"}}, "guided_regex", "lexer"),
    ("100,000 choices", {"extra_body": {"guided_choice": [f"o{i}" for i in range(100_000)]}}, "guided_choice",
     "options"),
    ("70,000 choices", {"extra_body": {"guided_choice": [f"{i}" for i in range(70_000)]}}, "guided_choice",
     "options"),
    ("choices over the byte budget", {"extra_body": {"structured_outputs": {"choice": ["x" * 70_000]}}},
     "structured_outputs", "bytes"),
]


def test_poison_grammars_are_400s_while_another_keys_stream_and_grammar_go_on(stack):
    with victim_stream(stack) as longest_gap, ThreadPoolExecutor(len(POISON)) as pool:
        attacks = [pool.submit(_refused, stack, ATTACKER, **fields) for _, fields, _, _ in POISON]
        time.sleep(1.0)  # the attacker's grammars are in the checker now
        t = time.monotonic()
        with _client(stack, VICTIM) as client:  # the victim's own grammar is proved beside them
            r = client.chat.completions.create(model=stack.model, messages=HELLO, max_tokens=8, temperature=0,
                                               response_format={"type": "json_object"})
        victim_wait = time.monotonic() - t
        assert r.choices[0].message.content.startswith("{")
        errors = [a.result(timeout=120) for a in attacks]
        gap = longest_gap()
    for (what, _, param, word), body in zip(POISON, errors):
        assert body["type"] == "invalid_request_error" and body["param"] == param, (what, body)
        message = body["message"]
        assert word in message, (what, message)
        assert not any(s in message for s in ("panic", "backtrace", "<unknown>", "<state>")), (what, message)
    assert victim_wait < 4.0, f"the victim's json_object request waited {victim_wait:.1f} s behind the attacker's"
    assert gap <= MAX_GAP_S, f"the victim's stream stalled {gap:.2f} s"
    # a choice wider than the engine's row limit, which was a 500 at its second token, is one terminal now
    options = [f"option number {i}" for i in range(2001)]
    with _client(stack, ATTACKER) as client:
        r = client.chat.completions.create(model=stack.model, messages=HELLO, max_tokens=20, temperature=1.0,
                                           n=4, seed=1, extra_body={"guided_choice": options})
    assert all(c.message.content in options for c in r.choices), [c.message.content for c in r.choices]
    assert "worker lost" not in stack.logs()


def test_a_grammar_failing_past_the_proof_is_that_requests_400_or_error_event(stack):
    """The proof walks one path; the engine refusing a later token (here: the sampled 'z', forced by
    logit_bias, opens a rule of 2,500 alternatives) fails that request as bad input, never as a 500."""
    late = 'start: "a" | "z" w\nw: ' + " | ".join(f'"w{i}"' for i in range(2500))
    z = Tokenizer(settings.bundled_model_path()).encode("z", add_special_tokens=False)[0]
    fields = {"guided_grammar": late, "logit_bias": {str(z): 100}}
    body = _refused(stack, ATTACKER, extra_body=fields)
    assert body["param"] == "guided_grammar" and "failed while generating" in body["message"], body
    request = urllib.request.Request(stack.api_url + "/chat/completions", method="POST", headers={
        "Authorization": f"Bearer {ATTACKER}", "Content-Type": "application/json"}, data=json.dumps(
        {"model": stack.model, "messages": HELLO, "max_tokens": 5, "stream": True, **fields}).encode())
    events = urllib.request.urlopen(request, timeout=60).read().decode().split("\n\n")
    error = next(json.loads(e[6:])["error"] for e in events if e.startswith("data: {\"error\""))
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_grammar", error
    assert "worker lost" not in stack.logs()


def _post(stack, key: str, body: dict) -> tuple[int, dict]:
    """(status, the error of) a chat request sent as plain bytes."""
    request = urllib.request.Request(stack.api_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def _version_latencies(stack, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        urllib.request.urlopen(stack.base_url + "/version", timeout=30).read()
        out.append(time.monotonic() - t)
        time.sleep(0.05)


def test_a_huge_tools_list_is_a_quick_400_and_the_gateway_answers_meanwhile(stack):
    # ~1 MB of distinct tools, under --max-body-bytes: its checks were quadratic, on the event loop
    # (sent as bytes: the openai client's own handling of such a list takes seconds before it sends)
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(19_000)]
    assert len(json.dumps(tools)) < 1 << 20
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_version_latencies, args=(stack, stop, latencies))
    poller.start()
    try:
        time.sleep(0.3)
        t = time.monotonic()
        status, body = _post(stack, ATTACKER, {"model": stack.model, "messages": HELLO, "tools": tools})
        took = time.monotonic() - t
        time.sleep(0.3)
    finally:
        stop.set()
        poller.join(30)
    assert took < 3.0, f"the 400 took {took:.1f} s"
    assert latencies and max(latencies) < 1.5, f"/version took up to {max(latencies):.2f} s meanwhile"
    assert status == 400 and body["param"] == "tools" and str(MAX_TOOLS) in body["message"], body


def test_a_schema_cannot_set_the_engines_options(stack):
    flexible = {"type": "object", "x-guidance": {"whitespace_flexible": True, "lenient": True}}
    body = _refused(stack, ATTACKER, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": flexible}})
    assert body["param"] == "response_format" and "x-guidance" in body["message"], body
    body = _refused(stack, ATTACKER, extra_body={"guided_json": flexible})
    assert body["param"] == "guided_json"
    tool = {"type": "function", "function": {"name": "f", "parameters": flexible}}
    body = _refused(stack, ATTACKER, tools=[tool], tool_choice="required")
    assert body["param"] == "tools" and "x-guidance" in body["message"], body


def _trickle(first: bytes, piece: bytes, count: int, port: int,
             seconds: float) -> tuple[list[float | None], list[bytes]]:
    """`count` connections each send `first`, then `piece` every half second, for at most `seconds`: when each
    was closed by the server (None: still open), and what it answered."""
    selector = selectors.DefaultSelector()
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(first)
        s.setblocking(False)
        selector.register(s, selectors.EVENT_READ, len(socks))
        socks.append(s)
    start = time.monotonic()
    closed: list[float | None] = [None] * count
    answers = [b""] * count
    next_piece = start + 0.5
    try:
        while any(c is None for c in closed) and time.monotonic() - start < seconds:
            for key, _ in selector.select(timeout=0.1):
                i = key.data
                try:
                    data = socks[i].recv(65536)
                except (ConnectionError, BlockingIOError):
                    data = b""
                answers[i] += data
                if not data:
                    closed[i] = time.monotonic() - start
                    selector.unregister(socks[i])
            if time.monotonic() >= next_piece:
                next_piece += 0.5
                for i, s in enumerate(socks):
                    if closed[i] is None:
                        with contextlib.suppress(OSError):
                            s.send(piece)
    finally:
        selector.close()
        for s in socks:
            s.close()
    return closed, answers


def test_slow_clients_are_disconnected_within_the_timeouts(stack):
    port = int(stack.base_url.rsplit(":", 1)[1])
    bound = TIMEOUT_S + 4.0  # the timeout, and a loaded machine's margin
    with ThreadPoolExecutor(2) as pool:
        headers = pool.submit(_trickle, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n",
                              400, port, bound + 4)
        body = pool.submit(_trickle, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                      f"{VICTIM}\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                                      ).encode(), b" ", 100, port, bound + 4)
        closed_h, _ = headers.result()
        closed_b, answers_b = body.result()
    latest = max((c for c in closed_h if c is not None), default=0.0)
    assert all(c is not None and c <= bound for c in closed_h), \
        f"{sum(c is None for c in closed_h)} header tricklers still open; the latest closed at {latest:.1f} s"
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers_b), answers_b[0][:300]
    assert all(c is not None and c <= bound for c in closed_b), \
        f"{sum(c is None for c in closed_b)} body tricklers still open"
    assert urllib.request.urlopen(stack.base_url + "/version", timeout=10).status == 200
