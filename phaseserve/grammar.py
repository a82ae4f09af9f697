"""Structured outputs: a GrammarSpec compiled by llguidance, checked by the gateway, enforced by the worker.

The engine is llguidance (docs/decisions.md has the figures against xgrammar on our tokenizers:
sub-millisecond compiles, microseconds a mask). Nothing here parses a grammar by hand: a spec becomes an
llguidance grammar, a matcher follows the sampled tokens, and its bitmask says which tokens may come next.

- the gateway: `check(spec, tokenizer)` proves a spec before it is queued: it builds a matcher, computes its
  first mask, and walks a few tokens of one path (the lowest-id token allowed each time, which keeps the
  grammar's alternatives most open: an Earley row too wide, a regex whose lexer blows up, show there). A
  schema, regex or grammar the engine refuses raises GrammarError with the engine's message, cleaned of its
  parser state and of a panic's backtrace (-> HTTP 400), so it never reaches a worker.
- both sides build matchers with ENGINE_LIMITS (the engine's own fuel and size limits: every compile and
  every mask is bounded by them), so what the gateway proved is what a worker runs.
- the worker: one `GrammarMatcher` per constrained sequence, built from its spec and advanced over the
  output tokens it already has (a recompute or a handed-over sequence continues where it was), then
  `fill_masks` for a step's rows (in llguidance's threads, without the GIL) and `advance` per sampled token.
- speculative decoding: `accepted_prefix(proposed)` says how many proposed tokens the grammar allows (no
  state change); after verification, `advance_many(accepted)`, or `rollback(n)` to undo tokens advanced.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from concurrent.futures import Executor
from functools import lru_cache

import llguidance
import llguidance.torch
import torch

from phaseserve.wire import GRAMMAR_KINDS, GrammarSpec

# JSON is generated compact (no free whitespace between tokens): at a high temperature a small model would
# otherwise wander into whitespace until max_tokens, leaving the document unfinished. The engine reads its
# options from a schema's "x-guidance" key too: a client's schema may not have one (GrammarError), so these,
# and every keyword enforced (no "lenient"), hold.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
ENGINE_OPTIONS_KEY = "x-guidance"

# The engine's defaults bound each compile (lexer fuel, grammar symbols) and each mask (Earley items, lexer
# fuel per step); errors without its parser state and grammar (which may be a client's whole schema).
ENGINE_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# tokens of one path the gateway walks after the first mask (each a mask: microseconds for a sound grammar)
PROBE_TOKENS = 8

# mask time histogram (seconds), for /metrics: a mask costs microseconds, a pathological one milliseconds
MASK_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class GrammarError(ValueError):
    """A spec the engine cannot take; the message is the engine's (-> HTTP 400)."""


def engine_grammar(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar. Raises GrammarError for what is malformed before compiling."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object (or true/false)")
        refuse_engine_options(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    raise GrammarError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(GRAMMAR_KINDS)})")


def refuse_engine_options(schema: dict | bool) -> None:
    """A client's JSON schema may not set the engine's options (GrammarError): they are the server's."""
    if isinstance(schema, dict) and ENGINE_OPTIONS_KEY in schema:
        raise GrammarError(f"'{ENGINE_OPTIONS_KEY}' (the grammar engine's options) is set by the server, not by "
                           "a schema: remove it")


def json_schema(schema: dict | bool) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def choice(options: list[str]) -> GrammarSpec:
    """Exactly one of the strings: one terminal (the engine's lexer matches the alternatives together), not a
    rule of as many alternatives, whose Earley rows would grow with the option count past the engine's
    limit once a prefix they share is sampled."""
    return GrammarSpec("lark", "start: CHOICE\nCHOICE: " + " | ".join(lark_string(o) for o in options))


def after_reasoning(spec: GrammarSpec, start_tag: str, end_tag: str, opened: bool) -> GrammarSpec:
    """`spec` enforced only once a reasoning model's thinking has ended: free text up to the first `end_tag`
    (opened: the prompt already opened the thinking; else the output may open it with `start_tag`, or
    answer at once), then the spec. The thinking is one lexeme that ends with the first
    end tag (text ending in the tag, and containing it nowhere else), so no backtracking is needed, and
    the answer is the spec's own grammar nested by reference (llguidance's `@name`)."""
    end = _lark_regex_literal(end_tag)
    rules = [f"THINK: /(.|\\n)*{end}/ & ~/(.|\\n)*{end}(.|\\n)+/", "SEP: /[ \\t\\n]+/"]
    thought = "THINK SEP?" if opened else f"({lark_string(start_tag)} THINK SEP?)?"
    top = {"lark_grammar": "\n".join([f"start: {thought} @answer", *rules])}
    return GrammarSpec("lark", json.dumps({"grammars": [top, *_named_grammars(engine_grammar(spec), "answer")]}, ensure_ascii=False))


def _lark_regex_literal(text: str) -> str:
    return re.sub(r"([\\/.*+?()\[\]{}|^$-])", r"\\\1", text)


def _named_grammars(compiled: str, name: str) -> list[dict]:
    """An engine grammar (lark text, or a TopLevelGrammar's JSON) as the grammars list of a TopLevelGrammar,
    its first one named `name`."""
    text = compiled.lstrip()
    grammars = json.loads(text)["grammars"] if text.startswith("{") else [{"lark_grammar": compiled}]
    return [{**grammars[0], "name": name}, *grammars[1:]]


@lru_cache(maxsize=8)
def engine_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The engine's view of a model's tokenizer (built once per model: it indexes the whole vocabulary).
    `vocab_size` is the model's (embedding rows, may exceed the tokenizer's): masks have that width."""
    with open(tokenizer_json, encoding="utf-8") as f:
        return llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=list(eos_token_ids))


def check(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer, probe_tokens: int = PROBE_TOKENS) -> float:
    """Prove `spec` as a worker will run it: compile it, compute its first mask, then walk `probe_tokens`
    tokens of one path (the lowest-id token that is not an end token, each with its mask). Raises
    GrammarError naming the problem. Returns the seconds it took."""
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, engine_grammar(spec), log_level=0, limits=ENGINE_LIMITS)
    end_tokens = tokenizer.eos_tokens
    for _ in range(probe_tokens + 1):
        if matcher.is_error():
            raise GrammarError(clean_error(matcher.get_error()))
        if matcher.is_stopped():
            break
        mask = bytearray(matcher.compute_bitmask())
        if matcher.is_error():
            raise GrammarError(clean_error(matcher.get_error()))
        token = _lowest_token(mask, end_tokens)
        if token is None:  # only an end is allowed: the document is complete
            break
        matcher.consume_token(token)
    return time.perf_counter() - t


def _lowest_token(mask: bytearray, excluded: list[int]) -> int | None:
    """The lowest token id a bitmask allows (bit t of the mask is byte t // 8, bit t % 8), but `excluded`."""
    for t in excluded:
        if t // 8 < len(mask):
            mask[t // 8] &= ~(1 << (t % 8)) & 0xFF
    rest = mask.lstrip(b"\0")
    if not rest:
        return None
    low = rest[0]
    return (len(mask) - len(rest)) * 8 + (low & -low).bit_length() - 1


def clean_error(error: str) -> str:
    """The engine's error as a client may read it: what names the problem, without the parser state, the
    grammar it compiled, or a panic's backtrace (a panic is an internal limit of the engine)."""
    head = re.split(r"\s*<(?:state|grammar|backtrace|non-verbose/)>", error.strip(), maxsplit=1)[0]
    if head.startswith("panic") or "panicked at" in head:
        return "the grammar is too large or complex for the grammar engine (one of its internal limits)"
    lines = [ln.strip() for ln in head.splitlines() if ln.strip() and not re.match(r"^\d+ \|", ln.strip())]
    return " ".join(lines)[:500] or "the grammar does not compile"


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, spec: GrammarSpec, tokenizer: llguidance.LLTokenizer, output_ids: list[int] = ()):
        self.matcher = llguidance.LLMatcher(tokenizer, engine_grammar(spec), log_level=0, limits=ENGINE_LIMITS)
        if output_ids:  # a token the grammar refuses leaves `error` set: the runner fails that sequence
            self.matcher.consume_tokens(list(output_ids))

    @property
    def error(self) -> str | None:
        return clean_error(self.matcher.get_error()) if self.matcher.is_error() else None

    @property
    def is_stopped(self) -> bool:
        """The grammar allows nothing more (its document is complete): the sequence is done."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False (and `error` set) if the grammar did not allow it."""
        return self.matcher.consume_token(token)

    # ---- the speculative decoding hook

    def accepted_prefix(self, proposed: list[int]) -> int:
        """How many of `proposed` (in order) the grammar allows from here, without moving."""
        return self.matcher.validate_tokens(list(proposed))

    def advance_many(self, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` advanced (rejected speculative tokens)."""
        return self.matcher.rollback(num_tokens)

    def fill_proposal_masks(self, proposed: list[int], masks: torch.Tensor, first_row: int = 0) -> int:
        """The masks of the positions a speculative step verifies: row first_row + j := what may follow
        proposed[:j], for j = 0 .. n, n being how many of `proposed` the grammar allows (the proposal is cut
        there: nothing it refuses is verified). The matcher ends where it began. Returns n."""
        n = self.accepted_prefix(proposed)
        for j in range(n + 1):
            if j:
                self.matcher.consume_token(proposed[j - 1])
            llguidance.torch.fill_next_token_bitmask(self.matcher, masks, first_row + j)
        if n:
            self.matcher.rollback(n)
        return n


def allocate_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 bitmask rows, 32 tokens a word, all allowed."""
    return torch.full(((num_rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _fill(matchers: list[GrammarMatcher], masks: torch.Tensor, rows: range) -> None:
    for i in rows:
        llguidance.torch.fill_next_token_bitmask(matchers[i].matcher, masks, i)


def fill_masks(matchers: list[GrammarMatcher], masks: torch.Tensor, helper: Executor | None = None) -> float:
    """Row i of `masks` := what matchers[i] allows next. llguidance releases the GIL while it works, so with
    a `helper` thread (a worker whose torch uses more than one core) the first half of the rows is computed
    there while this thread computes the rest. Not llguidance's own thread pool: beside torch's threads
    on the same cores it made steps slower (docs/decisions.md). Returns the seconds it took."""
    t = time.perf_counter()
    half = len(matchers) // 2 if helper is not None else 0
    other = helper.submit(_fill, matchers, masks, range(half)) if half else None
    _fill(matchers, masks, range(half, len(matchers)))
    if other is not None:
        other.result()
    return time.perf_counter() - t


_BITS = torch.arange(32, dtype=torch.int32)


def disallowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask rows [B, W] -> bool [B, vocab_size]: True where a token is forbidden."""
    bits = (masks.unsqueeze(-1) >> _BITS).bitwise_and_(1)
    return bits.view(masks.shape[0], -1)[:, :vocab_size].logical_not()


class MaskHistogram:
    """Mask times as StepResult.grammar_masks carries them: counts per MASK_BUCKETS_S bucket (le), one more
    for slower, then the sum of the seconds."""

    def __init__(self):
        self.counts: list[float] = []

    def add(self, seconds: float, n: int = 1) -> None:
        """`n` masks of `seconds` each."""
        if not self.counts:
            self.counts = [0.0] * (len(MASK_BUCKETS_S) + 2)
        self.counts[bisect.bisect_left(MASK_BUCKETS_S, seconds)] += n
        self.counts[-1] += seconds * n

    def take(self) -> list[float]:
        """The counts since the last take ([] when none)."""
        counts, self.counts = self.counts, []
        return counts
