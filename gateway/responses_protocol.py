"""The Responses API's request (`POST /v1/responses`), and its translation into a chat request (pure).

A Responses request is rendered through the chat path: its conversation (a stored previous response's
items, then this request's input items) becomes chat messages, its function tools, `tool_choice` and
`text.format` become the chat request's tools, tool choice and response format, so the chat template,
the grammar enforcement and the tool-call parser are the chat path's own.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from gateway import protocol as P
from gateway.errors import APIError, bad_request
from gateway.protocol import StrictModel


class ContentPart(StrictModel):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(StrictModel):
    """A reasoning item sent back by a client: kept in the conversation, not rendered (templates drop the
    thinking of earlier turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = []
    content: list[ContentPart] | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unsupported"


class _Unsupported(StrictModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> "_Unsupported":
        raise ValueError(f"input items of type '{self.type}' are not supported by this server (it takes "
                         "message, function_call, function_call_output and reasoning items)")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")], Annotated[_Unsupported, Tag("unsupported")]],
                      Discriminator(_item_kind)]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=P.TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(StrictModel):
    """POST /v1/responses"""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="a system message before the conversation (not carried "
                                     "over to a response that continues this one)")
    tools: list[FunctionTool] | None = Field(None, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool = Field(True, description="keep the response (in Redis, --responses-ttl) for GET and "
                        "previous_response_id")
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions, as in chat completions
    seed: int | None = Field(None, ge=P.INT64_MIN, le=P.INT64_MAX)
    logit_bias: P.LogitBias | None = None
    ignore_eos: bool = False

    def input_items(self) -> list[dict]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """A conversation's items as chat messages: consecutive function calls (after the assistant message they
    follow, if any) are one assistant message's tool_calls; a call's output is a tool message."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    previous = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and previous in ("function_call", "assistant"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        if kind != "reasoning":
            previous = "assistant" if kind == "message" and item["role"] == "assistant" else kind
    return messages


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("'text.format' of type 'json_schema' needs a 'schema'", "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def chat_request(req: ResponsesRequest, messages: list[dict]) -> P.ChatCompletionRequest:
    """The chat request that renders and constrains this response (its errors name the Responses fields)."""
    choice = req.tool_choice
    forced = choice == "required" or (choice is not None and not isinstance(choice, str))
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                  for t in req.tools] if req.tools else None,
        "tool_choice": choice if isinstance(choice, str) or choice is None
        else {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": req.parallel_tool_calls,
        # a forced call is this turn's whole output: text.format shapes the text of a later turn (an agent
        # with an output type forces its first tool call with the format set)
        "response_format": None if forced and req.tools else _response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "user": req.user, "seed": req.seed, "logit_bias": req.logit_bias,
        "ignore_eos": req.ignore_eos or None,
    }
    try:
        return P.parse_body(P.ChatCompletionRequest, json.dumps({k: v for k, v in body.items() if v is not None}))
    except APIError as e:  # a conversation the chat path cannot take (e.g. a message with no content)
        raise bad_request(e.message.replace("'messages", "'input"), "input") from None


RESPONSES_PARAMS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}


def responses_error(e: APIError) -> APIError:
    """An error of the chat path, naming the Responses field instead of the chat one."""
    if e.param in RESPONSES_PARAMS:
        e.param = RESPONSES_PARAMS[e.param]
        e.message = e.message.replace("'messages", "'input").replace("'response_format'", "'text.format'")
    return e
