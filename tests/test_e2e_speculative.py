"""Speculative decoding end to end: the official openai client against a whole stack whose worker speculates
(`--speculative-config`, float32), compared with the in-process engine without speculation. Streamed text
loses and repeats no token, n > 1 choices each equal the reference, a stop string in the middle of the text
(a token-level stop inside an accepted run: tests/test_speculative.py) ends it where it would without
speculation, and /metrics counts the drafts."""

from __future__ import annotations

import openai
import pytest
import requests

from e2e_stack import running_stack
from phaseserve.models.model_source import bundled_model_path
from phaseserve.params import SamplingParams
from phaseserve.speculative_config import SpeculativeConfig
from phaseserve.stack.engine import Engine

MAX_TOKENS = 48
SOURCE = ('def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n'
          '    return 2 * (width + height)\n\n\n')
PROMPTS = [SOURCE * 2 + "def area(width, height):\n", "Once upon a time, " * 6, SOURCE + "# the same again:\n"]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
    with running_stack(bundled_model_path(), tmp_path_factory.mktemp("spec-logs"), dtype="float32",
                       speculative_config=spec) as running:
        yield running


@pytest.fixture(scope="module")
def reference():
    engine = Engine(bundled_model_path(), dtype="float32")
    ids = [engine.encode(p) for p in PROMPTS]
    done = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return ids, [c.text for c in done]


@pytest.fixture(scope="module")
def client(spec_stack):
    with openai.OpenAI(base_url=spec_stack.api_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_streamed_text_equals_the_reference_without_speculation(client, spec_stack, reference):
    ids, texts = reference
    for prompt_ids, text in zip(ids, texts):
        chunks = list(client.completions.create(
            model=spec_stack.model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        (usage,) = [c.usage for c in chunks if c.usage]
        assert usage.completion_tokens == MAX_TOKENS  # no token repeated, none lost
    metrics = requests.get(spec_stack.base_url + "/metrics", timeout=10).text
    drafted = float(next(line.split()[-1] for line in metrics.splitlines()
                         if line.startswith("phaseserve_spec_decode_num_draft_tokens ")))
    accepted = float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("phaseserve_spec_decode_num_accepted_tokens ")))
    assert drafted > 0 and 0 < accepted <= drafted
    assert 'phaseserve_spec_decode_acceptance_rate_per_position{position="1"}' in metrics


def test_n_choices_each_equal_the_reference(client, spec_stack, reference):
    ids, texts = reference
    r = client.completions.create(model=spec_stack.model, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0,
                                  n=3, stream=True, extra_body={"ignore_eos": True})
    got = ["", "", ""]
    for chunk in r:
        for choice in chunk.choices:
            got[choice.index] += choice.text
    assert got == [texts[0]] * 3


def test_a_stop_string_ends_the_text_where_it_would_without_speculation(client, spec_stack, reference):
    ids, texts = reference
    text = texts[0]
    stop = text[len(text) // 2:len(text) // 2 + 6]
    cut = text[:text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=spec_stack.model, prompt=ids[0], max_tokens=MAX_TOKENS,
                                      temperature=0, stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            out = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            out, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert out == cut and finish == ["stop"]
