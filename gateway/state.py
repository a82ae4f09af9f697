"""What one gateway process holds: settings, the model's text side, the Redis backend, metrics."""

from __future__ import annotations

import argparse
import os
import time
import uuid

from aiohttp import web

from phaseserve.gateway.backend import Backend
from phaseserve.gateway.token_delivery import DeliveryConfig
from phaseserve.gateway.metrics import GatewayMetrics
from phaseserve.gateway.lora_registry import LoraRegistry
from phaseserve.gateway.prompt_encoder import PromptEncoder
from phaseserve.gateway.quotas import Quotas
from phaseserve.gateway.structured import GrammarBudgets, GrammarChecker
from phaseserve.gateway.reasoning import reasoning_format
from phaseserve.gateway.responses_store import ResponseStore
from phaseserve.gateway.tools import PARSERS
from phaseserve import redis_url
from phaseserve.kv_admission import KVCapacity
from phaseserve.models.model_files import read_json
from phaseserve.settings import resolve_model
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import GrammarSpec, Keys, WorkerInfo


class Gateway:
    def __init__(self, settings: argparse.Namespace):
        if not settings.redis_url:
            raise SystemExit("phaseserve gateway: --redis-url (or REDIS_URL) is required")
        self.settings = settings
        model = resolve_model(settings.model, "phaseserve gateway", settings.cache_dir)
        self.model_path = model.path
        self.model_name = settings.served_model_name or model.name
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        self.prompts = PromptEncoder(self.tokenizer)
        self.grammars = GrammarChecker(self.tokenizer, GrammarBudgets.from_settings(settings))
        self.tool_parser = PARSERS[settings.tool_call_parser]()
        self.reasoning = reasoning_format(settings.reasoning_parser)
        config = read_json(os.path.join(self.model_path, "config.json"))
        self.config_max_len = int(config.get("max_position_embeddings") or 0)
        self.gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.keys = Keys(settings.key_prefix)
        self.backend = Backend(settings.redis_url, self.keys, self.gateway_id,
                               max_connections=settings.redis_max_connections,
                               pool_timeout=settings.redis_pool_timeout,
                               wait_replicas=redis_url.wait_replicas(settings.redis_url, settings.redis_wait_replicas),
                               wait_timeout_s=settings.redis_wait_timeout,
                               delivery=DeliveryConfig(settings.token_silence_timeout,
                                                       settings.request_progress_timeout,
                                                       settings.client_lease_ttl, settings.resume_grace))
        self.background_tasks: set = set()  # background responses generating here (kept referenced)
        self.responses = ResponseStore(self.backend.redis, self.keys, settings.responses_ttl,
                                       self.backend.submissions.replicas_to_wait_for,
                                       self.backend.submissions.wait_timeout_ms)
        self.metrics = GatewayMetrics(self.model_name)
        self.loras = LoraRegistry(self.backend.redis, self.keys.lora_adapters(), self.model_name,
                                  settings.max_lora_rank)
        self.max_in_flight = settings.max_waiting_requests
        self.in_flight = 0
        self.max_queued_prompt_tokens = settings.max_queued_prompt_tokens
        self.queued_prompt_tokens = 0  # prompt tokens (x n) of requests waiting for their first token
        self.quotas = Quotas(settings.retry_after)  # each tenant's and key's limits (docs/tenants.md)
        self.created = int(time.time())

    async def check_grammar(self, spec: GrammarSpec, param: str, client=None) -> None:
        """Prove a request's grammar before it is enqueued (a 400 naming `param` if the engine refuses it, or
        it is over a budget); `client` has one proof at a time."""
        self.metrics.grammar_compile.observe(await self.grammars.check(spec, param, client))

    def max_model_len(self, workers: list[WorkerInfo]) -> int:
        """The longest sequence every live worker accepts, capped by --max-model-len when set."""
        limits = [w.max_model_len for w in workers if w.max_model_len > 0]
        if self.settings.max_model_len > 0:
            limits.append(self.settings.max_model_len)
        if not limits and self.config_max_len:
            limits.append(self.config_max_len)
        return min(limits) if limits else 0

    @staticmethod
    def kv_capacities(workers: list[WorkerInfo]) -> list[KVCapacity]:
        """Each live worker's KV cache, as the scheduler admits by (its policies run with the default watermark)."""
        return [KVCapacity(w.num_blocks, w.block_size, w.max_model_len) for w in workers
                if w.num_blocks > 0 and w.block_size > 0 and w.max_model_len > 0]


GATEWAY = web.AppKey("gateway", Gateway)
