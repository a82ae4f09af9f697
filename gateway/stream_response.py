"""A generation answered as server-sent events: each choice's chunks as its tokens come, then the usage chunk
(when asked for) and [DONE]. Errors after the headers go in the stream; a client that goes away may resume
(its sequences wait a grace), one dropped for not reading is cancelled at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.errors import APIError, internal_error
from phaseserve.gateway.output import SequenceOutput
from phaseserve.gateway.slow_client import SlowClient, drop
from phaseserve.gateway.sse_ids import RESUME_TOKEN_HEADER
from phaseserve.gateway.sse_writer import DONE, SSEWriter

if TYPE_CHECKING:
    from phaseserve.gateway.generation import Generation

log = structlog.get_logger("gateway")


async def respond_stream(gen: Generation) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": gen.request_id}
    if gen.resume_token:
        headers[RESUME_TOKEN_HEADER] = gen.resume_token
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(gen.request)
    settings = gen.gw.settings
    gen.stream.max_events = settings.stream_buffer_events
    gen.stream.on_overflow = lambda: drop(gen.request)
    sse = SSEWriter(resp, gen.request, settings.client_write_timeout, gen.event_id if gen.resume_token else None)
    endpoint, req = gen.endpoint, gen.req

    def chunk(choices: list[dict], out: SequenceOutput) -> dict:
        # continuous_usage_stats (vLLM's): each chunk has its choice's usage so far
        usage = P.usage(len(gen.prompt_of[out.seq_id].ids), out.num_tokens) if req.continuous_usage else None
        return endpoint.chunk(gen.response_id, gen.created, gen.model_name, choices, usage, req.include_usage)

    try:
        if gen.resume_offsets is None:  # the opening chunk of each choice (a resumed client has them)
            for o in gen.outputs:
                opening = endpoint.opening_choice(o, gen.prompt_of[o.seq_id].echo_text)
                if opening is not None:
                    await sse.send(chunk([opening], o), True)
        # the stream's last event, its usage chunk, [DONE] and the end of the chunked body go out in one
        # write (one syscall, one wake-up of the client) instead of four
        tail = b""
        async for out, d in gen.deltas():
            if d.error:
                await sse.send(P.error_chunk(gen.failure(d)))
                break
            if not (d.text or d.logprobs or d.finish_reason):
                continue
            choice = endpoint.stream_choice(out, d, gen.logprobs(d.logprobs))
            if choice is None:
                continue
            data = sse.event(chunk([choice], out), True)
            if all(o.finished for o in gen.outputs):
                tail = data
            else:
                await sse.write(data)
        if req.include_usage:
            tail += sse.event(endpoint.chunk(gen.response_id, gen.created, gen.model_name, [], gen.usage(), True))
        await sse.write(tail + DONE, eof=True)
    except SlowClient as e:  # dropped: cancelled now, not after a resume grace
        log.info("slow client dropped", reason=str(e))
    except ConnectionError:  # the client went away mid-stream (reset / broken pipe)
        if gen.stream.overflowed:  # or was dropped, blocked in a write, for its pile of events
            log.info("slow client dropped", reason=f"more than {gen.stream.max_events} events waited")
        else:
            gen.client_gone = True
            log.info("client disconnected")
    except APIError as e:  # headers are sent: the error goes in the stream
        await sse.try_send_error(e)
    except Exception:
        log.exception("stream failed")
        await sse.try_send_error(internal_error())
    return resp
