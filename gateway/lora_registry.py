"""The LoRA adapters the stack serves as models, shared by every gateway in one Redis hash (Keys.lora_adapters):
name -> LoraRef. gateway/lora_routes.py changes it at run time; a request's `model` is resolved here."""

from __future__ import annotations

import asyncio

import msgpack
import structlog

from phaseserve.gateway.errors import APIError, bad_request, model_not_found
from phaseserve.lora import LoraError, parse_lora_module, read_adapter_config
from phaseserve.wire import LoraRef

log = structlog.get_logger("gateway.lora")


class LoraRegistry:
    """The adapters the stack serves, name -> LoraRef, in one Redis hash (Keys.lora_adapters)."""

    def __init__(self, redis, key: str, base_model: str, max_rank: int):
        self.redis, self.key, self.base_model, self.max_rank = redis, key, base_model, max_rank

    async def resolve(self, model: str | None) -> LoraRef | None:
        """The adapter a request's `model` names; None for the base model (or no model); 404 otherwise."""
        if model is None or model == self.base_model:
            return None
        raw = await self.redis.hget(self.key, model)
        if raw is None:
            raise model_not_found(model)
        return LoraRef.from_dict(msgpack.unpackb(raw))

    async def adapters(self) -> list[LoraRef]:
        raw = await self.redis.hgetall(self.key)
        return sorted((LoraRef.from_dict(msgpack.unpackb(v)) for v in raw.values()), key=lambda r: r.name)

    async def check(self, name: str, path: str) -> None:
        """400 naming the field for a name the base model has, or a folder that is no adapter served here."""
        if name == self.base_model:
            raise bad_request(f"'{name}' is the base model's name; an adapter needs another.", "lora_name")
        try:
            await asyncio.to_thread(read_adapter_config, path, self.max_rank)
        except LoraError as e:
            raise bad_request(f"Invalid LoRA adapter: {e}", "lora_path") from None

    async def add(self, name: str, path: str) -> bool:
        """Adds it; False when the name is taken."""
        return bool(await self.redis.hsetnx(self.key, name, msgpack.packb(LoraRef(name, path).to_dict())))

    async def remove(self, name: str) -> bool:
        return bool(await self.redis.hdel(self.key, name))

    async def add_at_start(self, specs: list[str]) -> None:
        """--lora-modules: each checked and (re)registered under its name (a restart keeps serving it)."""
        for spec in specs:
            name, path = parse_lora_module(spec)
            try:
                await self.check(name, path)
            except APIError as e:
                raise SystemExit(f"--lora-modules {spec!r}: {e.message}") from None
            await self.redis.hset(self.key, name, msgpack.packb(LoraRef(name, path).to_dict()))
            log.info("LoRA adapter served", name=name, path=path)
