"""Tool calling in chat: the conversation checks, the prompt, the forced-call grammar, and the output parser.

`plan_tools` turns a chat request's `tools` / `tool_choice` and its messages into what the gateway renders
and submits (pure; malformed forms are 400s naming their field):
- the tools go to the chat template as `tools` when the template uses them; a template that knows nothing
  of tools (ours, SmolLM2's) gets the parser's own system prompt instead, and the assistant calls and tool
  results of the conversation written in the parser's format;
- `tool_choice` "required" or a named function becomes a grammar (the parser's call format with each
  function's parameters as a JSON schema), so the model's call always parses and its arguments validate;
  "auto" leaves the model free and parses what it writes; "none" renders no tools and parses nothing.

A parser (chosen by --tool-call-parser, as vLLM's flag) knows one family's format. `hermes`:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5's and Hermes' format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from phaseserve.gateway.errors import bad_request
from phaseserve import grammar
from phaseserve.wire import GrammarSpec


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, id: str | None = None) -> dict:
    """One entry of message.tool_calls, OpenAI's shape."""
    return {"id": id or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class HermesParser:
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one per call."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    # ---- the prompt, for templates that do not render tools themselves

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(f'{self.START}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                         f'{c["function"]["arguments"]}}}\n{self.END}' for c in calls)

    def format_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    # ---- the forced call

    def forced_grammar(self, functions: list[dict]) -> GrammarSpec:
        """Exactly one call, of one of `functions`, whose arguments follow that function's parameters."""
        rules, names = [], []
        for i, f in enumerate(functions):
            schema = {**(f.get("parameters") or {"type": "object"}),
                      grammar.ENGINE_OPTIONS_KEY: grammar.JSON_OPTIONS}  # the client's may not set it (plan_tools)
            head = grammar.lark_string(f'{{"name": {json.dumps(f["name"])}, "arguments": ')
            rules.append(f"fn{i}: {head} args{i} \"}}\"\nargs{i}: %json {json.dumps(schema, ensure_ascii=False)}")
            names.append(f"fn{i}")
        start = (f'start: {grammar.lark_string(self.START + chr(10))} ({" | ".join(names)}) '
                 f'{grammar.lark_string(chr(10) + self.END)}')
        return GrammarSpec("lark", "\n".join([start, *rules]))

    # ---- the output

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole output. A call that does not parse stays in the content."""
        calls: list[dict] = []
        kept: list[str] = []
        last = 0
        for m in self._CALL.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return (content or None) if calls else content, calls

    @staticmethod
    def _call(body: str) -> dict | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def stream(self) -> "StreamingToolParser":
        return StreamingToolParser(self)


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # delta.tool_calls entries (with their index)


class StreamingToolParser:
    """Text deltas in, content deltas and whole tool calls out: text that may begin a call is held back
    until the call closes (then it goes out as one delta.tool_calls entry, arguments whole) or the output
    ends (then it was content after all)."""

    def __init__(self, parser: HermesParser):
        self.parser = parser
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        out = ToolDelta()
        start, end = self.parser.START, self.parser.END
        while True:
            i = self.buffer.find(start)
            if i < 0:
                keep = partial_suffix(self.buffer, start)
                out.content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            j = self.buffer.find(end, i)
            if j < 0:  # a call has begun: hold it
                out.content += self.buffer[:i]
                self.buffer = self.buffer[i:]
                return out
            call = self.parser._call(self.buffer[i + len(start):j].strip())
            if call is None:
                out.content += self.buffer[:j + len(end)]
            else:
                out.content += self.buffer[:i]
                out.tool_calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            self.buffer = self.buffer[j + len(end):]
            if self.num_calls and not out.content.strip():
                out.content = ""

    def finish(self) -> ToolDelta:
        """The output ended: what is held back is content."""
        rest, self.buffer = self.buffer, ""
        return ToolDelta(rest)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


PARSERS = {"hermes": HermesParser}


@dataclass
class ToolPlan:
    messages: list[dict]  # for the chat template
    template_kwargs: dict[str, Any]
    grammar: GrammarSpec | None  # a forced call
    parser: HermesParser | None  # parse calls out of the output


def plan_tools(req, messages: list[dict], parser: HermesParser, template_source: str) -> ToolPlan:
    """What to render and submit for a chat request's tools (see the module's docstring)."""
    _check_conversation(messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    for i, t in enumerate(tools):
        try:
            grammar.refuse_engine_options(t["function"].get("parameters") or {})
        except grammar.GrammarError as e:
            raise bad_request(f"'tools[{i}].function.parameters': {e}", "tools") from None
    names = [t["function"]["name"] for t in tools]
    dup = sorted(n for n, count in Counter(names).items() if count > 1)
    if dup:
        raise bad_request(f"'tools' has more than one function named {', '.join(map(repr, dup[:5]))}", "tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not isinstance(choice, str):  # a named function
        if choice.function.name not in set(names):
            raise bad_request(f"'tool_choice' names the function {choice.function.name!r}, which is not in 'tools' "
                              f"({', '.join(map(repr, names[:10])) or 'none given'}"
                              f"{', ...' if len(names) > 10 else ''})", "tool_choice")
    elif choice == "required" and not tools:
        raise bad_request("'tool_choice' is 'required' but the request has no 'tools'", "tool_choice")
    uses_tools = choice != "none" and bool(tools)
    template_knows_tools = "tools" in template_source
    rendered = _arguments_as_objects(messages) if template_knows_tools else _in_parser_format(messages, parser)
    kwargs: dict[str, Any] = {}
    if uses_tools:
        if template_knows_tools:
            kwargs["tools"] = tools
        else:
            rendered = _with_system_prompt(rendered, parser.system_prompt(tools))
    forced = None
    if choice == "required":
        forced = parser.forced_grammar([t["function"] for t in tools])
    elif not isinstance(choice, str):
        forced = parser.forced_grammar([t["function"] for t in tools if t["function"]["name"] == choice.function.name])
    return ToolPlan(rendered, kwargs, forced, parser if uses_tools else None)


def _check_conversation(messages: list[dict]) -> None:
    """Every tool message answers a call of the assistant message before it (tool messages between)."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "tool":
            if m.get("tool_call_id") not in open_calls:
                raise bad_request(f"'messages[{i}]' is a tool result for the call {m.get('tool_call_id')!r}, but no "
                                  "assistant message with that call in 'tool_calls' comes before it", "messages")
            continue
        open_calls = {c["id"] for c in m.get("tool_calls") or []} if role == "assistant" else set()


def _arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Calls' JSON arguments as objects, as templates that render tool calls expect (vLLM does the same)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _json_or_text(
                c["function"]["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _in_parser_format(messages: list[dict], parser: HermesParser) -> list[dict]:
    """Assistant calls and tool results written as text in the parser's format (for a template that renders
    only roles and contents)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = _text(m.get("content"))
            calls = parser.format_calls(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": parser.format_result(_text(m.get("content")))})
        else:
            out.append(m)
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content or ""


def _with_system_prompt(messages: list[dict], prompt: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{_text(first.get('content'))}\n\n{prompt}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
