"""A Response's output items and its typed event stream, built from the output's parts as they come (pure).

`ResponseBuilder` is fed OutputPieces (reasoning, content, whole tool calls: gateway/chat_output.py) and
keeps the response's output items: a reasoning item, a message with one output_text part, function_call
items, in the order the model wrote them. Every change is also returned as OpenAI's events, each with its
`sequence_number`: response.created and response.in_progress first; per item output_item.added, its deltas
(reasoning_text / output_text / function_call_arguments), their .done events, output_item.done; and last
response.completed, response.incomplete (max_output_tokens) or response.failed. A whole (not streamed)
response is the same builder with the events dropped, so both forms hold the same items.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses usage: cached_tokens are prompt tokens the prefix cache held; cache_write_tokens the
    rest of the prompt, computed now (its full blocks stay in the cache for the next turn)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens,
                                     "cache_write_tokens": max(0, prompt_tokens - cached_tokens)},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseBuilder:
    def __init__(self, response: dict):
        self.response = response  # the Response object (status, output, usage... filled in as it goes)
        self.items: list[dict] = response["output"]
        self.sequence = 0
        self._open: dict | None = None  # the item deltas go to
        self._blank = ""  # content that is only blank space so far: no message is opened for it

    def _event(self, type_: str, **fields: Any) -> dict:
        ev = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ev

    def start(self) -> list[dict]:
        return [self._event("response.created", response=_snapshot(self.response)),
                self._event("response.in_progress", response=_snapshot(self.response))]

    # ---------------------------------------------------------------- items

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def _begin(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        shown = {**item, "status": "in_progress", "content": []} if "content" in item else dict(item)
        events.append(self._event("response.output_item.added", output_index=index, item=shown))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "",
                                                             "annotations": [], "logprobs": []}))
        return events

    def reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._begin({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
        item = self._open
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self.items.index(item), content_index=0, delta=text))
        return events

    def content(self, text: str) -> list[dict]:
        if self._open is None or self._open["type"] != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return []
            text, self._blank = (self._blank + text).lstrip(), ""
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._begin({"type": "message", "id": new_id("msg"), "role": "assistant",
                                   "status": "in_progress",
                                   "content": [{"type": "output_text", "text": "", "annotations": [],
                                                "logprobs": []}]})
        item = self._open
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self.items.index(item), content_index=0, delta=text, logprobs=[]))
        return events

    def function_call(self, call: dict) -> list[dict]:
        """A whole call (the parser gives calls whole): added, its arguments in one delta, done."""
        self._blank = ""
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
        events = self._begin(item)
        index = self.items.index(item)
        arguments = call["function"]["arguments"]
        item["arguments"] = arguments
        events += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=arguments),
                   self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=arguments)]
        events += self._close()
        return events

    def piece(self, reasoning: str, content: str, tool_calls: list[dict]) -> list[dict]:
        events = self.reasoning(reasoning) + (self.content(content) if content else [])
        for call in tool_calls:
            events += self.function_call(call)
        return events

    # ---------------------------------------------------------------- the end

    def finish(self, status: str, usage_: dict | None, incomplete_reason: str | None = None,
               error: dict | None = None) -> list[dict]:
        events = self._close()
        self.response.update(status=status, usage=usage_, error=error,
                             incomplete_details={"reason": incomplete_reason} if incomplete_reason else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed", "cancelled": "response.failed"}[status]
        events.append(self._event(kind, response=_snapshot(self.response)))
        return events


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def _snapshot(response: dict) -> dict:
    return {**response, "output": [_copy(i) for i in response["output"]]}
