"""Async load generator for any OpenAI-compatible server: streaming requests over one aiohttp session.

Fixed concurrency (a semaphore, as `vllm bench serve --max-concurrency`) and/or Poisson arrivals
(`--request-rate`, gamma with `burstiness`; 1.0 is Poisson). The interference workload adds one long
prompt every K seconds while the short streams run. Timing follows vLLM's request functions exactly
(see stack/benchmark/metrics.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import structlog

from phaseserve.stack.benchmark.metrics import RequestResult
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.stack.benchmark.workloads import RequestSpec, Vocab

log = structlog.get_logger("phaseserve.stack.benchmark.loadgen")


class PromptFormatError(RuntimeError):
    pass


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    temperature: float = 0.0  # greedy, as the benchmark asks
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    @property
    def v1(self) -> str:
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


class OpenAIStreamClient:
    """Sends RequestSpecs as streaming OpenAI requests and measures them; one shared HTTP session."""

    def __init__(self, cfg: ClientConfig, session: aiohttp.ClientSession):
        self.cfg = cfg
        self.session = session
        self.token_id_prompts = True  # switched off by probe() when the server wants text
        self.vocab: Vocab | None = None

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def _payload(self, spec: RequestSpec) -> tuple[str, dict]:
        body = {"model": self.cfg.model, "max_tokens": spec.output_len, "temperature": self.cfg.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.cfg.extra_body)
        if spec.api == "chat":
            body["messages"] = spec.prompt
            return f"{self.cfg.v1}/chat/completions", body
        prompt = spec.prompt
        if isinstance(prompt, list) and not self.token_id_prompts:
            if self.vocab is None or self.vocab.tokenizer is None:
                raise PromptFormatError("the server takes no token-id prompts, and text prompts need a "
                                        "tokenizer: pass --tokenizer DIR")
            prompt = self.vocab.decode(prompt)
        body["prompt"] = prompt
        return f"{self.cfg.v1}/completions", body

    async def probe(self, spec: RequestSpec, prompt_format: str = "auto") -> RequestResult:
        """The test request vLLM also sends first; with "auto" it tells whether token-id prompts work."""
        if prompt_format not in ("auto", "ids", "text"):
            raise ValueError(f"prompt format must be auto, ids or text, not {prompt_format!r}")
        self.token_id_prompts = prompt_format != "text"
        result = await self.send(spec)
        if not result.success and prompt_format == "auto" and spec.api == "completions":
            log.info("token-id prompt refused; retrying as text", error=result.error[:200])
            self.token_id_prompts = False
            result = await self.send(spec)
        if not result.success:
            raise PromptFormatError(f"the test request failed: {result.error[:500]}")
        return result

    async def send(self, spec: RequestSpec) -> RequestResult:
        url, body = self._payload(spec)
        out = RequestResult(group=spec.group, prompt_len=spec.prompt_len)
        chunks = 0
        text_parts: list[str] = []
        st = time.perf_counter()
        out.start_time = st
        last = st
        try:
            async with self.session.post(url, json=body, headers=self._headers()) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                    return out
                out.request_id = resp.headers.get("X-Request-Id", "")
                async for _event_id, msg in sse_messages(resp):
                    if msg is None:  # [DONE]
                        continue
                    if "error" in msg and not msg.get("choices"):
                        raise RuntimeError(f"server error in stream: {msg['error']}")
                    now = time.perf_counter()
                    choices = msg.get("choices")
                    if choices and chunks == 0 and _is_role_preamble(choices[0]):
                        choices = None  # not a token: see _is_role_preamble
                    if choices:
                        if chunks == 0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        chunks += 1
                        c = choices[0]
                        text_parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                    if usage := msg.get("usage"):
                        out.output_tokens = usage.get("completion_tokens") or 0
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = usage["prompt_tokens"]
                        if (details := usage.get("prompt_tokens_details")) is not None:
                            out.cached_tokens = details.get("cached_tokens")
            if chunks == 0:
                out.error = "no chunk with choices was streamed"
                return out
            if not out.output_tokens:
                out.output_tokens = chunks  # no usage from this server: one chunk per token
            out.latency = last - st
            out.generated_text = "".join(text_parts)
            out.success = True
        except Exception as exc:  # a failed request is a result, not a crash of the benchmark
            out.error = f"{type(exc).__name__}: {exc}"
        return out


def _is_role_preamble(choice: dict) -> bool:
    """The opening chat chunk `{"role": "assistant", "content": ""}` that carries no token.

    OpenAI-style servers (phaseserve among them) send it as soon as the request is accepted; vLLM
    sends it together with the first token. vLLM's client would take it as the first token, which
    would make TTFT meaningless for the former; skipping it changes nothing for vLLM."""
    delta = choice.get("delta")
    return (delta is not None and "role" in delta and not delta.get("content")
            and not choice.get("finish_reason") and not choice.get("logprobs"))


def arrival_delays(n: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Gaps before each request: 0 for rate=inf, else gamma(shape=burstiness, mean=1/rate) (Poisson at 1)."""
    if request_rate == float("inf"):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    theta = 1.0 / (request_rate * burstiness)
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=n)


async def run_load(send, specs: list[RequestSpec], concurrency: int | None, request_rate: float,
                   burstiness: float = 1.0, seed: int = 0, pbar=None,
                   background=None) -> tuple[list[RequestResult], float]:
    """Send `specs` through `send` (an async RequestSpec -> RequestResult); return results and wall time.

    `background(stop_event)`, when given, runs beside the load (the interference injector) and
    returns its own results; it is told to stop once the main requests are done.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(spec: RequestSpec) -> RequestResult:
        if sem is None:
            r = await send(spec)
        else:
            async with sem:
                r = await send(spec)
        if pbar is not None:
            pbar.update(1)
        return r

    stop = asyncio.Event()
    start = time.perf_counter()
    bg_task = asyncio.create_task(background(stop)) if background else None
    tasks = []
    for spec, delay in zip(specs, arrival_delays(len(specs), request_rate, burstiness, seed)):
        if delay > 0:
            await asyncio.sleep(float(delay))
        tasks.append(asyncio.create_task(one(spec)))
    results = list(await asyncio.gather(*tasks))
    stop.set()
    if bg_task is not None:
        results += await bg_task
    return results, time.perf_counter() - start


def interference_injector(send, make_spec, every_s: float, max_inflight: int = 4):
    """A background(stop) coroutine that sends make_spec(i) every `every_s` seconds until stopped.

    Each long prompt is new (a server's prefix cache must not turn it into a cheap repeat). A tick
    that finds `max_inflight` long prompts still unanswered sends none, so a slow server is not
    buried under a growing pile of them; the skipped ticks are counted in `skipped`."""
    if every_s <= 0:
        raise ValueError("--long-every must be > 0 seconds")
    if max_inflight < 1:
        raise ValueError("--long-max-inflight must be >= 1")

    async def background(stop: asyncio.Event) -> list[RequestResult]:
        tasks: list[asyncio.Task] = []
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
                break  # the short streams are done
            except asyncio.TimeoutError:
                if sum(not t.done() for t in tasks) >= max_inflight:
                    background.skipped += 1
                    continue
                tasks.append(asyncio.create_task(send(make_spec(len(tasks)))))
        return list(await asyncio.gather(*tasks))

    background.skipped = 0
    return background
