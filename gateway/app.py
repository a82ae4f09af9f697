"""The aiohttp application: routes, middleware, start-up and shutdown of the Redis side."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from dataclasses import fields

import structlog
from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.auth import auth_middleware, caller, load_api_keys
from phaseserve.gateway.errors import BODY_TIMEOUT, MAX_BODY_BYTES, error_middleware
from phaseserve.gateway.generate import create_chat_completion, create_completion
from phaseserve.gateway.health import UNAVAILABLE, Health, assess
from phaseserve.gateway.key_usage import RequestUsage
from phaseserve.gateway.live_view import LIVE_VIEW, LiveView, stack_events
from phaseserve.gateway.lora_routes import add_routes as add_lora_routes
from phaseserve.gateway.metrics import CONTENT_TYPE
from phaseserve.gateway.openapi import openapi_document
from phaseserve.gateway.responses import cancel_response, create_response, delete_response, retrieve_response
from phaseserve.gateway.state import GATEWAY, Gateway
from phaseserve.gateway.tenants import KeyDirectory
from phaseserve.gateway.tokenize_routes import detokenize, tokenize
from phaseserve.gateway.ui import add_ui_routes
from phaseserve import __version__

log = structlog.get_logger("gateway")


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    workers = await gw.backend.workers.alive()
    max_len = gw.max_model_len(workers) or None
    body = P.models_response(gw.model_name, gw.created, max_len)
    body["data"] += [P.lora_model_card(a.name, a.path, gw.model_name, gw.created, max_len)
                     for a in await gw.loras.adapters()]
    return web.json_response(body)


async def retrieve_model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    name = request.match_info["model"]
    adapter = await gw.loras.resolve(name)  # 404 for a name that is neither the base model nor an adapter
    max_len = gw.max_model_len(await gw.backend.workers.alive()) or None
    if adapter is not None:
        return web.json_response(P.lora_model_card(adapter.name, adapter.path, gw.model_name, gw.created, max_len))
    return web.json_response(P.model_card(gw.model_name, gw.created, max_len))


async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def _assess(gw: Gateway) -> tuple[Health, list, dict]:
    workers = await gw.backend.workers.alive(max_age_s=0.0)
    stats = await gw.backend.scheduler.stats() or {}
    roles = Counter(w.role for w in workers)
    scheduler_alive = await gw.backend.scheduler.alive()
    return (assess(roles, gw.backend.subscribed.is_set(), scheduler_alive, stats.get("num_workers", 0)),
            workers, stats)


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    verdict, workers, stats = await _assess(gw)
    # live workers by role, and how many the scheduler plans on (a worker it has not adopted yet gets
    # nothing): what `phaseserve up` waits on before it says it serves the layout asked for
    body = {"status": verdict.status, "problems": verdict.problems, "ready": verdict.ready,
            "workers": [w.worker_id for w in workers], "worker_roles": dict(Counter(w.role for w in workers)),
            "scheduler_workers": stats.get("num_workers", 0), "token_channel": gw.backend.subscribed.is_set(),
            "gateway_id": gw.gateway_id,
            # per worker, what it computes with (its heartbeat): for people checking which path serves them
            "worker_info": {w.worker_id: {"role": w.role, "host": w.host, "dtype": w.dtype,
                                          "cpu_level": w.cpu_level, "kernels": w.kernels} for w in workers}}
    return web.json_response(body, status=503 if verdict.status == UNAVAILABLE else 200)


async def health_live(_request: web.Request) -> web.Response:
    return web.json_response({"status": "live"})


async def health_ready(request: web.Request) -> web.Response:
    verdict, _workers, _stats = await _assess(request.app[GATEWAY])
    return web.json_response({"ready": verdict.ready, "problems": verdict.ready_problems},
                             status=200 if verdict.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    stats = await gw.backend.scheduler.stats()
    workers = await gw.backend.workers.alive()
    gw.metrics.set_cluster_state(stats, workers)
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def usage(request: web.Request) -> web.Response:
    """The calling key's own usage: its totals over every gateway, and what it holds on this one now."""
    gw = request.app[GATEWAY]
    key = caller(request)
    totals = await gw.backend.usage.read(key.name)
    body = {"object": "usage", "key": key.name, "tenant": key.tenant.name,
            **{f.name: totals.get(f.name, 0) for f in fields(RequestUsage)},
            "this_gateway": gw.quotas.current(key)}
    return web.json_response(body)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


OPENAPI = web.AppKey("openapi", dict)


def create_app(settings: argparse.Namespace) -> web.Application:
    """The gateway app from parsed settings (`phaseserve.settings.parse("gateway", argv)`)."""
    api_keys = KeyDirectory(load_api_keys(settings), settings.api_keys_file)
    gw = Gateway(settings)
    middlewares = [error_middleware] + ([auth_middleware(api_keys)] if api_keys.required else [])
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[GATEWAY] = gw
    app[MAX_BODY_BYTES] = settings.max_body_bytes
    app[BODY_TIMEOUT] = settings.body_timeout
    app[OPENAPI] = openapi_document(gw.grammars.budgets)
    app[LIVE_VIEW] = live = LiveView(gw.backend, gw.keys, gw.metrics)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # a model id may hold "/" (org/name)
    app.router.add_get("/v1/usage", usage)
    add_lora_routes(app)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/stack/events", stack_events)  # under /v1: keyed like the API
    add_ui_routes(app)

    async def redis_side(app: web.Application):
        await gw.backend.start()
        await gw.loras.add_at_start(settings.lora_modules or [])
        live.start()
        log.info("gateway ready", gateway_id=gw.gateway_id, model=gw.model_name, model_path=gw.model_path,
                 api_keys=len(api_keys))
        watcher = (asyncio.create_task(api_keys.watch(settings.api_keys_reload_interval), name="api-keys")
                   if api_keys.path else None)
        yield
        await live.close()
        if watcher is not None:
            watcher.cancel()
        if gw.background_tasks:  # ended by end_open_requests: let them store their failure while Redis is open
            await asyncio.wait(gw.background_tasks, timeout=5.0)
        await gw.backend.close()
        gw.prompts.close()
        gw.grammars.close()

    app.cleanup_ctx.append(redis_side)

    async def end_open_requests(_app: web.Application) -> None:
        # on shutdown, before the server waits for the handlers: each ends with an error its client sees
        # (an error event then [DONE] in a stream, a 503 otherwise), not a connection cut mid-stream
        gw.backend.fail_open_requests()
        live.end_streams()

    app.on_shutdown.append(end_open_requests)
    return app
