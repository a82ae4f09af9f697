"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A response is generated through the chat path (gateway/generate.py's plan_chat, gateway/generation.py's
Generation with the chat endpoint: the chat template, tokenization, grammar enforcement for tools and
json_schema, submission, delivery); this module only translates the request (responses_protocol.py), builds
the output items and the typed events (responses_events.py) and keeps stored responses in Redis
(responses_store.py).

A stored response is saved when it starts (status in_progress: GET and cancel work from any gateway while it
runs) and again when it ends. A request naming `previous_response_id` re-renders the whole conversation
through the chat template, so the earlier turns' prompt is the same token prefix and the scheduler's
prefix cache serves it (`usage.input_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import json

import structlog
from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.auth import CLIENT_KEY
from phaseserve.gateway.errors import APIError, bad_request, read_body
from phaseserve.gateway.endpoints import ChatEndpoint
from phaseserve.gateway.generate import check_request, client_of, plan_chat
from phaseserve.gateway.generation import Generation, Prompt
from phaseserve.gateway.sse_writer import SSEWriter
from phaseserve.gateway.output import Delta
from phaseserve.gateway.responses_events import ResponseBuilder, usage
from phaseserve.gateway.responses_protocol import ResponsesRequest, chat_messages, chat_request, responses_error
from phaseserve.gateway.slow_client import SlowClient, drop
from phaseserve.gateway.state import GATEWAY, Gateway

log = structlog.get_logger("gateway.responses")

RESPONSE_PREFIX = "resp_"


def _owner(request: web.Request) -> str:
    """Digest of the request's API key ('' without keys): who may read what it stores."""
    return request.get(CLIENT_KEY, b"").hex()


def not_found(response_id: str, param: str | None = None) -> APIError:
    """One answer for an unknown, expired and another key's response."""
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", param,
                    "not_found")


def _response_object(gw: Gateway, req: ResponsesRequest, response_id: str, created: int) -> dict:
    fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else None
    choice = req.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created, "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": req.model or gw.model_name, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": None,
        "user": req.user, "metadata": req.metadata or {},
    }


class ResponseRun:
    """One response being generated: its Generation's deltas in, the Response (and its events) out."""

    def __init__(self, request: web.Request, gw: Gateway, req: ResponsesRequest, gen: Generation,
                 items: list[dict], owner: str):
        self.request, self.gw, self.req, self.gen = request, gw, req, gen
        self.items = items  # the conversation before this output
        self.owner = owner
        self.response = _response_object(gw, req, RESPONSE_PREFIX + gen.request_id, gen.created)
        self.builder = ResponseBuilder(self.response)
        self.reader = gen.endpoint.reader()

    def _feed(self, d: Delta) -> list[dict]:
        if self.reader is None:
            return self.builder.piece("", d.text, [])
        piece = self.reader.feed(d.text, final=bool(d.finish_reason))
        return self.builder.piece(piece.reasoning, piece.content, piece.tool_calls)

    def _finish(self) -> list[dict]:
        out = self.gen.outputs[0]
        chat_usage = self.gen.usage()
        thinking = "".join(i["content"][0]["text"] for i in self.response["output"] if i["type"] == "reasoning")
        reasoning_tokens = min(len(self.gw.tokenizer.encode(thinking, add_special_tokens=False)), out.num_tokens) \
            if thinking else 0
        usage_ = usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"],
                       chat_usage["prompt_tokens_details"]["cached_tokens"], reasoning_tokens)
        if out.finish_reason == "length":
            return self.builder.finish("incomplete", usage_, "max_output_tokens")
        if out.finish_reason == "abort":  # cancelled (POST /v1/responses/{id}/cancel, from any gateway)
            return self.builder.finish("cancelled", usage_)
        return self.builder.finish("completed", usage_)

    def _failed(self, d: Delta) -> list[dict]:
        err = self.gen.failure(d)
        return self.builder.finish("failed", None, error={"code": "server_error" if err.status >= 500
                                                          else "invalid_prompt", "message": err.message})

    async def _store(self) -> None:
        if self.req.store:
            await self.gw.responses.save(self.response, self.items + self.response["output"], self.owner)

    async def respond(self) -> web.StreamResponse:
        await self._store()  # in progress: readable (and cancellable) from any gateway while it runs
        return await (self._stream() if self.req.stream else self._whole())

    async def _collect(self) -> APIError | None:
        """Read the whole output into the response and store it; -> the failure, if it failed."""
        async for _, d in self.gen.deltas():
            if d.error:
                self._failed(d)
                await self._store()
                return self.gen.failure(d)
            self._feed(d)
        self._finish()
        await self._store()
        return None

    async def _whole(self) -> web.Response:
        failure = await self._collect()
        if failure is not None:
            raise failure
        return web.json_response(self.response, headers={"X-Request-Id": self.gen.request_id},
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def start_background(self) -> dict:
        """Store the response in progress, generate it in a task of this gateway, and answer at once; the
        client polls GET (any gateway) and may cancel it."""
        self.response["background"] = True
        await self._store()
        task = asyncio.get_running_loop().create_task(self._background())
        self.gw.background_tasks.add(task)
        task.add_done_callback(self.gw.background_tasks.discard)
        return json.loads(json.dumps(self.response))

    async def _background(self) -> None:
        async def collect() -> web.Response:
            await self._collect()
            return web.Response()

        try:
            await self.gen.run(collect)
        except APIError as e:  # refused before it ran (no worker, too many requests...): stored as failed
            self.builder.finish("failed", None, error={"code": "server_error" if e.status >= 500
                                                       else "invalid_prompt", "message": e.message})
            await self._store()
        except Exception:
            log.exception("background response failed")

    async def _stream(self) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": self.gen.request_id})
        await resp.prepare(self.request)
        settings = self.gw.settings
        self.gen.stream.max_events = settings.stream_buffer_events
        self.gen.stream.on_overflow = lambda: drop(self.request)

        writer = SSEWriter(resp, self.request, settings.client_write_timeout)

        async def send(events: list[dict], eof: bool = False) -> None:
            data = b"".join(writer.event(ev, name=ev["type"]) for ev in events)
            if data or eof:
                await writer.write(data, eof)

        try:
            await send(self.builder.start())
            failed = False
            async for _, d in self.gen.deltas():
                if d.error:
                    events, failed = self._failed(d), True
                    break
                await send(self._feed(d))
            if not failed:
                events = self._finish()
            await self._store()  # before the last event: a client that saw it may continue the conversation
            await send(events, eof=True)
        except SlowClient as e:
            log.info("slow client dropped", reason=str(e))
        except ConnectionError:
            log.info("client disconnected")
        except APIError as e:  # headers are sent: the error goes in the stream as OpenAI's error event
            await self._try_send(send, e)
        except Exception:
            log.exception("stream failed")
            await self._try_send(send, APIError(500, "Internal server error.", "server_error", None,
                                                "internal_error"))
        return resp

    def _error_event(self, err: APIError) -> dict:
        return {"type": "error", "sequence_number": self.builder.sequence, "code": err.code,
                "message": err.message, "param": err.param}

    async def _try_send(self, send, err: APIError) -> None:
        try:
            await send([self._error_event(err)], eof=True)
        except (ConnectionError, SlowClient):
            pass


async def create_response(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    req = P.parse_body(ResponsesRequest, await read_body(request))
    if req.background and not req.store:
        raise bad_request("'background' responses are stored: 'store' must not be false with it", "background")
    if req.background and req.stream:
        raise bad_request("'background' responses are not streamed by this server: poll GET /v1/responses/{id}",
                          "stream")
    owner = _owner(request)
    history: list[dict] = []
    if req.previous_response_id is not None:
        record = await gw.responses.load(req.previous_response_id, owner)
        if record is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = record["conversation"]
    items = history + req.input_items()
    try:
        chat = chat_request(req, chat_messages(req.instructions, items))
        lora = await check_request(gw, chat)
        plan = await plan_chat(gw, chat, [m.model_dump(exclude_none=True) for m in chat.messages],
                               client_of(request))
        gen = Generation(request, gw, chat, ChatEndpoint(chat, plan), [Prompt(plan.prompt_ids)], lora=lora)
        run = ResponseRun(request, gw, req, gen, items, owner)
        if req.background:
            return web.json_response(await run.start_background())
        return await gen.run(run.respond)
    except APIError as e:
        raise responses_error(e) from None


async def retrieve_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    record = await gw.responses.load(response_id, _owner(request))
    if record is None:
        raise not_found(response_id)
    return web.json_response(record["response"])


async def delete_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    if not await gw.responses.delete(response_id, _owner(request)):
        raise not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """Cancel a stored response while it runs (from any gateway): its sequence is cancelled, and the gateway
    serving it ends it with status `cancelled`. A response that has ended is a 400."""
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    owner = _owner(request)
    record = await gw.responses.load(response_id, owner)
    if record is None:
        raise not_found(response_id)
    status = record["response"]["status"]
    if status != "in_progress":
        raise bad_request(f"Response '{response_id}' is {status}; only a response in progress can be cancelled.",
                          "response_id")
    await gw.backend.submissions.cancel([f"{response_id.removeprefix(RESPONSE_PREFIX)}-0"], "abort")
    record = await gw.responses.update_status(response_id, owner, "cancelled")
    return web.json_response(record["response"] if record else {"id": response_id, "status": "cancelled"})
