"""The completions `prompt` field in OpenAI's shapes: a string, an array of token ids, or an array of
either (several prompts in one request; choice `i * n + j` is the j-th of prompt i).

`check_shape` turns pydantic's error for a union of four shapes into one sentence naming `prompt`;
`prompt_list` gives every shape as a list of prompts; `check_choice_count` bounds prompts x choices.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationError

from phaseserve.gateway.limits import MAX_CHOICES, MAX_PROMPTS

INT64_MAX = (1 << 63) - 1

_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)]
_Text = Annotated[str, Field(min_length=1)]
CompletionPrompt = (_Text | _TokenIds | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)]
                    | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])

SHAPES = ("a non-empty string, a non-empty array of token ids (integers >= 0), or an array of at most "
          f"{MAX_PROMPTS} of either")


def check_shape(value: Any, handler) -> Any:
    """A wrap validator: the prompt as parsed, or one ValueError that names the field and its shapes."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"'prompt' must be {SHAPES}") from None


def check_choice_count(prompts: int, per_prompt: int) -> None:
    if prompts * per_prompt > MAX_CHOICES:
        raise ValueError(f"'prompt' has {prompts} prompts x {per_prompt} choices each = {prompts * per_prompt} "
                         f"sequences; at most {MAX_CHOICES} in one request")


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """Every prompt of the field, in order."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)
