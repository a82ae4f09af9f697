"""A generation answered whole: one JSON body once every choice has finished (or an error for the request)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

from phaseserve.gateway.best_of import best_of
from phaseserve.wire import ERROR_GRAMMAR, ERROR_REJECTED

if TYPE_CHECKING:
    from phaseserve.gateway.generation import Generation


async def respond_whole(gen: Generation) -> web.Response:
    async for _, d in gen.deltas():
        if d.error_kind == ERROR_REJECTED:
            break  # answered 400 whatever its other choices do (they are cancelled)
    failed = [o for o in gen.outputs if o.finish_reason == "error"]
    if failed:
        bad_input = (o for o in failed if o.error_kind in (ERROR_REJECTED, ERROR_GRAMMAR))
        raise gen.failure(next(bad_input, failed[0]))
    returned = best_of(gen.outputs, gen.per_prompt, gen.req.n) if gen.per_prompt > gen.req.n else gen.outputs
    echo_of = {s: p.echo_text for s, p in gen.prompt_of.items()}
    body = gen.endpoint.whole_body(gen.gw.tokenizer, gen.response_id, gen.created, gen.model_name, returned,
                                   echo_of, gen.usage())
    return web.json_response(body, headers={"X-Request-Id": gen.request_id},
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))
