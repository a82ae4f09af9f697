"""The OpenAPI 3.1 document of the gateway (request schemas come from the pydantic models, with the bounds of
gateway/limits.py as maxItems / maximum; the grammar budgets, which are settings, are written in here)."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from phaseserve.gateway.lora_routes import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from phaseserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from phaseserve.gateway.responses_protocol import ResponsesRequest
from phaseserve.gateway.structured import GrammarBudgets
from phaseserve.gateway.tokenize_routes import DetokenizeRequest, TokenizeRequest
from phaseserve import __version__

_REF = "#/components/schemas/{model}"


def _json(schema_ref: str | dict, description: str) -> dict:
    schema = {"$ref": schema_ref} if isinstance(schema_ref, str) else schema_ref
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse(description: str) -> dict:
    return {"description": description, "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def _with_grammar_budgets(request: dict, budgets: GrammarBudgets) -> None:
    """The grammar fields of a request schema with this server's budgets (bytes are UTF-8: a string within
    maxLength characters may still be over)."""
    props = request["properties"]
    for variant in props["guided_choice"]["anyOf"]:
        if variant.get("type") == "array":
            variant["maxItems"] = budgets.max_choices
    for name in ("guided_regex", "guided_grammar"):
        for variant in props[name]["anyOf"]:
            if variant.get("type") == "string":
                variant["maxLength"] = budgets.max_grammar_bytes
    props["guided_choice"]["description"] = (f"at most {budgets.max_choices} options, "
                                             f"{budgets.max_grammar_bytes} bytes together")
    props["guided_regex"]["description"] = f"at most {budgets.max_grammar_bytes} bytes"
    props["guided_grammar"]["description"] = (f"a Lark grammar (llguidance's dialect), at most "
                                              f"{budgets.max_grammar_bytes} bytes")
    schema_note = (f"; a JSON schema is at most {budgets.max_schema_bytes} bytes and may not set `x-guidance` "
                   "(the grammar engine's options are the server's)")
    for name in ("response_format", "structured_outputs", "guided_json"):
        props[name]["description"] = props[name].get("description", "a JSON schema") + schema_note


def openapi_document(budgets: GrammarBudgets | None = None) -> dict:
    budgets = budgets or GrammarBudgets.defaults()
    _, defs = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                                              ResponsesRequest, TokenizeRequest, DetokenizeRequest,
                                                              LoadLoraAdapterRequest, UnloadLoraAdapterRequest)],
                                 ref_template=_REF)
    schemas = dict(defs.get("$defs", {}))
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        _with_grammar_budgets(schemas[request], budgets)
    schemas["Error"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    }
    counts = {k: {"type": "integer"} for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")}
    holding = {"type": "object", "properties": {
        "in_flight": {"type": "integer"}, "queued_prompt_tokens": {"type": "integer"},
        "tokens_last_minute": {"type": ["integer", "null"]},
        "limits": {"type": "object", "properties": {k: {"type": ["integer", "null"]} for k in (
            "max_concurrent_requests", "tokens_per_minute", "max_queued_prompt_tokens")}}}}
    schemas["Usage"] = {
        "type": "object", "required": ["object", "key", "tenant", *counts],
        "properties": {"object": {"const": "usage"}, "key": {"type": "string"}, "tenant": {"type": "string"},
                       **counts, "this_gateway": {"type": "object", "properties": {"tenant": holding,
                                                                                   "key": holding}}}}
    errors = {str(code): _json("#/components/schemas/Error", why) for code, why in (
        (400, "invalid request (a list over its bound, a grammar over its budgets or refused by the engine), or "
              "a prompt (plus max_tokens) longer than the context: in tokens, or in characters before it is "
              "tokenized (code context_length_exceeded)"), (404, "unknown model"), (413, "body too large"),
        (401, "a key is required (`--api-key`, `--api-keys-file`) and none, or an unknown one, was given"),
        (408, "the body did not arrive within --body-timeout (the connection is then closed)"),
        (429, "too many requests in flight, a tenant's or key's limit reached (concurrent requests, tokens per "
              "minute, queued prompt tokens; the message names it, `Retry-After` says when to retry), or a "
              "grammar of the same client still being checked"),
        (503, "no worker alive, Redis unavailable, or every grammar check thread busy"))}

    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    not_found = _json("#/components/schemas/Error", "unknown, expired, or created with another API key")

    def generation(summary: str, schema: str) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=schema)}}}},
            "responses": {"200": {"description": "the completion (JSON), or SSE chunks ending in `data: [DONE]` "
                                  "when `stream` is true",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **errors},
        }}

    def post_json(summary: str, schema: str, answer: str, statuses: tuple[int, ...]) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": _REF.format(model=schema)}}}},
                         "responses": {"200": _json({"type": "object"}, answer),
                                       **{str(c): errors[str(c)] for c in statuses}}}}

    def post_text(summary: str, schema: str, statuses: tuple[int, ...]) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": _REF.format(model=schema)}}}},
                         "responses": {"200": {"description": "done: vLLM's `Success: ...` text",
                                               "content": {"text/plain": {"schema": {"type": "string"}}}},
                                       **{str(c): errors[str(c)] for c in statuses}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "phaseserve gateway", "version": __version__,
                 "description": "OpenAI-compatible completions and chat completions, with structured outputs "
                                "(`response_format`, vLLM's `structured_outputs` / `guided_*`) and tool calls "
                                "(`tools`, `tool_choice`) enforced while sampling; the Responses API with conversations "
                                "stored in Redis; a reasoning model's thinking as `reasoning_content` "
                                "(--reasoning-parser)."},
        "paths": {
            "/v1/completions": generation("Create a text completion", "CompletionRequest"),
            "/v1/chat/completions": generation("Create a chat completion", "ChatCompletionRequest"),
            "/v1/usage": {"get": {
                "summary": "The calling key's own usage: requests, prompt, cached and completion tokens over every "
                           "gateway, and what it and its tenant hold on this one against their limits",
                "responses": {"200": _json({"$ref": "#/components/schemas/Usage"}, "the key's usage"),
                              "401": errors["401"]}}},
            "/v1/responses": generation("Create a response (OpenAI's Responses API): input items, function tools, "
                                        "`text.format`, `previous_response_id`; SSE typed events when `stream` "
                                        "is true", "ResponsesRequest"),
            "/v1/responses/{response_id}": {
                "get": {"summary": "A stored response (only with the API key that created it)",
                        "parameters": [response_id], "responses": {"200": _json({"type": "object"}, "the Response"),
                                                                   "404": not_found}},
                "delete": {"summary": "Delete a stored response", "parameters": [response_id],
                           "responses": {"200": _json({"type": "object"}, "{id, object: response.deleted, deleted}"),
                                         "404": not_found}}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a stored response while it runs (from any gateway)", "parameters": [response_id],
                "responses": {"200": _json({"type": "object"}, "the Response, status cancelled"),
                              "400": _json("#/components/schemas/Error", "the response has ended"),
                              "404": not_found}}},
            "/v1/models": {"get": {"summary": "List the served model and its LoRA adapters",
                                   "responses": {"200": _json({"type": "object"}, "model list")}}},
            "/v1/models/{model}": {"get": {
                "summary": "The served model's card, or a LoRA adapter's",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json({"type": "object"}, "model card"), "404": errors["404"]}}},
            "/tokenize": post_json("Tokenize a prompt, or messages through the chat template (vLLM's shape)",
                                   "TokenizeRequest", "{count, max_model_len, tokens, token_strs}",
                                   (400, 404, 408, 413)),
            "/detokenize": post_json("Token ids to text (vLLM's shape)", "DetokenizeRequest", "{prompt}",
                                     (400, 404, 408, 413)),
            "/v1/load_lora_adapter": post_text(
                "Serve a LoRA adapter (a PEFT folder every worker can read) as the model `lora_name` (vLLM's)",
                "LoadLoraAdapterRequest", (400, 413)),
            "/v1/unload_lora_adapter": post_text("Stop serving the LoRA adapter `lora_name` (vLLM's)",
                                                 "UnloadLoraAdapterRequest", (400, 404, 413)),
            "/version": {"get": {"summary": "The server's version",
                                 "responses": {"200": _json({"type": "object"}, "{version}")}}},
            "/health": {"get": {"summary": "The stack as this gateway sees it: ok or degraded (200, with the "
                                           "problems), unavailable (503: no live worker or token channel)",
                                "responses": {"200": _json({"type": "object"}, "ok or degraded"),
                                              "503": _json({"type": "object"}, "unavailable")}}},
            "/health/live": {"get": {"summary": "Liveness: the gateway answers",
                                     "responses": {"200": _json({"type": "object"}, "live")}}},
            "/health/ready": {"get": {"summary": "Readiness: a live scheduler plans on a live worker and the "
                                                 "token channel is subscribed",
                                      "responses": {"200": _json({"type": "object"}, "ready"),
                                                    "503": _json({"type": "object"}, "not ready, and why")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document",
                                      "responses": {"200": _json({"type": "object"}, "OpenAPI document")}}},
        },
        "components": {"schemas": schemas},
    }
