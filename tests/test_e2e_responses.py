"""The Responses API end to end, with the official openai client on a whole stack with API keys (the bundled
model): created streamed and not, stored in Redis and read back, a three-turn conversation by
previous_response_id whose second turn goes to another gateway and whose third comes after that gateway
restarted (the earlier turns' prefix cache is reused), a function tool round trip, a json_schema output
that validates, another key's GET is 404, and the OpenAI Agents SDK running an agent with one tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from typing import Annotated

import requests
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from e2e_stack import ROOT, running_stack, wait_for
from phaseserve.redis_server import free_port

KEY_A, KEY_B = "key-alpha", "key-beta"
INSTRUCTIONS = ("You are a helpful assistant for a small company. Answer briefly and politely, in plain "
                "English, and say when you do not know something.")
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(e2e_model, tmp_path_factory):
    with running_stack(e2e_model, tmp_path_factory.mktemp("responses-logs"), api_key=f"{KEY_A},{KEY_B}") as stack:
        yield stack


def _client(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(served):
    with _client(served.api_url) as c:
        yield c


class SecondGateway:
    """Another gateway process on the stack's Redis (as a second machine's gateway would be)."""

    def __init__(self, stack, log_path):
        self.stack, self.log_path, self.proc, self.url = stack, log_path, None, ""

    def start(self) -> str:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phaseserve.gateway", "--redis-url", self.stack.redis_url, "--model",
             str(self.stack.model_dir), "--key-prefix", self.stack.key_prefix, "--port", str(port),
             "--api-key", f"{KEY_A},{KEY_B}", "--served-model-name", self.stack.model],
            env=env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        assert wait_for(healthy, 60.0, 0.2), open(self.log_path).read()[-3000:]
        return self.url + "/v1"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def second_gateway(served, tmp_path):
    gw = SecondGateway(served, tmp_path / "second-gateway.log")
    yield gw
    gw.stop()


def test_a_response_not_streamed_is_stored_and_read_back_only_with_its_key(client, served):
    r = client.responses.create(model=served.model, input="Say hello.", instructions=INSTRUCTIONS,
                                max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.status == r.status
    with _client(served.api_url, KEY_B) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError) as e:  # nor continue it
            other.responses.create(model=served.model, input="Go on.", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_streamed_response_sends_openai_typed_events_in_order(client, served):
    with client.responses.create(model=served.model, input="Tell me about the sea.", max_output_tokens=16,
                                 temperature=0, stream=True) as stream:
        events = list(stream)
    final = events[-1].response
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-4:-1] == tail and types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[-4].text
    assert final.usage.output_tokens == 16 and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    # the same, not streamed: greedy, so the same text
    whole = client.responses.create(model=served.model, input="Tell me about the sea.", max_output_tokens=16,
                                    temperature=0)
    assert whole.output_text == text


def test_a_three_turn_conversation_crosses_gateways_and_a_restart(client, served, second_gateway):
    turn1 = client.responses.create(model=served.model, instructions=INSTRUCTIONS, max_output_tokens=8,
                                    input="My name is Ada. Remember it.", temperature=0)
    with _client(second_gateway.start()) as there:
        # instructions are not carried over (OpenAI's rule): each turn sends them, as an agent does
        turn2 = there.responses.create(model=served.model, previous_response_id=turn1.id, max_output_tokens=8,
                                       instructions=INSTRUCTIONS,
                                       input=[{"role": "user", "content": "What is my name?"}], temperature=0)
    assert turn2.previous_response_id == turn1.id and turn2.output_text
    # the second turn re-rendered the first: its prompt's leading blocks came from the prefix cache
    assert turn2.usage.input_tokens > turn1.usage.input_tokens + turn1.usage.output_tokens
    assert turn2.usage.input_tokens_details.cached_tokens >= 16
    second_gateway.stop()
    with _client(second_gateway.start()) as restarted:
        turn3 = restarted.responses.create(model=served.model, previous_response_id=turn2.id, max_output_tokens=8,
                                           instructions=INSTRUCTIONS,
                                           input="Thank you.", temperature=0)
        stored = restarted.responses.retrieve(turn1.id)
    assert turn3.usage.input_tokens > turn2.usage.input_tokens + turn2.usage.output_tokens
    assert turn3.usage.input_tokens_details.cached_tokens > turn2.usage.input_tokens_details.cached_tokens
    assert stored.output_text == turn1.output_text
    # the conversation is the three turns: the same prompt rendered as chat messages counts the same tokens
    messages = [{"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": "My name is Ada. Remember it."},
                {"role": "assistant", "content": turn1.output_text},
                {"role": "user", "content": "What is my name?"},
                {"role": "assistant", "content": turn2.output_text}, {"role": "user", "content": "Thank you."}]
    counted = requests.post(served.base_url + "/tokenize", headers={"Authorization": f"Bearer {KEY_A}"},
                         json={"model": served.model, "messages": messages}, timeout=30).json()["count"]
    assert counted == turn3.usage.input_tokens


def test_a_running_response_is_read_and_cancelled_from_another_gateway(client, served, second_gateway):
    there_url = second_gateway.start()  # before the stream: a gateway's start can outlast 2000 fast tokens
    stream = client.responses.create(model=served.model, input="Count to a thousand.", max_output_tokens=2000,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = iter(stream)
    response_id = next(events).response.id
    for ev in events:
        if ev.type == "response.output_text.delta":
            break
    with _client(there_url) as there:
        assert there.responses.retrieve(response_id).status == "in_progress"
        assert there.responses.cancel(response_id).status == "cancelled"
    rest = list(events)
    assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
    assert rest[-1].response.usage.output_tokens < 2000
    assert client.responses.retrieve(response_id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as e:  # it has ended
        client.responses.cancel(response_id)
    assert e.value.body["param"] == "response_id"


def test_a_background_response_is_polled_to_its_end_and_one_is_cancelled(client, served):
    started = client.responses.create(model=served.model, input="Say hello.", max_output_tokens=12, temperature=0,
                                      background=True)
    assert started.background and started.status == "in_progress" and not started.output
    done = wait_for(lambda: (r := client.responses.retrieve(started.id)).status != "in_progress" and r, 60.0, 0.2)
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens <= 12
    long = client.responses.create(model=served.model, input="Count to a thousand.", max_output_tokens=2000,
                                   temperature=0, background=True, extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    ended = wait_for(lambda: (r := client.responses.retrieve(long.id)).usage is not None and r, 60.0, 0.2)
    assert ended.status == "cancelled" and ended.usage.output_tokens < 2000


def test_a_function_tool_round_trip(client, served):
    first = client.responses.create(model=served.model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=1.0, max_output_tokens=60)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    answer = client.responses.create(model=served.model, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": json.dumps({"city": args["city"], "sky": "sunny"})}],
                                     max_output_tokens=10, temperature=0)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    # the same tools render the same system prompt: the first turn's blocks are reused
    assert answer.usage.input_tokens_details.cached_tokens > 0
    # streamed: the call's arguments arrive as function_call_arguments events
    with client.responses.stream(model=served.model, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    assert types[-1] == "response.completed"


def test_a_json_schema_output_validates(client, served):
    for stream in (False, True):
        kwargs = dict(model=served.model, input="Describe a pet as JSON.", temperature=1.0, max_output_tokens=80,
                      text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}})
        if stream:
            with client.responses.stream(**kwargs) as s:
                text = s.get_final_response().output_text
        else:
            text = client.responses.create(**kwargs).output_text
        jsonschema.validate(json.loads(text), PET)


def test_bad_requests_are_openai_errors_naming_the_field(client, served):
    cases = [({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
             ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
             ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
             ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
             ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id")]
    for body, param in cases:
        resp = requests.post(served.api_url + "/responses", json={"model": served.model, **body},
                          headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
        assert resp.status_code in (400, 404), (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    doc = requests.get(served.base_url + "/openapi.json", timeout=30).json()
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"} <= set(doc["paths"])
    assert "ResponsesRequest" in doc["components"]["schemas"]


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(served):
    import agents  # the OpenAI Agents SDK (openai-agents, in the test extras)

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is sunny in {city}."

    class Report(BaseModel):  # the answer's shape: a JSON document the grammar ends, so the turn completes
        city: str = Field(max_length=20)
        summary: str = Field(max_length=40)

    model = agents.OpenAIResponsesModel(model=served.model,
                                        openai_client=openai.AsyncOpenAI(base_url=served.api_url, api_key=KEY_A,
                                                                         max_retries=0, timeout=120))
    # the tiny model does not call tools by itself: the first turn's call is forced through the grammar, then
    # the SDK resets tool_choice (reset_tool_choice) and the model answers
    agent = agents.Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                         model=model, output_type=Report,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0.0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1 and isinstance(seen[0], str) and len(seen[0]) <= 20
    assert isinstance(result.final_output, Report)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == 1 and len(outputs) == 1 and outputs[0].output == f"It is sunny in {seen[0]}."
