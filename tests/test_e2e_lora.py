"""LoRA adapters on a real stack (embedded Redis, scheduler, worker, gateway as processes; the official openai
client over HTTP): one served from the start (--lora-modules), one loaded and unloaded at run time through
vLLM's endpoints; /v1/models lists them with their parent; requests for both adapters and the base model at
once give peft's merged models' greedy text (float32); the prefix cache shares no block between adapters;
bad requests get OpenAI-format errors naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest

from e2e_stack import running_stack
from lora_factory import make_adapter, merged_greedy
from phaseserve.models.tokenizer import Tokenizer

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(e2e_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e-adapters")
    return {"first": make_adapter(e2e_model, out, seed=11),
            "second": make_adapter(e2e_model, out, seed=12, target_modules=("q_proj", "v_proj", "down_proj"), r=4)}


@pytest.fixture(scope="module")
def lora_stack(e2e_model, adapters, tmp_path_factory):
    with running_stack(e2e_model, tmp_path_factory.mktemp("lora-stack-logs"), dtype="float32", max_loras=2,
                       lora_modules=[f"first={adapters['first']}"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(lora_stack):
    with openai.OpenAI(base_url=lora_stack.api_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@dataclass
class Answer:
    status_code: int
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


def _request(url: str, body: dict | None = None) -> Answer:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def _post(stack, path: str, body: dict) -> Answer:
    return _request(stack.api_url + path, body)


def _complete(client, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"ignore_eos": True})


def test_adapters_are_served_loaded_and_unloaded_at_run_time(lora_stack, client, adapters, e2e_model):
    base = lora_stack.model
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base, "first"}
    assert models["first"].model_extra["parent"] == base and models["first"].model_extra["root"] == str(adapters["first"])

    r = _post(lora_stack, "/load_lora_adapter", {"lora_name": "second", "lora_path": str(adapters["second"])})
    assert r.status_code == 200 and "second" in r.text
    assert {m.id for m in client.models.list().data} == {base, "first", "second"}
    assert client.models.retrieve("second").model_extra["parent"] == base

    # both adapters and the base model at once: the batches mix them; each gives its merged model's text
    prompt = [5, 17, 42, 99, 7, 63, 120, 8]
    expected = {name: merged_greedy(e2e_model, adapters.get(name), [prompt], MAX_TOKENS)[0]
                for name in ("first", "second", None)}
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the text
    jobs = [name for name in ("first", "second", None) for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda name: _complete(client, name or base, prompt), jobs))
    tok = Tokenizer.from_folder(str(e2e_model))
    for name, out in zip(jobs, outs):
        assert out.model == (name or base)  # the response names the model it ran
        assert out.choices[0].text == tok.decode(expected[name]), name

    r = _post(lora_stack, "/unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 200
    assert {m.id for m in client.models.list().data} == {base, "first"}
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "second", prompt)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_the_prefix_cache_shares_no_block_between_adapters(lora_stack, client, adapters):
    _post(lora_stack, "/load_lora_adapter", {"lora_name": "other", "lora_path": str(adapters["second"])})
    prompt = list(range(300, 300 + 70))  # four full blocks and a bit
    cached = {}
    for model in ("first", "first", "other", lora_stack.model, "other"):
        usage = _complete(client, model, prompt, max_tokens=2).usage
        cached.setdefault(model, []).append(usage.prompt_tokens_details.cached_tokens)
    assert cached["first"] == [0, 64]  # its own second request reads its first's blocks
    assert cached["other"] == [0, 64]  # but not the first adapter's, and the base model neither
    assert cached[lora_stack.model] == [0]
    _post(lora_stack, "/unload_lora_adapter", {"lora_name": "other"})


def test_bad_adapter_requests_are_openai_errors_naming_the_field(lora_stack, adapters, tmp_path):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 400, "lora_path", "no adapter folder"),
        ({"lora_name": "first", "lora_path": str(adapters["second"])}, 400, "lora_name", "already been loaded"),
        ({"lora_name": lora_stack.model, "lora_path": str(adapters["second"])}, 400, "lora_name", "base model"),
        ({"lora_path": str(adapters["second"])}, 400, "lora_name", ""),
        ({"lora_name": 3, "lora_path": "p"}, 400, "lora_name", ""),
    ]
    for body, status, param, message in cases:
        r = _post(lora_stack, "/load_lora_adapter", body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"] and err["type"] == "invalid_request_error"
    r = _post(lora_stack, "/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "lora_name"
    r = _request(lora_stack.api_url + "/models/never-loaded")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_and_the_responses_api_run_an_adapter(lora_stack, client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = client.chat.completions.create(model="first", messages=messages, max_tokens=8, temperature=0.0)
    base = client.chat.completions.create(model=lora_stack.model, messages=messages, max_tokens=8, temperature=0.0)
    assert chat.model == "first" and chat.choices[0].message.content != base.choices[0].message.content
    resp = client.responses.create(model="first", input=messages, max_output_tokens=8, temperature=0.0)
    assert resp.model == "first" and resp.output_text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="never-loaded", input=messages, max_output_tokens=8)
