"""The bounds on what one request may hold, in one table.

The request models (gateway/protocol.py and its helpers) take their `max_length` / `le` from here, so
validation, `/openapi.json` (pydantic writes them as maxItems / maximum) and docs/settings.md ("Request
limits", generated from `markdown_table`) say the same numbers. Each bound keeps a request's validation,
its wire size and the per-sequence state it makes (scheduler, worker, gateway) small, whatever a client
sends within --max-body-bytes; OpenAI's own bounds where it has one (128 tools, n, logprobs).

The grammar budgets (choices, grammar and schema bytes, compile time) are settings, not here: an operator
sizes them (phaseserve/settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_N = 16  # n, and best_of
MAX_LOGPROBS = 20  # logprobs (completions), top_logprobs (chat)
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_PROMPTS = 128  # prompts in one completions request
MAX_CHOICES = 256  # sequences in one request: prompts x (best_of or n)
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024  # text parts of one message's content
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message sent back
MAX_DETOKENIZE_TOKENS = 1 << 20


@dataclass(frozen=True)
class Limit:
    field: str  # as the API names it
    value: int
    what: str


LIMITS: tuple[Limit, ...] = (
    Limit("n", MAX_N, "choices a prompt (completions' `best_of` too)"),
    Limit("logprobs / top_logprobs", MAX_LOGPROBS, "alternatives reported a token"),
    Limit("stop", MAX_STOP_STRINGS, "stop strings"),
    Limit("stop_token_ids", MAX_STOP_TOKEN_IDS, "ids, each in the model's vocabulary"),
    Limit("logit_bias", MAX_LOGIT_BIAS, "entries, each id in the model's vocabulary"),
    Limit("prompt", MAX_PROMPTS, "prompts in one completions request"),
    Limit("prompt x n", MAX_CHOICES, "sequences in one request (prompts x `best_of` or `n`)"),
    Limit("messages", MAX_MESSAGES, "messages in one chat request"),
    Limit("messages[].content", MAX_CONTENT_PARTS, "text parts of one message"),
    Limit("messages[].tool_calls", MAX_TOOL_CALLS, "calls of one assistant message"),
    Limit("tools", MAX_TOOLS, "functions (their names distinct)"),
    Limit("tokens (/detokenize)", MAX_DETOKENIZE_TOKENS, "token ids"),
)


def markdown_table() -> str:
    rows = ["| field | at most | of what |", "| --- | --- | --- |"]
    rows += [f"| `{lim.field}` | {lim.value:,} | {lim.what} |" for lim in LIMITS]
    return "\n".join(rows)
