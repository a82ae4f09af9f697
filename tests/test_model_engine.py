"""The in-process engine (scheduler policy + runner) produces what transformers does."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import make_model
from phaseserve.stack.engine import Engine
from phaseserve.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("eng"), "llama_gqa_llama3")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 90, 41, 12, 60, 7)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return path, prompts, expected


def test_engine_greedy_matches_transformers_with_chunking(setup):
    path, prompts, expected = setup
    engine = Engine(path, dtype="float32", num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
    out = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in out] == expected
    assert all(c.finish_reason == "length" for c in out)
    assert engine.num_steps > 24  # 4 seqs at a time and 32-token steps: many steps, chunked prefills
    assert engine.scheduler.config.attention_horizon == engine.runner.attention_horizon > 0  # cost model on
    assert not engine.runner.seqs  # every finished sequence was released


def test_engine_preemption_keeps_outputs_exact(setup):
    """A KV cache too small for every sequence at once forces preemption by recompute."""
    path, prompts, expected = setup
    engine = Engine(path, dtype="float32", num_blocks=20, block_size=8, max_num_seqs=6, max_num_batched_tokens=64)
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5)
    out = engine.generate(prompts + prompts[:2], [GREEDY] * len(prompts) + [seeded, seeded])
    assert engine.scheduler.stats().counters.num_preemptions > 0
    assert [c.token_ids for c in out[:len(prompts)]] == expected
    roomy = Engine(path, dtype="float32", num_blocks=256, attention_horizon=0)  # 0: every token costs 1
    assert roomy.scheduler.config.attention_horizon == 0
    ref = roomy.generate(prompts[:2], seeded)
    assert [c.token_ids for c in out[len(prompts):]] == [c.token_ids for c in ref]


def test_engine_text_prompts_and_logprobs(setup):
    path, _, _ = setup
    engine = Engine(path, dtype="bfloat16", num_blocks=64)
    out = engine.generate(["Hello world", "The quick brown fox"],
                          SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True))
    for c in out:
        assert len(c.token_ids) == 5 and len(c.logprobs) == 5 and isinstance(c.text, str)
        assert c.text == engine.decode(c.token_ids)
        # greedy: the chosen token is the top-1 of the raw distribution
        assert all(top[0][0] == tok for tok, (_, top) in zip(c.token_ids, c.logprobs))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[5] * 600])
