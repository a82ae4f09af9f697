"""POST /v1/completions and /v1/chat/completions: validate, tokenize, submit, stream back.

A request with n choices is n sequences `<request_id>-<i>` on the wire; with several prompts (completions) or
best_of, prompts x best_of (or n) of them, choice i * n + j being the j-th of prompt i. Whatever
way a handler ends -- all sequences finished, a stop string, the client gone
(write failure, or aiohttp cancelling the handler), an error -- every sequence
that the worker side has not finished gets a CancelRequest, so the scheduler
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

import structlog
from aiohttp import web

from gateway import protocol as P
from gateway.auth import CLIENT_KEY, caller
from gateway.best_of import best_of
from gateway.chat_output import ChatOutputReader, WholeOutput, read_whole
from gateway.backend import ERROR_SHUTDOWN, ERROR_TIMEOUT, RequestStream
from gateway.errors import (REQUEST_ID, APIError, bad_request, context_length_exceeded, gateway_timeout,
                            internal_error, quarantined, read_body, resume_not_found, stream_in_use,
                            too_many_requests, unavailable)
from gateway.slow_client import SlowClient, drop, write_within
from gateway.sse_ids import (RESUME_HEADER, RESUME_TOKEN_HEADER, event_id, parse_last_event_id, resume_token,
                             token_matches, wants_resume)
from gateway.output import Delta, SequenceOutput, chat_logprobs, completion_logprobs
from gateway.reasoning import ReasoningFormat
from gateway.state import GATEWAY, Gateway
from gateway.structured import requested_grammar
from gateway.tools import HermesParser, plan_tools
from phaseserve import grammar
from phaseserve.kv_admission import KVCapacity
from phaseserve.models.tokenizer import ChatTemplateError
from phaseserve.wire import (ERROR_GRAMMAR, ERROR_QUARANTINED, ERROR_REJECTED, GrammarSpec, LoraRef, SubmitRequest,
                             TokenEvent, WorkerInfo)

log = structlog.get_logger("gateway")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# SSE data lines: compact, UTF-8 as is; one encoder for every event (json.dumps with options builds one a call)
SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


async def check_request(gw: Gateway, req: P.CompletionRequest | P.ChatCompletionRequest) -> LoraRef | None:
    """What the request schema alone cannot check: the model's name (the LoRA adapter it names, or None for the
    base model; 404 for neither) and vocabulary."""
    lora = await gw.loras.resolve(req.model)
    req.check_token_ids(gw.tokenizer.vocab_size)
    return lora


@dataclass
class Prompt:
    """One prompt of a request: its token ids, and the text `echo` puts before each of its choices."""

    ids: list[int]
    echo_text: str = ""


async def _completion_prompt(gw: Gateway, prompt: str | list[int], echo: bool, max_len: int) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(await gw.prompts.encode(prompt, max_len), prompt if echo else "")
    out_of_vocab = [t for t in prompt if t >= gw.tokenizer.vocab_size]
    if out_of_vocab:
        raise bad_request(f"'prompt' has token ids outside the vocabulary (size {gw.tokenizer.vocab_size}): "
                          f"{out_of_vocab[:5]}", "prompt")
    return Prompt(list(prompt), gw.tokenizer.decode(prompt) if echo else "")


def client_of(request: web.Request) -> bytes | str | None:
    """Who sent the request, for the fair share of the grammar checks: its API key, else its address."""
    return request.get(CLIENT_KEY) or request.remote


async def create_completion(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    req = P.parse_body(P.CompletionRequest, await read_body(request))
    lora = await check_request(gw, req)
    max_len = gw.max_model_len(await gw.backend.alive_workers())
    prompts = [await _completion_prompt(gw, p, req.echo, max_len) for p in req.prompts]
    spec, param = requested_grammar(req, gw.grammars.budgets)
    if spec is not None:
        await gw.check_grammar(spec, param, client_of(request))
    return await Generation(request, gw, req, "completion", prompts, grammar=spec, grammar_param=param,
                            lora=lora).run()


@dataclass
class ChatPlan:
    """What a chat request renders and submits, and how its output is read back."""

    prompt_ids: list[int]
    grammar: GrammarSpec | None
    tool_parser: HermesParser | None
    reasoning: ReasoningFormat | None  # the output's thinking is split off by these tags
    reasoning_opened: bool  # the prompt ends inside the thinking (the template opened it)
    grammar_param: str | None = None  # the field that asked for the grammar


async def plan_chat(gw: Gateway, req: P.ChatCompletionRequest, messages: list[dict], client=None) -> ChatPlan:
    """Tools, output constraint, reasoning and the rendered prompt of a chat request (a 400 naming the field
    for what is malformed; `client` has one grammar proof at a time). The Responses API renders its
    conversations through here too."""
    template = gw.tokenizer.chat_templates.get("default", "") or next(iter(gw.tokenizer.chat_templates.values()), "")
    tools = plan_tools(req, messages, gw.tool_parser, template)
    spec, param = requested_grammar(req, gw.grammars.budgets)
    if tools.grammar is not None:
        if spec is not None:
            raise bad_request(f"'tool_choice' forces a tool call; it cannot be combined with '{param}'", param)
        spec, param = tools.grammar, "tool_choice" if req.tool_choice is not None else "tools"
        gw.grammars.budgets.check_size(spec, param)
    kwargs = {**(req.chat_template_kwargs or {}), **tools.template_kwargs}
    if req.reasoning_effort is not None and "reasoning_effort" in template:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)  # only a template that reads it gets it
    max_len = gw.max_model_len(await gw.backend.alive_workers())
    try:
        prompt_ids = await gw.prompts.encode_chat(tools.messages, req.add_generation_prompt, kwargs, max_len)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    fmt, opened = gw.reasoning, False
    if fmt is not None:
        opened = fmt.opened_by(gw.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False))
        if spec is not None:  # the constraint holds for the answer, after the thinking
            try:
                spec = grammar.after_reasoning(spec, fmt.start, fmt.end, opened)
            except grammar.GrammarError as e:
                raise bad_request(f"Invalid output constraint in '{param}': {e}", param) from None
    if spec is not None:
        await gw.check_grammar(spec, param, client)
    return ChatPlan(prompt_ids, spec, tools.parser, fmt, opened, param)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    req = P.parse_body(P.ChatCompletionRequest, await read_body(request))
    lora = await check_request(gw, req)
    plan = await plan_chat(gw, req, [m.model_dump(exclude_none=True) for m in req.messages], client_of(request))
    return await Generation(request, gw, req, "chat", [Prompt(plan.prompt_ids)], plan=plan, lora=lora).run()


class Generation:
    """One request in flight: its sequences, their outputs, and the response being written."""

    def __init__(self, request: web.Request, gw: Gateway, req: P.CompletionRequest | P.ChatCompletionRequest,
                 kind: str, prompts: list[Prompt], grammar: GrammarSpec | None = None,
                 plan: ChatPlan | None = None, grammar_param: str | None = None, lora: LoraRef | None = None):
        self.request = request
        self.lora = lora  # the LoRA adapter its `model` names (None: the base model)
        self.model_name = lora.name if lora is not None else gw.model_name  # what the response says it ran
        # what the output must follow (checked by the engine already), and the field that asked for it
        self.grammar = plan.grammar if plan is not None else grammar
        self.grammar_param = plan.grammar_param if plan is not None else grammar_param
        self.plan = plan  # chat: how the output is read back (tool calls, reasoning)
        self.gw = gw
        self.req = req
        self.kind = kind
        self.prompts = prompts
        self.per_prompt = req.choices_per_prompt  # sequences a prompt: n, or best_of
        count = len(prompts) * self.per_prompt
        self.request_id = request[REQUEST_ID]
        self.caller = caller(request)  # the key: its tenant, limits and priority range (gateway/tenants.py)
        self._holds_quota = False
        # a client resuming its stream re-sends the request with the id of the last event it got
        self.resume_offsets: list[int] | None = None
        self._given_token = ""
        # event ids (and the resume token) only for a client that asks: OpenAI's stream has none
        self.resumable = wants_resume(request.headers.get(RESUME_HEADER)) and req.stream
        self.resume_token: str | None = None
        last_event_id = request.headers.get("Last-Event-ID")
        if last_event_id is not None:
            if not req.stream:
                raise bad_request("Last-Event-ID resumes a stream: the request must have 'stream': true.", "stream")
            self.request_id, self._given_token, self.resume_offsets = parse_last_event_id(last_event_id, count)
            self.resumable = True
        self.response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + self.request_id
        self.created = P.now()
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.seq_ids = [f"{self.request_id}-{i}" for i in range(count)]
        self.prompt_of = {s: prompts[i // self.per_prompt] for i, s in enumerate(self.seq_ids)}
        self.num_prompt_tokens = sum(len(p.ids) for p in prompts)
        stops = req.stop_strings()
        self.outputs = [SequenceOutput(i, s, gw.tokenizer, self.prompt_of[s].ids, stops, req.min_tokens,
                                       len(self.prompt_of[s].echo_text)) for i, s in enumerate(self.seq_ids)]
        self.by_seq = {o.seq_id: o for o in self.outputs}
        self._last_token_at: dict[str, float] = {}
        self.stream: RequestStream | None = None
        self._queued: dict[str, bool] = {}  # sequences whose prompt counts in gw.queued_prompt_tokens
        self._lease_token: str | None = None
        self._client_gone = False  # the client went away: its stream may be resumed, so cancel after a grace

    # ------------------------------------------------------------------ admission

    @property
    def _what(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def _max_tokens(self, workers: list[WorkerInfo], prompt_len: int) -> int:
        """The request's max_tokens for a prompt, or a 400 when no live worker could ever hold prompt + completion."""
        max_len = self.gw.max_model_len(workers)
        what = self._what
        if prompt_len >= max_len:
            raise context_length_exceeded(f"This model's maximum context length is {max_len} tokens. However, your "
                                          f"{what} has {prompt_len} tokens. Please reduce the length of the {what}.",
                                          what)
        requested = self.req.requested_max_tokens() if self.kind == "chat" else self.req.max_tokens
        param = "max_completion_tokens" if self.kind == "chat" and self.req.max_completion_tokens else "max_tokens"
        if requested is not None and prompt_len + requested > max_len:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
                f"completion). Please reduce the length of the {what} or completion.", param)
        # the KV cache: the scheduler admits a sequence only if one worker's cache can hold all of it
        caches = self.gw.kv_capacities(workers)
        if requested is None:  # chat: as much as fits (vLLM); completions: 16, or what fits
            room = max_len - prompt_len
            fits = max((c.max_new_tokens(prompt_len) for c in caches), default=room)
            chosen = min(room if self.kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS, room, fits)
            if chosen < 1:
                raise self._kv_exceeded(caches, None, param, prompt_len)
            return chosen
        if caches and not any(c.admits(prompt_len, requested) for c in caches):
            raise self._kv_exceeded(caches, requested, param, prompt_len)
        return requested

    def _kv_exceeded(self, caches: list[KVCapacity], requested: int | None, param: str, prompt_len: int) -> APIError:
        what = self._what
        longest = max(c.max_prompt_len(1) for c in caches)
        if requested is None or prompt_len > longest:
            return context_length_exceeded(
                f"This model's KV cache (the largest of its live workers') holds a {what} of at most {longest} "
                f"tokens. However, your {what} has {prompt_len} tokens. Please reduce the length of the {what}.",
                what)
        most = max(c.max_new_tokens(prompt_len) for c in caches)
        return context_length_exceeded(
            f"This model's KV cache (the largest of its live workers') holds your {prompt_len}-token {what} with at "
            f"most {most} tokens of completion. However, you requested {prompt_len + requested} tokens "
            f"({prompt_len} in the {what}, {requested} in the completion). Please reduce the length of the {what} "
            f"or completion.", param)

    def failure(self, out: SequenceOutput | Delta) -> APIError:
        """A sequence's error for the client: a scheduler rejection means the request was bad input (400)."""
        if out.error_kind == ERROR_REJECTED:
            return context_length_exceeded(out.error or "The request does not fit any worker.", self._what)
        if out.error_kind == ERROR_GRAMMAR:
            return bad_request(f"The output constraint of '{self.grammar_param}' failed while generating: "
                               f"{out.error}", self.grammar_param)
        if out.error_kind == ERROR_QUARANTINED:
            return quarantined(out.error or "request quarantined")
        if out.error_kind == ERROR_TIMEOUT:
            return gateway_timeout(f"Generation stalled: {out.error}")
        if out.error_kind == ERROR_SHUTDOWN:
            return unavailable(f"Generation stopped: {out.error}")
        return internal_error(f"Generation failed: {out.error or 'worker error'}")

    async def _submit(self) -> None:
        gw = self.gw
        if not gw.backend.subscribed.is_set():
            raise unavailable("The gateway is not connected to its token channel (Redis); retry later.")
        workers = await gw.backend.alive_workers()
        if not workers:
            raise unavailable("No worker is alive to serve the request; retry later.")
        params = [P.sampling_params(self.req, self._max_tokens(workers, len(p.ids))) for p in self.prompts]
        if self.per_prompt > self.req.n:  # best_of ranks by each token's logprob (the client's ask stays its own)
            params = [replace(p, logprobs=p.logprobs or 0) for p in params]
        arrival_wall = time.time()
        submits = []
        for i, seq_id in enumerate(self.seq_ids):
            prompt, k = divmod(i, self.per_prompt)
            base = params[prompt]  # a prompt's k-th choice draws as that prompt's alone would
            tenant = self.caller.tenant
            submits.append(SubmitRequest(seq_id, gw.gateway_id, self.prompts[prompt].ids,
                                         replace(base, seed=None if base.seed is None else base.seed + k),
                                         self.req.priority, arrival_wall, self.grammar, tenant.name, tenant.weight,
                                         tenant.cache_scope, self.req.cache_salt or "", lora=self.lora))
        self.stream = gw.backend.open(self.seq_ids)  # route first: a fast worker may answer at once
        self._lease_token = await gw.backend.submit(submits)
        gw.metrics.prompt_tokens.inc(self._queued_tokens())
        log.info("submitted", kind=self.kind, n=len(submits), prompts=len(self.prompts),
                 prompt_tokens=self.num_prompt_tokens, max_tokens=max(p.max_tokens for p in params),
                 stream=self.req.stream)

    def _queued_tokens(self) -> int:
        """Prompt tokens of all the request's sequences (each prompt counts once per choice)."""
        return sum(len(p.ids) for p in self.prompt_of.values())

    def _admit(self) -> None:
        """The operator's bounds: priority range, requests in flight, prompt tokens queued (429 + Retry-After)."""
        gw, settings = self.gw, self.gw.settings
        lo, hi = self.caller.priority_range or (settings.priority_min, settings.priority_max)
        if not lo <= self.req.priority <= hi:
            whose = "for this API key" if self.caller.priority_range else "on this server"
            raise bad_request(f"'priority' must be between {lo} and {hi} {whose} (lower is served first); "
                              f"got {self.req.priority}.", "priority")
        if gw.in_flight >= gw.max_in_flight:
            raise too_many_requests(f"Too many requests in flight on this gateway (limit {gw.max_in_flight})",
                                    settings.retry_after)
        tokens = self._queued_tokens()
        if self.resume_offsets is None and gw.queued_prompt_tokens and gw.queued_prompt_tokens + tokens > gw.max_queued_prompt_tokens:
            raise too_many_requests(f"Too many prompt tokens queued on this gateway ({gw.queued_prompt_tokens} "
                                    f"+ {tokens} > {gw.max_queued_prompt_tokens})", settings.retry_after)
        if self.resume_offsets is None:
            refusal = gw.quotas.refusal(self.caller, tokens)
            if refusal is not None:
                gw.metrics.tenant_rejected.labels(self.caller.tenant.name, refusal.limit).inc()
                raise too_many_requests(refusal.message, refusal.retry_after)

    def _dequeue_tokens(self, seq_id: str) -> None:
        """A sequence got its first token (or ended): its prompt no longer counts as queued."""
        if self._queued.pop(seq_id, None):
            self.gw.queued_prompt_tokens -= len(self.prompt_of[seq_id].ids)
            if self._holds_quota:
                self.gw.quotas.dequeue(self.caller, len(self.prompt_of[seq_id].ids))

    async def _resume(self) -> None:
        """Serve the rest of a stream another serving started: no new generation, tokens from the token log.
        Only for the client that submitted it (the resume token), and only once its last connection is gone."""
        gw = self.gw
        known = token_matches(self._given_token, self.resume_token or "")
        if not known or not await gw.backend.resumable(self.seq_ids):
            raise resume_not_found(self.request_id)
        self._lease_token = await gw.backend.attach(self.seq_ids)
        if self._lease_token is None:
            raise stream_in_use(self.request_id, math.ceil(gw.backend.delivery.lease_ttl_s))
        self.stream = gw.backend.open(self.seq_ids, follow=True)
        log.info("resumed", kind=self.kind, n=len(self.seq_ids), from_offsets=self.resume_offsets)

    async def run(self, respond=None) -> web.StreamResponse:
        """Admit, submit, and answer with `respond()` (default: the chat / completion body or its SSE)."""
        gw = self.gw
        self._admit()
        gw.in_flight += 1
        gw.metrics.in_flight.inc()
        if self.resume_offsets is None:
            self._queued = {s: True for s in self.seq_ids}
            gw.queued_prompt_tokens += self._queued_tokens()
            gw.quotas.acquire(self.caller, self._queued_tokens())
            self._holds_quota = True
        try:
            if self.resumable:
                self.resume_token = resume_token(await gw.backend.resume_secret(), self.request_id,
                                                 self.request.get(CLIENT_KEY, b""))
            await (self._resume() if self.resume_offsets is not None else self._submit())
            if respond is not None:
                return await respond()
            return await (self._respond_stream() if self.req.stream else self._respond_whole())
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client that disconnected
            self._client_gone = not (self.stream and self.stream.overflowed)  # or that was dropped for not reading
            raise
        finally:
            gw.in_flight -= 1
            gw.metrics.in_flight.dec()
            for s in self.seq_ids:
                self._dequeue_tokens(s)
            if self._holds_quota:
                self._account()
            self._release()

    def _account(self) -> None:
        """A request's end: its tenant's counters, its key's usage, its quota released (completion tokens
        count in its tokens per minute)."""
        gw = self.gw
        completion = sum(o.num_tokens for o in self.outputs)
        gw.quotas.release(self.caller, completion)
        if self.stream is None:
            return  # refused before anything was submitted
        usage = self.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"] if usage.get("prompt_tokens_details") else 0
        gw.metrics.tenant_request(self.caller.tenant.name, self.num_prompt_tokens, cached, completion)
        gw.backend.add_usage(self.caller.name, {"requests": 1, "prompt_tokens": self.num_prompt_tokens,
                                                "cached_tokens": cached, "completion_tokens": completion})

    def _release(self) -> None:
        if self.stream is None:  # refused before anything was submitted
            return
        self.stream.close()
        # a sequence the gateway gave up on (no progress, or it is shutting down) may still be queued or
        # running somewhere
        unfinished = [o.seq_id for o in self.outputs
                      if not o.finished or o.error_kind in (ERROR_TIMEOUT, ERROR_SHUTDOWN)]
        finished = [o.seq_id for o in self.outputs if o.finished]
        if self.resumable:  # its client may resume the end at once: free the leases now, not at their expiry
            self.gw.backend.release_leases(finished, self._lease_token)
        else:
            self.gw.backend.drop_leases(finished, self._lease_token)
        if unfinished and self.resumable and self._client_gone and self._lease_token:
            # the client may come back with Last-Event-ID, here or on another gateway: give it the grace
            self.gw.backend.cancel_after_grace(unfinished, self._lease_token)
        elif unfinished:  # handler failed, a client that cannot resume, or a whole response: free the blocks now
            self.gw.backend.cancel_soon(unfinished, "abort")
        if not unfinished:
            self.gw.metrics.e2e.observe(time.monotonic() - self.arrival)
        log.info("request done", completion_tokens=sum(o.num_tokens for o in self.outputs),
                 finish_reasons=[o.finish_reason for o in self.outputs], cancelled=unfinished or None,
                 seconds=round(time.monotonic() - self.arrival, 4))

    # ------------------------------------------------------------------ token events

    async def deltas(self) -> AsyncIterator[tuple[SequenceOutput, Delta]]:
        assert self.stream is not None
        metrics = self.gw.metrics
        pending = len(self.outputs)
        skip = ({o.seq_id: off for o, off in zip(self.outputs, self.resume_offsets)}
                if self.resume_offsets is not None else {})
        while pending:
            ev = await self.stream.get()
            out = self.by_seq.get(ev.seq_id)
            if out is None or out.finished:
                continue
            if skip.get(ev.seq_id, 0) > ev.offset:  # the resumed client has this part: replay it silently
                ev = self._replay(out, ev, skip[ev.seq_id])
                if out.finished:
                    pending -= 1
                    yield out, Delta()
                    continue
                if ev is None:
                    continue
            delta = out.on_event(ev)
            now = time.monotonic()
            self._dequeue_tokens(out.seq_id)
            if delta.num_tokens:
                metrics.generation_tokens.inc(delta.num_tokens)
                last = self._last_token_at.get(out.seq_id)
                if last is None:
                    metrics.queue_time.observe(now - self.arrival)
                    metrics.tenant_queue_time.labels(self.caller.tenant.name).observe(now - self.arrival)
                    if self.first_token_at is None:
                        self.first_token_at = now
                        metrics.ttft.observe(now - self.arrival)
                else:
                    gap = (now - last) / delta.num_tokens
                    for _ in range(delta.num_tokens):
                        metrics.itl.observe(gap)
                self._last_token_at[out.seq_id] = now
            if out.finished:
                pending -= 1
                metrics.finished(out.finish_reason)
                if out.stopped_by_string:  # the worker does not know: stop it and free the blocks
                    self.stream.forget(out.seq_id)
                    self.gw.backend.cancel_soon([out.seq_id], "stop")
            yield out, delta

    @staticmethod
    def _replay(out: SequenceOutput, ev: TokenEvent, upto: int) -> TokenEvent | None:
        """Feed the tokens before offset `upto` (and a finish the client has seen) without output;
        -> the rest of the event, or None."""
        n = upto - ev.offset
        head = ev if n >= len(ev.token_ids) else replace(
            ev, token_ids=ev.token_ids[:n], finish_reason=None, error=None, error_kind=None,
            logprobs=ev.logprobs[:n] if ev.logprobs is not None else None)
        # an event ending exactly at the client's offset carries a finish the client has not seen (offset + 1)
        if head is ev and (ev.finish_reason or ev.error) and ev.offset + len(ev.token_ids) >= upto:
            head = replace(ev, finish_reason=None, error=None, error_kind=None)
        out.on_event(head)
        if head is ev or out.finished:
            return None
        rest = ev.token_ids[len(head.token_ids):]
        if not rest and not (ev.finish_reason or ev.error):
            return None
        return replace(ev, offset=ev.offset + len(head.token_ids), token_ids=rest,
                       logprobs=ev.logprobs[len(head.token_ids):] if ev.logprobs is not None else None)

    def _event_id(self) -> str:
        return event_id(self.request_id, self.resume_token,
                        [o.num_tokens + (1 if o.finished else 0) for o in self.outputs])

    def usage(self) -> dict:
        # every prompt once (as OpenAI counts n choices), every token generated (best_of's unreturned ones too);
        # a prompt's cached tokens are what all of its choices found (n > 1 forks from the first one's prefill)
        k = self.per_prompt
        cached = sum(min(min(o.cached_tokens for o in self.outputs[i * k:(i + 1) * k]), len(p.ids))
                     for i, p in enumerate(self.prompts)) if self.outputs else 0
        return P.usage(self.num_prompt_tokens, sum(o.num_tokens for o in self.outputs), cached)

    def _logprobs(self, entries) -> dict | None:
        if self.kind == "chat":
            return chat_logprobs(self.gw.tokenizer, entries) if self.req.logprobs else None
        return completion_logprobs(self.gw.tokenizer, entries) if self.req.logprobs is not None else None

    # ------------------------------------------------------------------ whole response

    async def _respond_whole(self) -> web.Response:
        async for _, d in self.deltas():
            if d.error_kind == ERROR_REJECTED:
                break  # answered 400 whatever its other choices do (they are cancelled)
        failed = [o for o in self.outputs if o.finish_reason == "error"]
        if failed:
            bad_input = (o for o in failed if o.error_kind in (ERROR_REJECTED, ERROR_GRAMMAR))
            raise self.failure(next(bad_input, failed[0]))
        model = self.model_name
        returned = (best_of(self.outputs, self.per_prompt, self.req.n) if self.per_prompt > self.req.n
                    else self.outputs)
        if self.kind == "chat":
            choices = [self._chat_choice(o) for o in returned]
            body = P.chat_response(self.response_id, self.created, model, choices, self.usage())
        else:
            choices = [P.completion_choice(o.index, self.prompt_of[o.seq_id].echo_text + o.text,
                                           self._logprobs(o.logprobs), o.finish_reason) for o in returned]
            body = P.completion_response(self.response_id, self.created, model, choices, self.usage())
        return web.json_response(body, headers={"X-Request-Id": self.request_id},
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False))

    def _chat_choice(self, o: SequenceOutput) -> dict:
        whole = self.read_whole(o.text)
        return P.chat_choice(o.index, whole.content, self._logprobs(o.logprobs),
                             _finish(o.finish_reason, bool(whole.tool_calls)), whole.tool_calls, whole.reasoning)

    def read_whole(self, text: str) -> WholeOutput:
        plan = self.plan
        if plan is None:
            return WholeOutput(None, text, [])
        return read_whole(text, plan.tool_parser, plan.reasoning, plan.reasoning_opened)

    def reader(self) -> ChatOutputReader | None:
        """A streamed output's reader (None: its text is all content)."""
        plan = self.plan
        if plan is None or (plan.tool_parser is None and plan.reasoning is None):
            return None
        return ChatOutputReader(plan.tool_parser, plan.reasoning, plan.reasoning_opened)

    # ------------------------------------------------------------------ SSE

    async def _respond_stream(self) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": self.request_id}
        if self.resume_token:
            headers[RESUME_TOKEN_HEADER] = self.resume_token
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(self.request)
        settings = self.gw.settings
        self.stream.max_events = settings.stream_buffer_events
        self.stream.on_overflow = lambda: drop(self.request)
        include_usage, continuous_usage = self.req.include_usage, self.req.continuous_usage
        model = self.model_name
        chat = self.kind == "chat"
        chunk = P.chat_chunk if chat else P.completion_chunk
        readers = {o.index: self.reader() for o in self.outputs} if chat else {}

        def event(obj: dict, with_id: bool = False) -> bytes:
            head = f"id: {self._event_id()}\n".encode() if with_id and self.resume_token else b""
            return head + b"data: " + SSE_JSON.encode(obj).encode() + b"\n\n"

        async def write(data: bytes, eof: bool = False) -> None:
            await write_within(resp, self.request, data, settings.client_write_timeout, eof)

        async def send(obj: dict, with_id: bool = False) -> None:
            await write(event(obj, with_id))

        def make(choices: list[dict], out: SequenceOutput) -> dict:
            # continuous_usage_stats (vLLM's): each chunk has its choice's usage so far
            usage = P.usage(len(self.prompt_of[out.seq_id].ids), out.num_tokens) if continuous_usage else None
            return chunk(self.response_id, self.created, model, choices, usage, include_usage)

        try:
            for o in self.outputs:  # the opening chunk of each choice (a resumed client has them)
                if self.resume_offsets is not None:
                    break
                if chat:
                    await send(make([P.chat_chunk_choice(o.index, {"role": "assistant", "content": ""})], o), True)
                elif self.prompt_of[o.seq_id].echo_text:
                    await send(make([P.completion_choice(o.index, self.prompt_of[o.seq_id].echo_text, None, None)],
                                    o), True)
            # the stream's last event, its usage chunk, [DONE] and the end of the chunked body go out in one
            # write (one syscall, one wake-up of the client) instead of four
            tail = b""
            async for out, d in self.deltas():
                if d.error:
                    await send(P.error_chunk(self.failure(d)))
                    break
                if not (d.text or d.logprobs or d.finish_reason):
                    continue
                lp = self._logprobs(d.logprobs)
                if chat and readers[out.index] is not None:
                    choice = self._read_chunk_choice(readers[out.index], out.index, d, lp)
                    if choice is None:  # all of it held back (it may open a call, or close the thinking)
                        continue
                elif chat:
                    choice = P.chat_chunk_choice(out.index, {"content": d.text} if d.text else {}, lp,
                                                 d.finish_reason)
                else:
                    choice = P.completion_choice(out.index, d.text, lp, d.finish_reason)
                data = event(make([choice], out), True)
                if all(o.finished for o in self.outputs):
                    tail = data
                else:
                    await write(data)
            if include_usage:
                tail += event(chunk(self.response_id, self.created, model, [], self.usage(), True))
            await write(tail + b"data: [DONE]\n\n", eof=True)
        except SlowClient as e:  # dropped: cancelled now, not after a resume grace
            log.info("slow client dropped", reason=str(e))
        except ConnectionError:  # the client went away mid-stream (reset / broken pipe)
            if self.stream.overflowed:  # or was dropped, blocked in a write, for its pile of events
                log.info("slow client dropped", reason=f"more than {self.stream.max_events} events waited")
            else:
                self._client_gone = True
                log.info("client disconnected")
        except APIError as e:  # headers are sent: the error goes in the stream
            await self._try_send_error(send, e)
        except Exception:
            log.exception("stream failed")
            await self._try_send_error(send, internal_error())
        return resp

    @staticmethod
    def _read_chunk_choice(reader: ChatOutputReader, index: int, d: Delta, lp: dict | None) -> dict | None:
        """A chat chunk's choice with the output read into its parts: reasoning and content as they come, a
        call once whole (None: nothing to send yet)."""
        piece = reader.feed(d.text, final=bool(d.finish_reason))
        delta: dict = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.tool_calls:
            delta["tool_calls"] = piece.tool_calls
        if not delta and lp is None and not d.finish_reason:
            return None
        return P.chat_chunk_choice(index, delta, lp, _finish(d.finish_reason, reader.num_calls > 0))

    @staticmethod
    async def _try_send_error(send, err: APIError) -> None:
        try:
            await send(P.error_chunk(err))
        except (ConnectionError, SlowClient):
            pass


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason of a chat choice that called tools: "tool_calls" where it stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason
