"""Structured outputs at the gateway: which grammar a request asks for, and whether the engine takes it.

`requested_grammar` reads OpenAI's `response_format` and vLLM's extras (`structured_outputs`, `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) into one GrammarSpec (pure; a malformed form is a 400
naming its field). `GrammarChecker.check` compiles it with the engine, off the event loop, before the
request is enqueued: a schema, regex or grammar the engine cannot take is a 400 with the engine's message,
and never reaches a worker.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.errors import bad_request
from phaseserve import grammar
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
    return grammar.json_schema(value)


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_request(f"'{param}' must be a non-empty list of strings", param)
    return grammar.choice(value)


def _text(value: Any, param: str, kind: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param)
    return GrammarSpec(kind, value)


def _response_format(rf: dict) -> GrammarSpec | None:
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
    return _schema(spec["schema"], "response_format")


def _structured_outputs(so: dict) -> GrammarSpec | None:
    given = [k for k in STRUCTURED_OUTPUT_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"'structured_outputs' takes one constraint; got {', '.join(given)}", "structured_outputs")
    if not given:
        return None
    key = given[0]
    value = so[key]
    if key == "json":
        return _schema(value, "structured_outputs")
    if key == "regex":
        return _text(value, "structured_outputs", "regex")
    if key == "choice":
        return _choice(value, "structured_outputs")
    if key == "grammar":
        return _text(value, "structured_outputs", "lark")
    return grammar.json_schema({"type": "object"})  # json_object: true


def requested_grammar(req) -> tuple[GrammarSpec | None, str | None]:
    """(the grammar the request's output must follow, the field that asked for it); (None, None): free text.
    More than one constraint is a 400."""
    forms: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            forms.append((spec, "response_format"))
    if req.structured_outputs is not None:
        spec = _structured_outputs(req.structured_outputs)
        if spec is not None:
            forms.append((spec, "structured_outputs"))
    if req.guided_json is not None:
        forms.append((_schema(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        forms.append((_text(req.guided_regex, "guided_regex", "regex"), "guided_regex"))
    if req.guided_choice is not None:
        forms.append((_choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        forms.append((_text(req.guided_grammar, "guided_grammar", "lark"), "guided_grammar"))
    if len(forms) > 1:
        raise bad_request(f"One output constraint at a time; the request has {', '.join(p for _, p in forms)}",
                          forms[1][1])
    return forms[0] if forms else (None, None)


class GrammarChecker:
    """Compiles grammars the way a worker will, on its own thread (the engine's tokenizer is built on first use)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer_json = os.path.join(tokenizer.path, "tokenizer.json")
        self._vocab_size = tokenizer.vocab_size
        self._eos = tuple(sorted(tokenizer.eos_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def _compile(self, spec: GrammarSpec) -> float:
        return grammar.check(spec, grammar.engine_tokenizer(self._tokenizer_json, self._vocab_size, self._eos))

    async def check(self, spec: GrammarSpec, param: str) -> float:
        """Seconds the compile took; an APIError(400) naming `param` when the engine refuses the grammar."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._compile, spec)
        except grammar.GrammarError as e:
            raise bad_request(f"Invalid {_WHAT[spec.kind]} in '{param}': {e}", param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "grammar"}
