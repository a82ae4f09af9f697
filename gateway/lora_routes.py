"""LoRA adapters served as models (docs/lora.md): the registry every gateway shares in Redis, and vLLM's
endpoints to change it at run time.

POST /v1/load_lora_adapter {"lora_name", "lora_path"} checks the folder (PEFT's adapter_config.json and
adapter_model.safetensors, a served rank and target modules) and adds the name; POST /v1/unload_lora_adapter
{"lora_name"} removes it. Both answer 200 with vLLM's text. A request's `model` naming an adapter runs its
sequences with it; /v1/models lists the adapters with `parent` the base model, as vLLM does. The workers load
an adapter from its folder when a sequence first needs it, so the folder must be readable by every worker
(a shared volume across hosts).
"""

from __future__ import annotations

import structlog
from aiohttp import web
from pydantic import Field

from phaseserve.gateway.errors import APIError, bad_request
from phaseserve.gateway.protocol import StrictModel, parse_body
from phaseserve.gateway.state import GATEWAY

log = structlog.get_logger("gateway.lora")


class LoadLoraAdapterRequest(StrictModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256, description="the model name requests will use")
    lora_path: str = Field(min_length=1, max_length=4096, description="a PEFT adapter folder every worker can read")


class UnloadLoraAdapterRequest(StrictModel):
    """POST /v1/unload_lora_adapter (vLLM's body; its `lora_int_id` is accepted and ignored)."""

    lora_name: str = Field(min_length=1, max_length=256)


async def load_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_body(LoadLoraAdapterRequest, await request.read())
    await gw.loras.check(req.lora_name, req.lora_path)
    if not await gw.loras.add(req.lora_name, req.lora_path):
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    log.info("LoRA adapter loaded", name=req.lora_name, path=req.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_body(UnloadLoraAdapterRequest, await request.read())
    if not await gw.loras.remove(req.lora_name):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "invalid_request_error",
                       "lora_name", "model_not_found")
    log.info("LoRA adapter unloaded", name=req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
