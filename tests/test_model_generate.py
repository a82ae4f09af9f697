"""Greedy continuations equal transformers.generate, whatever the batch and the chunking."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.workers.runner import ModelRunner

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("gen"), request.param)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 70, 17, 1, 33)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for p in prompts:  # one at a time: no padding in the reference
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    runner = ModelRunner(path, dtype="float32", num_blocks=128)
    return runner, prompts, expected


@pytest.mark.parametrize("chunk_size", [64, 7, 1])
def test_greedy_batch_matches_transformers(setup, chunk_size):
    runner, prompts, expected = setup
    seqs = runner_driver.run(runner, prompts, GREEDY, chunk_size=chunk_size)
    for s, exp in zip(seqs, expected):
        assert s.outputs == exp
        assert s.finish_reason == "length"
        assert s.offsets == list(range(NEW_TOKENS))


def test_greedy_one_at_a_time_equals_batch(setup):
    runner, prompts, expected = setup
    for p, exp in zip(prompts, expected):
        (s,) = runner_driver.run(runner, [p], GREEDY, chunk_size=16)
        assert s.outputs == exp


def test_eos_stops_and_max_model_len(tmp_path):
    path = make_model(tmp_path, "llama")
    runner = ModelRunner(path, dtype="float32", num_blocks=64, max_model_len=40)
    assert runner.eos_token_ids == frozenset({1, 2})  # config int + generation_config list
    prompt = list(range(3, 33))
    # the greedy continuation's first token, declared a stop token, ends the sequence at once
    (s,) = runner_driver.run(runner, [prompt], SamplingParams(temperature=0, max_tokens=5))
    first = s.outputs[0]
    (s2,) = runner_driver.run(runner, [prompt], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]))
    assert s2.outputs == [first] and s2.finish_reason == "stop"
    # min_tokens masks that stop token until it is reached
    (s3,) = runner_driver.run(runner, [prompt], SamplingParams(temperature=0, max_tokens=5, min_tokens=3,
                                                              stop_token_ids=[first]))
    assert first not in s3.outputs[:3] and len(s3.outputs) >= 3
    # max_model_len 40: a 30-token prompt gets at most 10 tokens
    (s4,) = runner_driver.run(runner, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert len(s4.outputs) == 10 and s4.finish_reason == "length"
