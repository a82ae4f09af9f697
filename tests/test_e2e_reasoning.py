"""A reasoning model end to end (--reasoning-parser deepseek_r1), with the official openai client: the thinking
comes back in `reasoning_content` (chat), streamed as its own deltas, and as a reasoning item (Responses),
separate from the content; a json_schema holds for the answer after the thinking, and validates.

The model is the tiny random-weight test model with `<think>` and `</think>` added to its vocabulary and a
chat template that opens the thinking at the end of its generation prompt (as DeepSeek-R1's does). Random
weights do not close their thinking by themselves: the requests bias the `</think>` token (OpenAI's
`logit_bias`), so the thinking ends after a few tokens, wherever the sampler puts it."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from e2e_stack import running_stack
from model_factory import make_model, write_tokenizer

TEMPLATE = ("{% if reasoning_effort %}<|system|>Reasoning effort: {{ reasoning_effort }}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
SEEDS = range(6)


def thinking_model(tmp) -> tuple:
    base = make_model(tmp / "base", "llama", max_position_embeddings=512)
    path = tmp / "thinker"
    shutil.copytree(base, path)
    write_tokenizer(path, 318)  # two rows of the model's vocabulary left for the tags
    # the tags as two more pieces of the BPE's vocabulary: plain text (an added token would be special to the
    # grammar engine), one token each, that the model can sample (the prompt spells them in smaller pieces)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["model"]["vocab"].update({"<think>": 318, "</think>": 319})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    assert tok.get_vocab_size() == 320
    return path, tok.token_to_id("</think>")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, end_id = thinking_model(tmp_path_factory.mktemp("thinking-model"))
    with running_stack(path, tmp_path_factory.mktemp("reasoning-logs"), reasoning_parser="deepseek_r1") as stack:
        with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            yield stack, client, {str(end_id): 4}


def _chat(served, seed: int, **extra):
    stack, client, bias = served
    return client.chat.completions.create(model=stack.model, messages=MESSAGES, response_format=FORMAT,
                                          temperature=1.0, seed=seed, max_tokens=200, logit_bias=bias, **extra)


def test_reasoning_content_is_separate_and_the_json_schema_holds_after_it(served):
    thoughts = []
    for seed in SEEDS:
        choice = _chat(served, seed).choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        assert isinstance(reasoning, str) and "</think>" not in reasoning and "<think>" not in reasoning
        jsonschema.validate(json.loads(choice.message.content), PET)
        assert choice.finish_reason == "stop"
        thoughts.append(reasoning)
    assert sum(1 for t in thoughts if t) >= len(SEEDS) // 2, thoughts  # the model did think before answering


def test_streamed_reasoning_deltas_come_first_and_add_up_to_the_whole(served):
    stack, client, bias = served
    for seed in SEEDS[:3]:
        whole = _chat(served, seed).choices[0].message
        chunks = list(_chat(served, seed, stream=True))
        kinds = []
        reasoning, content = "", ""
        for c in chunks:
            delta = c.choices[0].delta if c.choices else None
            if delta is None:
                continue
            r = (delta.model_extra or {}).get("reasoning_content")
            if r:
                kinds.append("r")
                reasoning += r
            if delta.content:
                kinds.append("c")
                content += delta.content
        assert "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")  # thinking, then answer
        assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content


def test_responses_give_a_reasoning_item_then_the_message(served):
    stack, client, bias = served
    kwargs = dict(model=stack.model, input="Describe a pet.", temperature=1.0, max_output_tokens=200,
                  text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
                  extra_body={"logit_bias": bias, "seed": 1})
    whole = _chat(served, 1).choices[0].message
    r = client.responses.create(**kwargs)
    assert [i.type for i in r.output] == (["reasoning", "message"] if whole.model_extra["reasoning_content"]
                                          else ["message"])
    jsonschema.validate(json.loads(r.output_text), PET)
    with client.responses.create(stream=True, **kwargs) as stream:
        events = list(stream)
    types = [e.type for e in events]
    if "response.reasoning_text.delta" in types:
        assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert types[-1] == "response.completed" and events[-1].response.output_text == r.output_text


def test_reasoning_effort_reaches_a_template_that_reads_it(served):
    stack, client, bias = served
    base = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=1)
    high = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=1, reasoning_effort="high")
    assert high.usage.prompt_tokens > base.usage.prompt_tokens
