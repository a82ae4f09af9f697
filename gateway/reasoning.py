"""Reasoning output: a model's thinking split from its answer, by the family's tags (pure, no I/O).

Reasoning models write their thinking between tags before the answer: `<think>…</think>` for DeepSeek-R1 and
Qwen3 (--reasoning-parser, as vLLM's flag). Their chat templates often open the tag themselves at the end of
the generation prompt, so whether the output starts inside the thinking is read from the rendered prompt,
not guessed per family. Only the first block is reasoning: a tag written later is content.

`ReasoningSplitter.feed(text)` takes the output as it streams (a tag may arrive split over several tokens) and
returns what of it is reasoning and what is content; text that may be the beginning of a tag is held back
until the next piece says which it is. `split(text)` does a whole output at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from phaseserve.gateway.tools import partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's tags."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the model inside its thinking (the template opened the tag)."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start)

    def splitter(self, opened: bool) -> "ReasoningSplitter":
        return ReasoningSplitter(self, opened)

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content) of a whole output."""
        s = self.splitter(opened)
        reasoning, content = s.feed(text)
        r2, c2 = s.finish()
        reasoning += r2
        return (reasoning if s.reasoned else None), content + c2


FORMATS = {"deepseek_r1": ReasoningFormat("deepseek_r1"), "qwen3": ReasoningFormat("qwen3")}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """--reasoning-parser's value -> its format (None: the model's output is all content)."""
    return FORMATS.get(name or "none")


# before: the output may still open the thinking; closed: just after the end tag (the blank space a model
# writes between thinking and answer is dropped, however they are cut into pieces)
_BEFORE, _INSIDE, _CLOSED, _AFTER = "before", "inside", "closed", "after"


class ReasoningSplitter:
    """One output's stream of text -> (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.state = _INSIDE if opened else _BEFORE
        self.reasoned = opened  # the output has a reasoning part (possibly empty)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = "", ""
        while self.held:
            if self.state == _BEFORE:
                # only a tag at the very start (after blank space) opens the thinking
                stripped = self.held.lstrip()
                if stripped.startswith(self.fmt.start):
                    self.held = stripped[len(self.fmt.start):]
                    self.state, self.reasoned = _INSIDE, True
                    continue
                if not stripped or self.fmt.start.startswith(stripped):
                    break  # blank, or a beginning of the tag: wait for more
                self.state = _AFTER
            elif self.state == _INSIDE:
                i = self.held.find(self.fmt.end)
                if i >= 0:
                    reasoning += self.held[:i]
                    self.held = self.held[i + len(self.fmt.end):]
                    self.state = _CLOSED
                    continue
                keep = partial_suffix(self.held, self.fmt.end)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            elif self.state == _CLOSED:
                self.held = self.held.lstrip()
                if self.held:
                    self.state = _AFTER
            else:
                content += self.held
                self.held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what is held back is reasoning if the thinking was open, else content."""
        rest, self.held = self.held, ""
        return (rest, "") if self.state == _INSIDE else ("", rest)

