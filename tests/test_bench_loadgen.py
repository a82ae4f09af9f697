"""The load generator against a real HTTP server whose timing is known.

The server here streams OpenAI-style SSE with fixed delays (first chunk after FIRST_S, then one chunk
every GAP_S), so the measured TTFT/ITL/TPOT can be checked against what it did. It records what it
received, so the request bodies (token-id prompts, ignore_eos, max_tokens, usage) and the concurrency
cap can be checked too.
"""

import asyncio
import json
import threading

import pytest
from aiohttp import web

from phaseserve.stack.benchmark.cli import main as bench_main
from model_factory import write_tokenizer

FIRST_S = 0.06
GAP_S = 0.02
VOCAB = 320


class SSEServer:
    def __init__(self, accept_token_ids=True, send_usage=True):
        self.accept_token_ids = accept_token_ids
        self.send_usage = send_usage
        self.bodies: list[tuple[str, dict]] = []
        self.inflight = 0
        self.max_inflight = 0
        self.inflight_by_kind = {"chat": 0, "completions": 0}
        self.max_by_kind = {"chat": 0, "completions": 0}
        self.loop = asyncio.new_event_loop()
        self.port = None

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "sse-model", "object": "model"}]})

    async def stream(self, request):
        body = await request.json()
        kind = "chat" if request.path.endswith("chat/completions") else "completions"
        self.bodies.append((kind, body))
        if kind == "completions" and isinstance(body["prompt"], list) and not self.accept_token_ids:
            return web.json_response({"error": {"message": "prompt must be a string"}}, status=400)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        self.inflight_by_kind[kind] += 1
        self.max_by_kind[kind] = max(self.max_by_kind[kind], self.inflight_by_kind[kind])
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = body["max_tokens"]
            if kind == "chat":  # the role chunk OpenAI-style servers send at once: no token, no TTFT
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                await resp.write(f"data: {json.dumps({'choices': [role]})}\n\n".encode())
            for i in range(n):
                await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
                choice = {"index": 0, "delta": {"content": f"t{i}"}} if kind == "chat" else {"index": 0, "text": f"t{i}"}
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if self.send_usage and body.get("stream_options", {}).get("include_usage"):
                plen = len(body["prompt"]) if kind == "completions" and isinstance(body["prompt"], list) else 7
                usage = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.inflight -= 1
            self.inflight_by_kind[kind] -= 1

    def __enter__(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.stream)
        app.router.add_post("/v1/chat/completions", self.stream)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB)
    (d / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return d


def run(argv, capsys):
    code = bench_main(argv + ["--no-progress"])
    return code, capsys.readouterr().out


def test_random_workload_measures_what_the_server_did(tok_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    with SSEServer() as srv:
        code, text = run(["--base-url", srv.url, "--model", str(tok_dir), "--workload", "random",
                          "--num-prompts", "8", "--input-len", "12", "--output-len", "5", "--concurrency", "2",
                          "--goodput", "ttft:10000", "tpot:1", "--json-out", str(out_json), "--plot", str(out_png)],
                         capsys)
    assert code == 0, text
    r = json.loads(out_json.read_text())
    m = r["metrics"]
    assert r["served_model"] == "sse-model" and r["token_id_prompts"] is True
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == 40 and m["total_input_tokens"] == 8 * 12
    assert m["p50_ttft_ms"] >= FIRST_S * 1000
    assert GAP_S * 1000 * 0.75 <= m["mean_itl_ms"] <= GAP_S * 1000 * 3
    assert m["mean_tpot_ms"] == pytest.approx(m["mean_itl_ms"], rel=0.2)  # one chunk per token here
    assert m["request_goodput"] == 0.0  # nobody meets a 1 ms TPOT
    assert all(len(q["itl"]) == 4 for q in r["requests"])
    # what went over the wire: 8 requests + the test request, token ids, exact lengths
    bodies = [b for k, b in srv.bodies if k == "completions"]
    assert len(bodies) == 9
    for b in bodies:
        assert b["ignore_eos"] is True and b["stream"] is True and b["temperature"] == 0.0
        assert b["stream_options"] == {"include_usage": True} and b["model"] == "sse-model"
        assert len(b["prompt"]) == 12 and all(3 <= t < VOCAB for t in b["prompt"])  # ids 0-2 are special
    assert len({tuple(b["prompt"]) for b in bodies[1:]}) == 8  # distinct random prompts
    assert srv.max_inflight == 2  # the concurrency cap held, and was used
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Output token throughput" in text


def test_text_prompts_and_counted_tokens_when_the_server_wants_them(tok_dir, tmp_path, capsys):
    with SSEServer(accept_token_ids=False, send_usage=False) as srv:
        code, text = run(["--base-url", srv.url, "--model", str(tok_dir), "--num-prompts", "3",
                          "--input-len", "6", "--output-len", "4", "--json-out", str(tmp_path / "t.json")], capsys)
    assert code == 0, text
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["token_id_prompts"] is False
    assert r["metrics"]["total_output_tokens"] == 12  # no usage: one token per streamed chunk
    text_prompts = [b["prompt"] for k, b in srv.bodies if isinstance(b["prompt"], str)]
    assert len(text_prompts) == 4 and all(text_prompts)


def test_interference_reports_short_streams_and_long_prompts_apart(tok_dir, tmp_path, capsys):
    with SSEServer() as srv:
        code, text = run(["--base-url", srv.url, "--model", str(tok_dir), "--workload", "interference",
                          "--num-prompts", "6", "--output-len", "10", "--concurrency", "2", "--long-len", "200",
                          "--long-output-len", "2", "--long-every", "0.03", "--long-max-inflight", "1",
                          "--json-out", str(tmp_path / "i.json")], capsys)
    assert code == 0, text
    r = json.loads((tmp_path / "i.json").read_text())
    assert r["groups"]["short"]["completed"] == 6 == r["metrics"]["completed"]
    # ~0.7 s of short streams; a long prompt takes ~0.08 s, so with one allowed in flight most ticks skip
    assert r["groups"]["long"]["completed"] >= 2 and r["long_prompts_skipped"] >= 2
    assert srv.max_by_kind["completions"] == 1
    # the role chunk came at once, yet TTFT is the first token's: after FIRST_S
    assert r["metrics"]["p50_ttft_ms"] >= FIRST_S * 1000
    assert r["metrics"]["total_output_tokens"] == 60 and all(len(q["itl"]) == 9 for q in r["requests"]
                                                            if q["group"] == "short")
    longs = [b["prompt"] for k, b in srv.bodies if k == "completions"]
    assert all(len(p) == 200 for p in longs) and len({tuple(p) for p in longs}) == len(longs)  # all new
    chats = [b for k, b in srv.bodies if k == "chat"]
    assert len(chats) == 6 + 1 and all(b["messages"][0]["role"] == "user" for b in chats)
    assert "short streams" in text and "long prompts" in text


def test_bad_arguments_are_clear_errors(tok_dir, capsys):
    assert bench_main(["--model", str(tok_dir), "--goodput", "itl:5"]) == 2
    assert "--goodput" in capsys.readouterr().err
    assert bench_main(["--model", str(tok_dir), "--input-len", "0"]) == 2
    assert "--input-len must be >= 1" in capsys.readouterr().err
    assert bench_main(["--model", "/nonexistent/model"]) == 2  # no tokenizer, no --vocab-size
