"""OpenAI request bodies (parsed and validated with pydantic, strict types) and response shapes.

Parsing never raises anything but APIError(400): malformed JSON, a missing or
ill-typed field, an out-of-range value -- each names the offending `param`.
Response builders return plain dicts in exactly the OpenAI shapes.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from phaseserve.gateway.best_of import check_request as check_best_of
from phaseserve.gateway.completion_prompts import CompletionPrompt, check_choice_count, check_shape, prompt_list
from phaseserve.gateway.errors import APIError, bad_request
from phaseserve.gateway.limits import (MAX_CONTENT_PARTS, MAX_LOGPROBS, MAX_MESSAGES, MAX_N, MAX_STOP_STRINGS,
                            MAX_STOP_TOKEN_IDS, MAX_TOOL_CALLS, MAX_TOOLS)
from phaseserve.gateway.logit_bias import LogitBias, by_token_id, check_keys, check_vocabulary
from phaseserve.params import InvalidParams, SamplingParams

# Integers travel as msgpack and torch int64: a wider one is a 400 naming the field, not a failure later.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The names the server renders a chat template with itself (and encode_chat's own arguments).
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "template_name", "self")


class StrictModel(BaseModel):
    # strict: no "0.5" -> 0.5 or true -> 1 coercions; unknown fields are ignored as OpenAI's SDKs send extras
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk has the "
                                         "usage of its choice so far")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    # an assistant's calls, sent back with the tools' results
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message has 'tool_calls'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id' (the id of the call it answers)")
        return self


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _SamplingFields(StrictModel):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="below 1e-5 (0 included): greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"at most {MAX_STOP_TOKEN_IDS} ids, each in the model's vocabulary")
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="vLLM's: requests share cached prefix blocks only with the same "
                                               "salt (and tenant)")
    min_tokens: int = Field(0, ge=0)
    logit_bias: LogitBias | None = None
    # structured outputs (gateway/structured.py reads them): OpenAI's, then vLLM's extras
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}')
    structured_outputs: dict[str, Any] | None = Field(
        None, description='vLLM: one of {"json": schema, "regex": str, "choice": [str], "grammar": lark, '
                          '"json_object": true}')
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")

    @model_validator(mode="after")
    def _unsupported(self) -> "_SamplingFields":
        check_keys(self.logit_bias)
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        return self

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the request names must be in the model's vocabulary (400 naming the field)."""
        outside = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if outside:
            raise bad_request(f"'stop_token_ids' has token ids outside the vocabulary (size {vocab_size}): "
                              f"{outside[:5]}", "stop_token_ids")
        check_vocabulary(self.logit_bias, vocab_size)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def choices_per_prompt(self) -> int:
        """Sequences generated for each prompt: n, or best_of when the n best of more are returned."""
        return self.n


class CompletionRequest(_SamplingFields):
    """POST /v1/completions"""

    prompt: CompletionPrompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generates best_of sequences a prompt and "
                                "returns the n with the highest cumulative logprob (not with `stream`)")

    _prompt_shape = field_validator("prompt", mode="wrap")(check_shape)

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("'suffix' (insertion after the completion) is not supported by this server; "
                             "send the request without it")
        if self.echo and self.logprobs is not None:
            raise ValueError("'echo' together with 'logprobs' (prompt logprobs) is not supported")
        check_best_of(self.n, self.best_of, self.stream)
        check_choice_count(len(self.prompts), self.choices_per_prompt)
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    @property
    def choices_per_prompt(self) -> int:
        return self.best_of or self.n

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions"""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # given to the chat template as `reasoning_effort` when the template reads it (else accepted and ignored)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="passed to the chat template when the template reads `reasoning_effort`")

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs': true")
        clash = [k for k in self.chat_template_kwargs or {} if k in RESERVED_TEMPLATE_KWARGS]
        if clash:
            raise ValueError(f"'chat_template_kwargs' may not set {', '.join(map(repr, clash))}: the server "
                             f"sets {', '.join(RESERVED_TEMPLATE_KWARGS)} itself (use the request's own fields)")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _error_param(loc: tuple) -> tuple[str | None, str]:
    """pydantic's error location -> (top-level param, readable path like messages[0].role)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():  # skips union tags such as 'list[int]'
            if part in ("str", "int", "float", "bool", "list", "dict") or part[:1].isupper():
                continue
            path += f".{part}" if path else part
    top = loc[0] if loc and isinstance(loc[0], str) and loc[0].isidentifier() else None
    return top, path


def parse_body(model: type[StrictModel], raw: bytes) -> Any:
    """Raw body -> validated request model, or APIError(400) naming the field."""
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"Malformed JSON body: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise bad_request("The request body must be a JSON object.") from None
        param, path = _error_param(tuple(first["loc"]))
        msg = first["msg"]
        if first["type"] == "missing":
            raise bad_request(f"Missing required field '{path}'.", param) from None
        if first["type"] == "value_error":  # our own validators: the message names the field
            msg = msg.removeprefix("Value error, ")
            raise bad_request(msg, param or _quoted_param(msg)) from None
        raise bad_request(f"Invalid value for '{path}': {msg}." if path else f"Invalid request: {msg}.", param) \
            from None


def _quoted_param(msg: str) -> str | None:
    if msg.startswith("'") and "'" in msg[1:]:
        return msg[1:msg.index("'", 1)]
    return None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """Request fields -> SamplingParams (validated: InvalidParams -> 400 naming the param)."""
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if req.temperature is None else float(req.temperature),
        top_p=defaults.top_p if req.top_p is None else float(req.top_p),
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        min_p=defaults.min_p if req.min_p is None else float(req.min_p),
        presence_penalty=defaults.presence_penalty if req.presence_penalty is None else float(req.presence_penalty),
        frequency_penalty=(defaults.frequency_penalty if req.frequency_penalty is None
                           else float(req.frequency_penalty)),
        repetition_penalty=(defaults.repetition_penalty if req.repetition_penalty is None
                            else float(req.repetition_penalty)),
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=req.requested_logprobs(),
        min_tokens=req.min_tokens,
        logit_bias=by_token_id(req.logit_bias),
    )
    try:
        return params.validate()
    except InvalidParams as e:
        raise bad_request(str(e), e.param) from None


# --------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # prompt tokens whose KV the prefix cache held (OpenAI's field)
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def now() -> int:
    return int(time.time())


def completion_response(id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(id: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
                     include_usage: bool = False) -> dict:
    chunk = {"id": id, "object": "text_completion", "created": created, "model": model,
             "system_fingerprint": None, "choices": choices}
    if include_usage:  # OpenAI: every chunk has "usage" (null) when usage was asked for
        chunk["usage"] = usage_
    return chunk


def chat_response(id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage_}


def chat_choice(index: int, content: str | None, logprobs: dict | None, finish_reason: str | None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:  # a reasoning model's thinking (--reasoning-parser), as vLLM and DeepSeek name it
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(id: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
               include_usage: bool = False) -> dict:
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None, "choices": choices}
    if include_usage:
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(index: int, delta: dict, logprobs: dict | None = None,
                      finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(model: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": model, "object": "model", "created": created, "owned_by": "phaseserve", "root": model,
            "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return card


def lora_model_card(name: str, path: str, base_model: str, created: int, max_model_len: int | None) -> dict:
    """A LoRA adapter's card, as vLLM writes it: `root` its folder, `parent` the base model."""
    return {**model_card(name, created, max_model_len), "root": path, "parent": base_model}


def models_response(model: str, created: int, max_model_len: int | None) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def error_chunk(err: APIError) -> dict:
    return err.body()
