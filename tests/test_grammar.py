"""Structured outputs below HTTP: the engine wrapper (phaseserve/grammar.py), the worker's masks in a batch
that mixes constrained and free sequences, a recomputed sequence continuing valid, and the gateway's pure
parts (which grammar a request asks for; tool calls in and out)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import jsonschema
import pytest
import torch

from bench.grammar_schemas import NESTED
from phaseserve.gateway import protocol as P
from phaseserve.gateway.errors import APIError
from phaseserve.gateway.structured import GrammarBudgets, GrammarChecker, requested_grammar
from phaseserve.gateway.tools import HermesParser, plan_tools
from phaseserve import grammar, settings
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.params import SamplingParams
from phaseserve.wire import GrammarSpec, SeqStart, SubmitRequest
from runner_driver import run
from phaseserve.workers.runner import ModelRunner
from phaseserve.workers.sampler import SampleRow, Sampler

BUNDLED = settings.bundled_model_path()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(BUNDLED)


@pytest.fixture(scope="module")
def engine_tokenizer(tokenizer):
    return grammar.engine_tokenizer(f"{BUNDLED}/tokenizer.json", tokenizer.vocab_size,
                                    tuple(sorted(tokenizer.eos_token_ids)))


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(BUNDLED, num_blocks=256)


# ------------------------------------------------------------------ the engine wrapper


def test_check_names_the_problem_of_what_the_engine_refuses(engine_tokenizer):
    assert grammar.check(grammar.json_schema(NESTED), engine_tokenizer) >= 0
    with pytest.raises(grammar.GrammarError, match="unclosed group"):
        grammar.check(GrammarSpec("regex", "a(b"), engine_tokenizer)
    with pytest.raises(grammar.GrammarError, match="foo"):
        grammar.check(grammar.json_schema({"type": "foo"}), engine_tokenizer)
    with pytest.raises(grammar.GrammarError):  # a keyword it cannot enforce is refused, not ignored
        grammar.check(grammar.json_schema({"type": "array", "uniqueItems": True}), engine_tokenizer)
    with pytest.raises(grammar.GrammarError):
        grammar.check(GrammarSpec("lark", "start: undefined_rule"), engine_tokenizer)
    with pytest.raises(grammar.GrammarError, match="not valid JSON"):
        grammar.check(GrammarSpec("json_schema", "{"), engine_tokenizer)


# a Rust panic's text as the engine reported it for a 100,000-alternative grammar (before the choice was one
# terminal and before the budgets)
PANIC = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>\n"
         "   1: <unknown>\n")


def test_check_proves_past_the_first_mask_and_cleans_the_engine_errors(engine_tokenizer):
    """What fails only once a token is sampled (an Earley row over the engine's limit, a regex its lexer cannot
    expand) is found by the walk after the first mask; messages carry no parser state and no backtrace."""
    wide = GrammarSpec("lark", "start: " + " | ".join(f'"w{i}"' for i in range(2500)))
    with pytest.raises(grammar.GrammarError, match="row has 2501 items") as e:
        grammar.check(wide, engine_tokenizer)
    assert "<" not in str(e.value)
    with pytest.raises(grammar.GrammarError, match="lexer"):
        grammar.check(GrammarSpec("regex", "a{1000000000}"), engine_tokenizer)
    # a choice is one terminal: thousands of options sharing a prefix are no wider a row than two
    grammar.check(grammar.choice([f"option number {i}" for i in range(2001)]), engine_tokenizer)
    grammar.check(grammar.choice(["", "a", "ab"]), engine_tokenizer)
    cleaned = grammar.clean_error(PANIC)
    assert "panic" not in cleaned and "backtrace" not in cleaned and "unknown" not in cleaned
    assert "too large or complex" in cleaned


def test_a_schema_may_not_set_the_engines_options(engine_tokenizer, tokenizer):
    """`x-guidance` (whitespace_flexible, lenient, ...) is the server's: a schema setting it is refused, and a
    forced tool call's grammar carries the server's own."""
    flexible = grammar.json_schema({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    with pytest.raises(grammar.GrammarError, match="x-guidance"):
        grammar.check(flexible, engine_tokenizer)
    with pytest.raises(APIError) as e:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "x-guidance": {"lenient": True}}}}
        plan_tools(_chat(tools=[tool], tool_choice="required"), [{"role": "user", "content": "hi"}],
                   HermesParser(), "")
    assert e.value.param == "tools" and "x-guidance" in e.value.message
    m = grammar.GrammarMatcher(grammar.json_schema({"type": "object"}), engine_tokenizer)
    assert m.accepted_prefix(tokenizer.encode('{ "a": 1}', add_special_tokens=False)) == 1  # compact: no space


async def test_the_checker_has_a_time_budget_and_one_proof_per_client(tokenizer):
    """A proof past its time budget is its request's 400 at once; its client's next grammar waits for the engine
    to return (429 past the queue budget) instead of taking a second thread; another client's is proved
    meanwhile; and the client's slot frees up once the engine returns."""
    budgets = replace(GrammarBudgets.defaults(), check_timeout=0.05, threads=2, queue_timeout=0.2)
    checker = GrammarChecker(tokenizer, budgets)
    slow = GrammarSpec("regex", "a{1000000000}")  # the engine spends its lexer fuel on it before it refuses
    quick = grammar.json_schema({"type": "object"})
    try:
        await checker.check(quick, "response_format", "warm-up")  # the engine's tokenizer is built
        first = asyncio.create_task(checker.check(slow, "guided_regex", "attacker"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(checker.check(slow, "guided_regex", "attacker"))
        assert await asyncio.wait_for(checker.check(quick, "response_format", "victim"), 5) >= 0
        with pytest.raises(APIError) as e:
            await first
        assert e.value.status == 400 and "longer than 0.05 s" in e.value.message and e.value.param == "guided_regex"
        with pytest.raises(APIError) as e:
            await second
        assert e.value.status == 429
        deadline = time.monotonic() + 30
        while True:  # the attacker's slot is back once the engine has given up on its regex
            try:
                await checker.check(quick, "response_format", "attacker")
                break
            except APIError as e:
                assert e.status == 429 and time.monotonic() < deadline
    finally:
        checker.close()


def test_tools_are_bounded_and_their_names_checked_once_each():
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(P.MAX_TOOLS)]
    with pytest.raises(APIError) as e:
        _chat(tools=many + many[:1])
    assert e.value.param == "tools" and str(P.MAX_TOOLS) in e.value.message
    with pytest.raises(APIError, match="more than one function named 'f0', 'f1'") as e:
        plan_tools(_chat(tools=many[:-2] + many[:2]), [{"role": "user", "content": "hi"}], HermesParser(), "")


def test_matcher_rebuilt_from_outputs_and_the_speculation_hook(tokenizer, engine_tokenizer):
    spec = grammar.choice(["alpha", "beta"])
    ids = tokenizer.encode("alpha", add_special_tokens=False)
    m = grammar.GrammarMatcher(spec, engine_tokenizer, ids[:1])  # as after a recompute: advanced over outputs
    assert m.error is None
    assert m.accepted_prefix(ids[1:]) == len(ids) - 1
    bad = tokenizer.encode("beta", add_special_tokens=False)
    assert m.accepted_prefix(bad) == 0  # checking moves nothing
    assert m.advance_many(ids[1:]) and m.is_stopped
    assert m.rollback(len(ids) - 1) and not m.is_stopped
    # the masks a speculative step verifies: one per allowed proposed token, plus the one after them
    proposal = ids[1:] + bad
    masks = grammar.allocate_masks(len(proposal) + 1, tokenizer.vocab_size)
    n = m.fill_proposal_masks(proposal, masks)
    assert n == len(ids) - 1 and not m.is_stopped  # cut at the first refused token; the matcher is back
    forbidden = grammar.disallowed_tokens(masks, tokenizer.vocab_size)
    for j in range(n):
        assert not forbidden[j, ids[1 + j]]  # each verified position allows its proposed token
    after = set((~forbidden[n]).nonzero().flatten().tolist())
    assert after and after <= set(tokenizer.eos_token_ids)  # "alpha" is complete: only an end may follow
    assert masks[n + 1:].eq(-1).all()  # rows past the cut are not touched
    assert m.advance_many(ids[1:])


def test_mask_histogram_counts_and_sums():
    h = grammar.MaskHistogram()
    assert h.take() == []
    h.add(1e-6)
    h.add(3e-5, 2)
    h.add(1.0)
    counts = h.take()
    assert len(counts) == len(grammar.MASK_BUCKETS_S) + 2 and h.take() == []
    assert counts[0] == 1 and counts[3] == 2 and counts[-2] == 1 and counts[-1] == pytest.approx(1.0 + 6.1e-5)


# ------------------------------------------------------------------ the worker


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Describe a pet as JSON:")


def test_a_batch_mixes_constrained_and_free_sequences(runner, tokenizer):
    """Constrained rows validate at temperature 1; a free seeded row samples exactly what it samples alone."""
    prompt = _prompt(tokenizer)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=11)
    pattern = r"[a-z]{2,5}@[a-z]{3}\.(com|org)"
    specs = [grammar.json_schema(NESTED), None, GrammarSpec("regex", pattern), grammar.choice(["yes", "no"])]
    mixed = run(runner, [prompt] * 4, params, grammars=specs)
    alone = run(runner, [prompt], params)
    assert mixed[1].outputs == alone[0].outputs
    jsonschema.validate(json.loads(tokenizer.decode(mixed[0].outputs)), NESTED)
    assert re.fullmatch(pattern, tokenizer.decode(mixed[2].outputs))
    assert tokenizer.decode(mixed[3].outputs) in ("yes", "no")
    assert all(s.finish_reason == "stop" for s in mixed[::2])
    assert runner.take_grammar_masks() == []  # the step results took them


def test_a_recomputed_sequence_continues_valid(runner, tokenizer):
    """A sequence restarted with outputs it already has (recompute, handoff) rebuilds its matcher over them:
    the document continues instead of starting again."""
    prompt = _prompt(tokenizer)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5)
    spec = grammar.json_schema(NESTED)
    first = run(runner, [prompt], params, grammars=[spec])[0]
    cut = len(first.outputs) // 2
    for seed in (5, 6, 7):
        resumed = run(runner, [prompt], SamplingParams(max_tokens=200, temperature=1.0, seed=seed),
                      output_ids=[first.outputs[:cut]], grammars=[spec])[0]
        assert resumed.outputs[:cut] == first.outputs[:cut]
        jsonschema.validate(json.loads(tokenizer.decode(resumed.outputs)), NESTED)


def test_step_results_report_mask_times(runner, tokenizer):
    from phaseserve.wire import ScheduledChunk, StepPlan
    prompt = _prompt(tokenizer)
    start = SeqStart("m", "gw", prompt, SamplingParams(max_tokens=4, temperature=1.0),
                     grammar=grammar.json_schema(NESTED))
    chunk = ScheduledChunk("m", 0, len(prompt), list(range(8)))
    result = runner.execute(StepPlan(0, "w", [start], [chunk]))
    while "m" in result.deferred:  # its matcher was still being built: it sat out; planned again
        time.sleep(0.01)
        result = runner.execute(StepPlan(1, "w", [], [chunk]))
    runner.reset()
    assert len(result.grammar_masks) == len(grammar.MASK_BUCKETS_S) + 2 and sum(result.grammar_masks[:-1]) == 1


def test_grammar_travels_on_the_wire_and_is_absent_when_unused():
    spec = grammar.json_schema(NESTED)
    plain = SubmitRequest("r", "g", [1, 2], SamplingParams())
    assert b"grammar" not in plain.to_wire()
    sent = SubmitRequest("r", "g", [1, 2], SamplingParams(), grammar=spec)
    assert SubmitRequest.from_wire(sent.to_wire()).grammar == spec
    start = SeqStart("r", "g", [1], SamplingParams(), [7], grammar=spec)
    assert SeqStart.from_dict(start.to_dict()).grammar == spec


# ------------------------------------------------------------------ the gateway's pure parts


def _chat(**fields) -> P.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return P.parse_body(P.ChatCompletionRequest, json.dumps(body).encode())


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED}}}, "json_schema"),
    ({"guided_json": json.dumps(NESTED)}, "json_schema"),
    ({"guided_regex": "a+"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "lark"),
    ({"guided_grammar": 'start: "x"'}, "lark"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"json_object": True}}, "json_schema"),
])
def test_requested_grammar_reads_every_form(fields, kind):
    spec, param = requested_grammar(_chat(**fields), GrammarBudgets.defaults())
    assert spec.kind == kind and param == next(iter(fields))


def test_the_largest_choice_the_budgets_name_is_accepted():
    """Budgets count a choice's options and their bytes, as documented, not the grammar built from them."""
    budgets = GrammarBudgets.defaults()
    options = [f"{i:05d}" for i in range(budgets.max_choices)]
    assert sum(map(len, options)) <= budgets.max_grammar_bytes
    spec, param = requested_grammar(_chat(guided_choice=options), budgets)
    assert param == "guided_choice" and len(spec.source.encode()) > budgets.max_grammar_bytes


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_choice": ["x"] * (GrammarBudgets.defaults().max_choices + 1)}, "guided_choice"),  # over budget
    ({"structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),  # a client's text over the grammar bytes
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "description": "d" * 300_000}}}}, "response_format"),  # over the schema bytes
])
def test_requested_grammar_refuses_malformed_forms(fields, param):
    with pytest.raises(APIError) as e:
        requested_grammar(_chat(**fields), GrammarBudgets.defaults())
    assert e.value.status == 400 and e.value.param == param


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_parser_whole_and_streamed():
    parser = HermesParser()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me look." and calls[0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo"}'}
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    stream = parser.stream()
    pieces = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    assert "".join(p.content for p in pieces) + stream.finish().content == "Let me look.\n"
    [call] = [c for p in pieces for c in p.tool_calls]
    assert call["index"] == 0 and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    stream = parser.stream()  # a marker's beginning that turns out to be text is content in the end
    assert stream.feed("a <tool").content == "a " and stream.finish().content == "<tool"


def test_forced_call_grammar_compiles_and_allows_only_valid_calls(engine_tokenizer, tokenizer):
    spec = HermesParser().forced_grammar([TOOL["function"]])
    grammar.check(spec, engine_tokenizer)
    m = grammar.GrammarMatcher(spec, engine_tokenizer)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
    ids = tokenizer.encode(good, add_special_tokens=False)
    assert m.accepted_prefix(ids) == len(ids)
    bad = tokenizer.encode('<tool_call>\n{"name": "other"', add_special_tokens=False)
    assert m.accepted_prefix(bad) < len(bad)


def test_plan_tools_renders_checks_and_forces(tokenizer):
    parser = HermesParser()
    template = tokenizer.chat_templates["default"]  # knows nothing of tools: the parser's prompt is used
    req = _chat(tools=[TOOL], tool_choice="required")
    plan = plan_tools(req, [m.model_dump(exclude_none=True) for m in req.messages], parser, template)
    assert plan.grammar is not None and plan.parser is parser
    assert plan.messages[0]["role"] == "system" and "get_weather" in plan.messages[0]["content"]
    auto = plan_tools(_chat(tools=[TOOL]), [{"role": "user", "content": "hi"}], parser, template)
    assert auto.grammar is None and auto.parser is parser
    none = plan_tools(_chat(tools=[TOOL], tool_choice="none"), [{"role": "user", "content": "hi"}], parser, template)
    assert none.parser is None and none.messages == [{"role": "user", "content": "hi"}]
    with_tools_template = plan_tools(_chat(tools=[TOOL]), [{"role": "user", "content": "hi"}], parser,
                                     "{% for t in tools %}{{ t }}{% endfor %}")
    assert with_tools_template.template_kwargs["tools"][0]["function"]["name"] == "get_weather"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    rendered = plan_tools(_chat(tools=[TOOL]), [{"role": "assistant", "tool_calls": [call]}], parser,
                          "{{ tools }}").messages
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # as templates expect

    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plan = plan_tools(_chat(tools=[TOOL]), history, parser, template)
    assert "<tool_call>" in plan.messages[-2]["content"] and "<tool_response>" in plan.messages[-1]["content"]
    for bad, param in [(dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}), "tool_choice"),
                       (dict(tool_choice="required"), "tool_choice"), (dict(tools=[TOOL, TOOL]), "tools")]:
        with pytest.raises(APIError) as e:
            plan_tools(_chat(**bad), [{"role": "user", "content": "hi"}], parser, template)
        assert e.value.param == param
    with pytest.raises(APIError, match="no assistant message"):
        plan_tools(_chat(), [history[0], history[2]], parser, template)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_masks_constrained_rows_only_and_leaves_the_logits_alone(dtype):
    V = 64
    logits = torch.randn(3, V).to(dtype)
    before = logits.clone()
    forbid = torch.ones(V, dtype=torch.bool)
    forbid[5] = False
    params = SamplingParams(temperature=1.0, logprobs=0)
    rows = [SampleRow(params, 0, [1], 1, frozenset(), disallowed=forbid), SampleRow(params, 0, [1], 1, frozenset()),
            SampleRow(SamplingParams(temperature=0.0), 0, [1], 1, frozenset(), disallowed=forbid)]
    for _ in range(5):
        out = Sampler(V)(logits, rows)
        assert out.token_ids[0] == 5 and out.token_ids[2] == 5
    assert torch.equal(logits, before)  # logprobs are read from the caller's logits: never masked in place
    both = logits[[0, 2]]
    kept = both.clone()
    only = Sampler(V)(both, [rows[0], rows[2]])  # every row constrained: the masked copy is made in one pass
    assert only.token_ids == [5, 5] and torch.equal(both, kept)


# ------------------------------------------------------------------ with speculative decoding


def test_constrained_streams_stay_valid_and_exact_with_speculation_on(tokenizer):
    """Drafts a grammar refuses are never verified, and every verified position is masked: with speculation
    on, greedy constrained output is the same as without, seeded samples are the same, and all validate."""
    from phaseserve.stack.engine import Engine

    spec = grammar.json_schema(NESTED)
    prompt = tokenizer.encode("Describe three pets as JSON, each with the same fields:")
    off = Engine(BUNDLED, dtype="float32")
    on = Engine(BUNDLED, dtype="float32", speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                        "adaptive": False})
    greedy = SamplingParams(max_tokens=200, temperature=0.0)
    sampled = [SamplingParams(max_tokens=200, temperature=1.0, seed=s) for s in range(8)]
    for params in [[greedy], sampled]:
        want = off.generate([prompt] * len(params), params, grammars=[spec] * len(params))
        got = on.generate([prompt] * len(params), params, grammars=[spec] * len(params))
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for c in got:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(c.token_ids)), NESTED)
    assert on.scheduler.stats().spec_decoding.num_accepted_tokens > 0  # drafts were verified under the grammar
