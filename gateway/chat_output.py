"""A chat output read back as its parts: reasoning (a reasoning model's thinking), content, tool calls.

The reasoning splitter takes the text first (the thinking comes before the answer); what it calls content
goes through the tool-call parser when the request has tools. Chat completions and the Responses API read
their outputs through here, whole or as they stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.gateway.reasoning import ReasoningFormat
from phaseserve.gateway.tools import HermesParser


@dataclass
class OutputPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # whole calls, each with its "index"


class ChatOutputReader:
    """One output's text deltas in, its parts out (held back where a tag or a call may be beginning)."""

    def __init__(self, tool_parser: HermesParser | None, reasoning: ReasoningFormat | None, opened: bool):
        self.splitter = reasoning.splitter(opened) if reasoning is not None else None
        self.calls = tool_parser.stream() if tool_parser is not None else None

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls if self.calls is not None else 0

    def feed(self, text: str, final: bool = False) -> OutputPiece:
        piece = OutputPiece()
        content = text
        if self.splitter is not None:
            piece.reasoning, content = self.splitter.feed(text)
            if final:
                reasoning, rest = self.splitter.finish()
                piece.reasoning += reasoning
                content += rest
        if self.calls is None:
            piece.content = content
            return piece
        delta = self.calls.feed(content)
        if final:
            delta.content += self.calls.finish().content
        piece.content, piece.tool_calls = delta.content, delta.tool_calls
        return piece


@dataclass
class WholeOutput:
    reasoning: str | None  # None: the output has no reasoning part
    content: str | None  # None: only tool calls
    tool_calls: list[dict]


def read_whole(text: str, tool_parser: HermesParser | None, reasoning: ReasoningFormat | None,
               opened: bool) -> WholeOutput:
    thinking, content = reasoning.split(text, opened) if reasoning is not None else (None, text)
    if tool_parser is None:
        return WholeOutput(thinking, content, [])
    answer, calls = tool_parser.parse(content)
    return WholeOutput(thinking, answer, calls)
