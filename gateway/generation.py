"""One generation request in flight, for /v1/completions, /v1/chat/completions and /v1/responses.

A request with n choices is n sequences `<request_id>-<i>` on the wire; with several prompts (completions) or
best_of, prompts x best_of (or n) of them, choice i * n + j being the j-th of prompt i. Whatever
way a handler ends -- all sequences finished, a stop string, the client gone
(write failure, or aiohttp cancelling the handler), an error -- every sequence
that the worker side has not finished gets a CancelRequest, so the scheduler
frees its KV blocks. What differs between the endpoints is its `endpoint` (gateway/endpoints.py); the
answer is written by gateway/whole_response.py or gateway/stream_response.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.admission import admit, output_bound
from phaseserve.gateway.auth import CLIENT_KEY, caller
from phaseserve.gateway.endpoints import Endpoint
from phaseserve.gateway.errors import (REQUEST_ID, APIError, bad_request, context_length_exceeded, gateway_timeout,
                            internal_error, quarantined, resume_not_found, stream_in_use, unavailable)
from phaseserve.gateway.key_usage import RequestUsage
from phaseserve.gateway.output import Delta, SequenceOutput
from phaseserve.gateway.sse_ids import RESUME_HEADER, event_id, parse_last_event_id, resume_token, token_matches, wants_resume
from phaseserve.gateway.state import Gateway
from phaseserve.gateway.stream_response import respond_stream
from phaseserve.gateway.token_delivery import ERROR_SHUTDOWN, ERROR_TIMEOUT, RequestStream
from phaseserve.gateway.whole_response import respond_whole
from phaseserve.wire import (ERROR_GRAMMAR, ERROR_QUARANTINED, ERROR_REJECTED, LoraRef, SubmitRequest,
                             TokenEvent)

log = structlog.get_logger("gateway")


@dataclass
class Prompt:
    """One prompt of a request: its token ids, and the text `echo` puts before each of its choices."""

    ids: list[int]
    echo_text: str = ""


class Generation:
    """One request in flight: its sequences, their outputs, and the response being written."""

    def __init__(self, request: web.Request, gw: Gateway, req: P.CompletionRequest | P.ChatCompletionRequest,
                 endpoint: Endpoint, prompts: list[Prompt], lora: LoraRef | None = None):
        self.request = request
        self.lora = lora  # the LoRA adapter its `model` names (None: the base model)
        self.model_name = lora.name if lora is not None else gw.model_name  # what the response says it ran
        self.endpoint = endpoint
        self.gw = gw
        self.req = req
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
        self.response_id = endpoint.id_prefix + self.request_id
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
        self.client_gone = False  # the client went away: its stream may be resumed, so cancel after a grace

    # ------------------------------------------------------------------ submit, resume, end

    def failure(self, out: SequenceOutput | Delta) -> APIError:
        """A sequence's error for the client: a scheduler rejection means the request was bad input (400)."""
        if out.error_kind == ERROR_REJECTED:
            return context_length_exceeded(out.error or "The request does not fit any worker.", self.endpoint.what)
        if out.error_kind == ERROR_GRAMMAR:
            param = self.endpoint.grammar_param
            return bad_request(f"The output constraint of '{param}' failed while generating: {out.error}", param)
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
        workers = await gw.backend.workers.alive()
        if not workers:
            raise unavailable("No worker is alive to serve the request; retry later.")
        max_len, caches = gw.max_model_len(workers), gw.kv_capacities(workers)
        params = [P.sampling_params(self.req, output_bound(self.endpoint, max_len, caches, len(p.ids)))
                  for p in self.prompts]
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
                                         self.req.priority, arrival_wall, self.endpoint.grammar, tenant.name,
                                         tenant.weight, tenant.cache_scope, self.req.cache_salt or "", lora=self.lora))
        self.stream = gw.backend.routes.open(self.seq_ids)  # route first: a fast worker may answer at once
        self._lease_token = await gw.backend.submissions.submit(submits)
        gw.metrics.prompt_tokens.inc(self._queued_tokens())
        log.info("submitted", kind=self.endpoint.kind, n=len(submits), prompts=len(self.prompts),
                 prompt_tokens=self.num_prompt_tokens, max_tokens=max(p.max_tokens for p in params),
                 stream=self.req.stream)

    def _queued_tokens(self) -> int:
        """Prompt tokens of all the request's sequences (each prompt counts once per choice)."""
        return sum(len(p.ids) for p in self.prompt_of.values())

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
        if not known or not await gw.backend.resumes.resumable(self.seq_ids):
            raise resume_not_found(self.request_id)
        self._lease_token = await gw.backend.attach(self.seq_ids)
        if self._lease_token is None:
            raise stream_in_use(self.request_id, math.ceil(gw.backend.delivery.lease_ttl_s))
        self.stream = gw.backend.routes.open(self.seq_ids, follow=True)
        log.info("resumed", kind=self.endpoint.kind, n=len(self.seq_ids), from_offsets=self.resume_offsets)

    async def run(self, respond: Callable[[], Awaitable[web.StreamResponse]] | None = None) -> web.StreamResponse:
        """Admit, submit, and answer with `respond()` (default: the chat / completion body or its SSE)."""
        gw = self.gw
        admit(gw, self.caller, self.req.priority, self._queued_tokens(), resuming=self.resume_offsets is not None)
        gw.in_flight += 1
        gw.metrics.in_flight.inc()
        if self.resume_offsets is None:
            self._queued = {s: True for s in self.seq_ids}
            gw.queued_prompt_tokens += self._queued_tokens()
            gw.quotas.acquire(self.caller, self._queued_tokens())
            self._holds_quota = True
        try:
            if self.resumable:
                self.resume_token = resume_token(await gw.backend.resumes.secret(), self.request_id,
                                                 self.request.get(CLIENT_KEY, b""))
            await (self._resume() if self.resume_offsets is not None else self._submit())
            if respond is not None:
                return await respond()
            return await (respond_stream(self) if self.req.stream else respond_whole(self))
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client that disconnected
            self.client_gone = not (self.stream and self.stream.overflowed)  # or that was dropped for not reading
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
        gw.backend.usage.add(self.caller.name, RequestUsage(1, self.num_prompt_tokens, cached, completion))

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
            self.gw.backend.leases.release(finished, self._lease_token)
        else:
            self.gw.backend.leases.drop(finished, self._lease_token)
        if unfinished and self.resumable and self.client_gone and self._lease_token:
            # the client may come back with Last-Event-ID, here or on another gateway: give it the grace
            self.gw.backend.leases.cancel_after_grace(unfinished, self._lease_token)
        elif unfinished:  # handler failed, a client that cannot resume, or a whole response: free the blocks now
            self.gw.backend.submissions.cancel_soon(unfinished, "abort")
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
                    self.gw.backend.submissions.cancel_soon([out.seq_id], "stop")
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

    def event_id(self) -> str:
        """The id of the stream's next event: where each choice is, for a client that resumes."""
        return event_id(self.request_id, self.resume_token,
                        [o.num_tokens + (1 if o.finished else 0) for o in self.outputs])

    def usage(self) -> dict:
        # every prompt once (as OpenAI counts n choices), every token generated (best_of's unreturned ones too);
        # a prompt's cached tokens are what all of its choices found (n > 1 forks from the first one's prefill)
        k = self.per_prompt
        cached = sum(min(min(o.cached_tokens for o in self.outputs[i * k:(i + 1) * k]), len(p.ids))
                     for i, p in enumerate(self.prompts)) if self.outputs else 0
        return P.usage(self.num_prompt_tokens, sum(o.num_tokens for o in self.outputs), cached)

    def logprobs(self, entries) -> dict | None:
        return self.endpoint.logprobs(self.gw.tokenizer, entries)
