"""Structured outputs and tool calling end to end, with the official openai client, on the bundled model and
the default one (SmolLM2), and with speculative decoding on: sampled at temperature 1, the output follows its schema, choice or regex every
time, streamed or not; a forced tool call parses and its arguments validate; malformed forms are 400s in
OpenAI's error format while other streams carry on."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import jsonschema
import openai
import pytest

from bench.grammar_schemas import NESTED
from e2e_stack import running_stack, wait_for
from phaseserve import settings

RUNS = 20
N = 10  # choices a request: RUNS in two requests

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}


# the default model again with speculative decoding on at a fixed k, so every constrained stream verifies drafts
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'


@pytest.fixture(scope="module", params=["bundled", "smollm2", "smollm2+ngram"])
def served(request, tmp_path_factory):
    name, _, method = request.param.partition("+")
    model = settings.resolve_model(name).path
    extra = {"speculative_config": NGRAM} if method else {}
    with running_stack(model, tmp_path_factory.mktemp("structured-logs"), **extra) as stack:
        stack.speculating = bool(method)
        with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client:
            yield stack, client


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


PET_MESSAGES = [{"role": "user", "content": "Describe a pet as JSON with its name, kind, owner and toys."}]


def test_json_schema_validates_every_time_at_temperature_1_not_streamed(served):
    stack, client = served
    texts = []
    for seed in range(RUNS // N):
        r = client.chat.completions.create(model=stack.model, messages=PET_MESSAGES, n=N, temperature=1.0,
                                           max_tokens=300, seed=seed, response_format=_schema_format(NESTED))
        texts += [c.message.content for c in r.choices]
        assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
    assert len(texts) == RUNS
    for text in texts:
        jsonschema.validate(json.loads(text), NESTED)


def test_json_schema_validates_every_time_at_temperature_1_streamed(served):
    stack, client = served
    texts: dict[tuple[int, int], str] = {}
    for seed in range(RUNS // N):
        stream = client.chat.completions.create(model=stack.model, messages=PET_MESSAGES, n=N, temperature=1.0,
                                                max_tokens=300, seed=100 + seed, stream=True,
                                                response_format=_schema_format(NESTED))
        for chunk in stream:
            for c in chunk.choices:
                texts[seed, c.index] = texts.get((seed, c.index), "") + (c.delta.content or "")
    assert len(texts) == RUNS
    for text in texts.values():
        jsonschema.validate(json.loads(text), NESTED)
    if stack.speculating:  # the constrained streams verified drafts, and kept some
        metrics = urllib.request.urlopen(stack.base_url + "/metrics", timeout=10).read().decode()
        accepted = re.search(r"^phaseserve_spec_decode_num_accepted_tokens ([0-9.e+]+)$", metrics, re.M)
        assert accepted and float(accepted.group(1)) > 0


def test_completions_json_object_and_guided_json(served):
    stack, client = served
    r = client.completions.create(model=stack.model, prompt="A JSON object:", max_tokens=200, temperature=1.0,
                                  n=4, seed=3, extra_body={"response_format": {"type": "json_object"}})
    for c in r.choices:
        if c.finish_reason == "stop":  # a free object may be cut by max_tokens; a finished one parses
            assert isinstance(json.loads(c.text), dict)
    r = client.completions.create(model=stack.model, prompt="A pet:", max_tokens=300, temperature=1.0, n=4,
                                  seed=4, extra_body={"guided_json": NESTED})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), NESTED)


def test_choice_and_regex_obey(served):
    stack, client = served
    options = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=stack.model, n=N, temperature=1.0, max_tokens=20,
                                       messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
                                       extra_body={"guided_choice": options})
    assert all(c.message.content in options for c in r.choices), [c.message.content for c in r.choices]
    pattern = r"[A-Z]{3}-[0-9]{4}"
    r = client.completions.create(model=stack.model, prompt="Order code:", n=N, temperature=1.0, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]
    stream = client.completions.create(model=stack.model, prompt="Order code:", temperature=1.0, max_tokens=20,
                                       stream=True, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in stream if c.choices))


def test_tool_call_round_trip(served):
    stack, client = served
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=stack.model, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", temperature=1.0, max_tokens=200, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    schema = {WEATHER_TOOL["function"]["name"]: WEATHER_TOOL, TIME_TOOL["function"]["name"]: TIME_TOOL}[
        call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    stream = client.chat.completions.create(model=stack.model, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="none", temperature=0.0, max_tokens=30, stream=True)
    chunks = list(stream)
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) > 1  # the final answer streams in pieces
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_streams_one_call_with_valid_arguments(served):
    stack, client = served
    stream = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, max_tokens=200,
        stream=True, seed=2)
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


MALFORMED = [
    ("bad schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                "schema": {"type": "integer-ish"}}}},
     "response_format"),
    ("bad regex", {"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ("unknown tool", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool message without a call", {"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "tool", "tool_call_id": "call_1", "content": "42"}]},
     "messages"),
    ("two constraints", {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
     "guided_regex"),
]


def test_malformed_forms_are_400s_while_other_streams_go_on(served):
    stack, client = served
    # a long stream runs beside the bad requests: it must finish untouched
    result = {}

    def long_stream():
        s = client.chat.completions.create(model=stack.model, messages=PET_MESSAGES, temperature=1.0, seed=9,
                                           max_tokens=300, stream=True, response_format=_schema_format(NESTED))
        text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        result["text"] = text

    t = threading.Thread(target=long_stream)
    t.start()
    for what, kwargs, param in MALFORMED:
        kwargs = dict(kwargs)
        messages = kwargs.pop("messages", [{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=stack.model, messages=messages, max_tokens=5, **kwargs)
        assert e.value.status_code == 400, what
        err = e.value.body
        assert err["type"] == "invalid_request_error" and err["param"] == param, (what, err)
        assert err["message"], what
    t.join(120)
    jsonschema.validate(json.loads(result["text"]), NESTED)
    assert client.models.list().data  # healthy


def test_metrics_show_compile_and_mask_times(served):
    stack, client = served
    client.chat.completions.create(model=stack.model, messages=PET_MESSAGES, max_tokens=300, temperature=1.0,
                                   response_format=_schema_format(NESTED))
    text = wait_for(lambda: _metric_text(stack, "phaseserve_grammar_mask_seconds_count"), 10)
    assert text, "no mask time in /metrics"
    assert float(text.split()[-1]) > 0
    compiled = _metric_text(stack, "phaseserve_grammar_compile_seconds_count")
    assert compiled and float(compiled.split()[-1]) > 0


def _metric_text(stack, name: str) -> str | None:
    body = urllib.request.urlopen(stack.base_url + "/metrics", timeout=10).read().decode()
    line = next((ln for ln in body.splitlines() if ln.startswith(name)), None)
    return line if line and float(line.split()[-1]) > 0 else None


def test_a_handed_over_sequence_keeps_its_grammar(tmp_path):
    """Prefill worker samples the first token, the decode worker rebuilds the matcher from it and goes on."""
    with running_stack(settings.bundled_model_path(), tmp_path, prefill_workers=1, decode_workers=1) as stack:
        with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client:
            r = client.chat.completions.create(model=stack.model, messages=PET_MESSAGES, n=8, temperature=1.0,
                                               max_tokens=300, seed=21, response_format=_schema_format(NESTED))
            for c in r.choices:
                jsonschema.validate(json.loads(c.message.content), NESTED)
        assert stack.scheduler_stats().get("handoff_sequences", 0) >= 8
