"""What differs between /v1/completions and /v1/chat/completions, one small object per endpoint.

A Generation (gateway/generation.py) is the same for both; it asks its endpoint for the names (the response
id's prefix, the field that holds the prompt, the max-tokens parameter), the default length, the logprobs'
shape, and each choice's form, whole or streamed. The chat endpoint also reads its output back into its
parts (reasoning, content, tool calls) by its ChatPlan.
"""

from __future__ import annotations

from dataclasses import dataclass

from phaseserve.gateway import protocol as P
from phaseserve.gateway.chat_output import ChatOutputReader, WholeOutput, read_whole
from phaseserve.gateway.output import Delta, SequenceOutput, chat_logprobs, completion_logprobs
from phaseserve.gateway.reasoning import ReasoningFormat
from phaseserve.gateway.tools import HermesParser
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import GrammarSpec

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ChatPlan:
    """What a chat request renders and submits, and how its output is read back."""

    prompt_ids: list[int]
    grammar: GrammarSpec | None
    tool_parser: HermesParser | None
    reasoning: ReasoningFormat | None  # the output's thinking is split off by these tags
    reasoning_opened: bool  # the prompt ends inside the thinking (the template opened it)
    grammar_param: str | None = None  # the field that asked for the grammar


class CompletionEndpoint:
    """/v1/completions: text choices, each after its prompt's echo."""

    kind = "completion"
    id_prefix = "cmpl-"
    what = "prompt"  # the field that holds the prompt, as error messages name it
    chunk = staticmethod(P.completion_chunk)

    def __init__(self, req: P.CompletionRequest, grammar: GrammarSpec | None = None, grammar_param: str | None = None):
        self.req = req
        self.grammar, self.grammar_param = grammar, grammar_param  # what the output must follow, who asked

    def requested_max_tokens(self) -> int | None:
        return self.req.max_tokens

    def max_tokens_param(self) -> str:
        return "max_tokens"

    def default_max_tokens(self, room: int) -> int:
        """max_tokens when the request gives none: OpenAI's 16, or what fits."""
        return min(DEFAULT_COMPLETION_MAX_TOKENS, room)

    def logprobs(self, tokenizer: Tokenizer, entries) -> dict | None:
        return completion_logprobs(tokenizer, entries) if self.req.logprobs is not None else None

    def whole_body(self, tokenizer: Tokenizer, response_id: str, created: int, model: str,
                   returned: list[SequenceOutput], echo_of: dict[str, str], usage: dict) -> dict:
        choices = [P.completion_choice(o.index, echo_of[o.seq_id] + o.text, self.logprobs(tokenizer, o.logprobs),
                                       o.finish_reason) for o in returned]
        return P.completion_response(response_id, created, model, choices, usage)

    def opening_choice(self, out: SequenceOutput, echo: str) -> dict | None:
        """A streamed choice's first chunk, before any token: its echo, if it has one."""
        return P.completion_choice(out.index, echo, None, None) if echo else None

    def stream_choice(self, out: SequenceOutput, d: Delta, lp: dict | None) -> dict | None:
        return P.completion_choice(out.index, d.text, lp, d.finish_reason)


class ChatEndpoint:
    """/v1/chat/completions: assistant messages, read back into reasoning, content and tool calls."""

    kind = "chat"
    id_prefix = "chatcmpl-"
    what = "messages"
    chunk = staticmethod(P.chat_chunk)

    def __init__(self, req: P.ChatCompletionRequest, plan: ChatPlan):
        self.req, self.plan = req, plan
        self.grammar, self.grammar_param = plan.grammar, plan.grammar_param
        self._readers: dict[int, ChatOutputReader | None] = {}  # a streamed choice's, by its index

    def requested_max_tokens(self) -> int | None:
        return self.req.requested_max_tokens()

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.req.max_completion_tokens else "max_tokens"

    def default_max_tokens(self, room: int) -> int:
        """As much as fits (vLLM's choice)."""
        return room

    def logprobs(self, tokenizer: Tokenizer, entries) -> dict | None:
        return chat_logprobs(tokenizer, entries) if self.req.logprobs else None

    def read_whole(self, text: str) -> WholeOutput:
        plan = self.plan
        return read_whole(text, plan.tool_parser, plan.reasoning, plan.reasoning_opened)

    def reader(self) -> ChatOutputReader | None:
        """A streamed output's reader (None: its text is all content)."""
        plan = self.plan
        if plan.tool_parser is None and plan.reasoning is None:
            return None
        return ChatOutputReader(plan.tool_parser, plan.reasoning, plan.reasoning_opened)

    def whole_body(self, tokenizer: Tokenizer, response_id: str, created: int, model: str,
                   returned: list[SequenceOutput], echo_of: dict[str, str], usage: dict) -> dict:
        choices = []
        for o in returned:
            whole = self.read_whole(o.text)
            choices.append(P.chat_choice(o.index, whole.content, self.logprobs(tokenizer, o.logprobs),
                                         finish_reason(o.finish_reason, bool(whole.tool_calls)), whole.tool_calls,
                                         whole.reasoning))
        return P.chat_response(response_id, created, model, choices, usage)

    def opening_choice(self, out: SequenceOutput, echo: str) -> dict | None:
        self._readers[out.index] = self.reader()
        return P.chat_chunk_choice(out.index, {"role": "assistant", "content": ""})

    def stream_choice(self, out: SequenceOutput, d: Delta, lp: dict | None) -> dict | None:
        """A chunk's choice (None: all of it held back; it may open a call, or close the thinking)."""
        if out.index not in self._readers:  # a resumed stream: its opening chunks were sent before
            self._readers[out.index] = self.reader()
        reader = self._readers[out.index]
        if reader is None:
            return P.chat_chunk_choice(out.index, {"content": d.text} if d.text else {}, lp, d.finish_reason)
        piece = reader.feed(d.text, final=bool(d.finish_reason))
        delta: dict = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.tool_calls:
            delta["tool_calls"] = piece.tool_calls
        if not delta and lp is None and not d.finish_reason:
            return None
        return P.chat_chunk_choice(out.index, delta, lp, finish_reason(d.finish_reason, reader.num_calls > 0))


Endpoint = CompletionEndpoint | ChatEndpoint


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason of a chat choice that called tools: "tool_calls" where it stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason
