"""Structured outputs at the gateway: which grammar a request asks for, and whether the engine takes it.

`requested_grammar` reads OpenAI's `response_format` and vLLM's extras (`structured_outputs`, `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) into one GrammarSpec (pure; a malformed form, or one over
the size budgets, is a 400 naming its field). `GrammarChecker.check` proves it with the engine
(phaseserve.grammar.check: compile, first mask, a few tokens walked) before the request is enqueued: a
schema, regex or grammar the engine cannot take is a 400 with the engine's message, and never reaches a
worker.

The proofs run off the event loop on a few threads (the engine releases the GIL). A compile cannot be
interrupted in a thread, so the bounds are: the engine's own limits (its fuel bounds every compile and
mask), the size budgets (checked before anything runs), a time budget (past it the request is a 400 at
once), and one proof at a time per client (an API key, or an address when keys are off), held until the
engine returns: a client whose grammar overruns waits for it, and never holds a second thread.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from phaseserve.gateway.errors import bad_request, too_many_requests, unavailable
from phaseserve import grammar
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.settings import BY_NAME
from phaseserve.wire import GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarBudgets:
    """What a gateway proves a grammar within (the settings named in SETTINGS, in order)."""

    max_choices: int
    max_grammar_bytes: int  # a client's regex or Lark grammar, a choice's options together
    max_schema_bytes: int  # a JSON schema, a forced tool call's grammar
    check_timeout: float
    threads: int
    queue_timeout: float

    SETTINGS = ("max_grammar_choices", "max_grammar_bytes", "max_schema_bytes", "grammar_check_timeout",
                "grammar_check_threads", "grammar_queue_timeout")

    @classmethod
    def from_settings(cls, values) -> "GrammarBudgets":
        return cls(*(getattr(values, name) for name in cls.SETTINGS))

    @classmethod
    def defaults(cls) -> "GrammarBudgets":
        return cls(*(BY_NAME[name].type(BY_NAME[name].default) for name in cls.SETTINGS))

    def check_size(self, spec: GrammarSpec, param: str) -> None:
        """A 400 naming `param` when the spec is over its size budget (before anything compiles it)."""
        forced_call = param in ("tools", "tool_choice")  # the tools' parameters are JSON schemas
        limit = self.max_schema_bytes if spec.kind == "json_schema" or forced_call else self.max_grammar_bytes
        size = len(spec.source.encode())
        if size > limit:
            raise bad_request(f"The {_WHAT[spec.kind]} of '{param}' is {size} bytes; this server takes at most "
                              f"{limit}", param)


def _schema(value: Any, param: str, budgets: GrammarBudgets) -> GrammarSpec:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
    spec = grammar.json_schema(value)
    budgets.check_size(spec, param)
    return spec


def _choice(value: Any, param: str, budgets: GrammarBudgets) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_request(f"'{param}' must be a non-empty list of strings", param)
    if len(value) > budgets.max_choices:
        raise bad_request(f"'{param}' has {len(value)} options; this server takes at most {budgets.max_choices}",
                          param)
    size = sum(len(v.encode()) for v in value)
    if size > budgets.max_grammar_bytes:
        raise bad_request(f"'{param}' has {size} bytes of options; this server takes at most "
                          f"{budgets.max_grammar_bytes}", param)
    return grammar.choice(value)


def _text(value: Any, param: str, kind: str, budgets: GrammarBudgets) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param)
    spec = GrammarSpec(kind, value)
    budgets.check_size(spec, param)
    return spec


def _response_format(rf: dict, budgets: GrammarBudgets) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}",
                          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar.json_schema({"type": "object"})
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request("'response_format.json_schema' must be an object with a 'schema' (and a 'name')",
                          "response_format")
    return _schema(spec["schema"], "response_format", budgets)


def _structured_outputs(so: dict, budgets: GrammarBudgets) -> GrammarSpec | None:
    given = [k for k in STRUCTURED_OUTPUT_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"'structured_outputs' takes one constraint; got {', '.join(given)}", "structured_outputs")
    if not given:
        return None
    key = given[0]
    value = so[key]
    if key == "json":
        return _schema(value, "structured_outputs", budgets)
    if key == "regex":
        return _text(value, "structured_outputs", "regex", budgets)
    if key == "choice":
        return _choice(value, "structured_outputs", budgets)
    if key == "grammar":
        return _text(value, "structured_outputs", "lark", budgets)
    return grammar.json_schema({"type": "object"})  # json_object: true


def requested_grammar(req, budgets: GrammarBudgets) -> tuple[GrammarSpec | None, str | None]:
    """(the grammar the request's output must follow, the field that asked for it); (None, None): free text.
    More than one constraint is a 400, and so is one over the size budgets."""
    forms: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format, budgets)
        if spec is not None:
            forms.append((spec, "response_format"))
    if req.structured_outputs is not None:
        spec = _structured_outputs(req.structured_outputs, budgets)
        if spec is not None:
            forms.append((spec, "structured_outputs"))
    if req.guided_json is not None:
        forms.append((_schema(req.guided_json, "guided_json", budgets), "guided_json"))
    if req.guided_regex is not None:
        forms.append((_text(req.guided_regex, "guided_regex", "regex", budgets), "guided_regex"))
    if req.guided_choice is not None:
        forms.append((_choice(req.guided_choice, "guided_choice", budgets), "guided_choice"))
    if req.guided_grammar is not None:
        forms.append((_text(req.guided_grammar, "guided_grammar", "lark", budgets), "guided_grammar"))
    if len(forms) > 1:
        raise bad_request(f"One output constraint at a time; the request has {', '.join(p for _, p in forms)}",
                          forms[1][1])
    if not forms:
        return None, None
    return forms[0]


class GrammarChecker:
    """Proves grammars the way a worker will run them, on a few threads shared fairly between clients."""

    def __init__(self, tokenizer: Tokenizer, budgets: GrammarBudgets):
        self.budgets = budgets
        self._tokenizer_json = os.path.join(tokenizer.path, "tokenizer.json")
        self._vocab_size = tokenizer.vocab_size
        self._eos = tuple(sorted(tokenizer.eos_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=budgets.threads, thread_name_prefix="grammar")
        self._free_threads: asyncio.Semaphore | None = None  # made on the loop, at the first check
        self._busy: dict[Any, asyncio.Event] = {}  # client -> set when its proof has returned
        # the engine's index of the vocabulary, built now rather than inside the first request's time budget
        self._pool.submit(self._engine_tokenizer)

    def _engine_tokenizer(self):
        return grammar.engine_tokenizer(self._tokenizer_json, self._vocab_size, self._eos)

    def _prove(self, spec: GrammarSpec) -> float:
        return grammar.check(spec, self._engine_tokenizer())

    async def check(self, spec: GrammarSpec, param: str, client: Any = None) -> float:
        """Seconds the proof took; an APIError naming `param` when the engine refuses the grammar or takes
        longer than the time budget (400), or when no slot frees up in time (429: the client's own proof still
        runs; 503). The size budgets are the caller's to check first (GrammarBudgets.check_size)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budgets.queue_timeout
        done = await self._client_slot(client, deadline)
        try:
            if self._free_threads is None:
                self._free_threads = asyncio.Semaphore(self.budgets.threads)
            await asyncio.wait_for(self._free_threads.acquire(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            self._release(client, done, thread=False)
            raise unavailable("Every grammar check thread is busy; retry later.") from None
        except BaseException:
            self._release(client, done, thread=False)
            raise
        proof = loop.run_in_executor(self._pool, self._prove, spec)
        # the slots free up when the engine returns, even after the request has been answered
        proof.add_done_callback(lambda f: (self._release(client, done, thread=True),
                                           f.cancelled() or f.exception()))
        try:
            return await asyncio.wait_for(asyncio.shield(proof), self.budgets.check_timeout)
        except grammar.GrammarError as e:
            raise bad_request(f"Invalid {_WHAT[spec.kind]} in '{param}': {e}", param) from None
        except TimeoutError:
            raise bad_request(f"The {_WHAT[spec.kind]} of '{param}' takes the grammar engine longer than "
                              f"{self.budgets.check_timeout:g} s to compile; simplify it", param) from None

    async def _client_slot(self, client: Any, deadline: float) -> asyncio.Event:
        """Wait until `client` has no proof running; then this one is its proof."""
        loop = asyncio.get_running_loop()
        while client in self._busy:
            try:
                await asyncio.wait_for(self._busy[client].wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise too_many_requests("A grammar of yours is still being checked", 1) from None
        done = self._busy[client] = asyncio.Event()
        return done

    def _release(self, client: Any, done: asyncio.Event, thread: bool) -> None:
        if thread and self._free_threads is not None:
            self._free_threads.release()
        if self._busy.get(client) is done:
            del self._busy[client]
        done.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "grammar"}
