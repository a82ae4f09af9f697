"""LoRA adapters in the model runner: two adapters (trained with peft) and the base model in ONE batch give the
greedy tokens of peft's merged models (float32), a row's logits have the same bits however its step is
batched, adapters load on demand and the least recently used is evicted past --max-loras, bad folders are
errors naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lora_factory import ALL_MODULES, make_adapter, merged_greedy
from model_factory import make_model
from phaseserve.lora import LoraError, parse_lora_module, read_adapter_config
from phaseserve.params import SamplingParams
from phaseserve.stack.engine import Engine
from phaseserve.wire import LoraRef, ScheduledChunk, SeqStart, StepPlan

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lora-model"), "qwen2")  # qkv biases and GQA


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    # one on every module, one on attention only with rsLoRA's scaling and another rank
    return {"all": make_adapter(model, out, seed=1),
            "attn": make_adapter(model, out, seed=2, target_modules=("q_proj", "v_proj", "o_proj"), r=4,
                                 lora_alpha=8, use_rslora=True)}


PROMPTS = [[5, 17, 42, 99, 7, 63, 120], [33, 8, 250, 12], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]]


def test_two_adapters_and_the_base_model_in_one_batch_match_peft_merged(model, adapters):
    refs = {name: LoraRef(name, str(path)) for name, path in adapters.items()}
    prompts, loras, expected = [], [], []
    for name in (None, "all", "attn"):
        want = merged_greedy(model, adapters[name] if name else None, PROMPTS, MAX_TOKENS)
        prompts += PROMPTS
        loras += [refs[name] if name else None] * len(PROMPTS)
        expected += want
    # the adapters change the text (else this test would show nothing)
    assert expected[:3] != expected[3:6] and expected[:3] != expected[6:] and expected[3:6] != expected[6:]
    engine = Engine(model, dtype="float32", seed=0, max_loras=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate(prompts, greedy, loras=loras)
    assert [c.token_ids for c in out] == expected
    # the nine were admitted at once (their prefills and decodes share steps); each adapter was loaded once
    assert engine.runner.loras.num_loads == 2


def _step_logits(runner, plan):
    """Run a plan and return the float32 logits of its sampled rows, in the runner's packed order."""
    captured = {}
    forward = runner.model.forward

    def spy(inp, kv, fp32=True):
        logits = forward(inp, kv, fp32=True)
        captured["logits"] = logits.clone()
        return logits

    runner.model.forward = spy
    try:
        runner.execute(plan)
    finally:
        runner.model.forward = forward
    return captured["logits"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_logits_are_the_same_bits_however_its_step_is_batched(model, adapters, dtype):
    """One numerics: a LoRA sequence's prefill row has the same logits bits alone and in steps with other
    adapters' and the base model's rows in any number (1 to 40 more rows of its own adapter, so its tiles are
    shared in other ways). Decodes, chunkings and recomputes: tests/test_one_numerics.py."""
    from phaseserve.workers.runner import ModelRunner

    runner = ModelRunner(model, dtype=dtype, num_blocks=256, block_size=16)
    ref_all, ref_attn = LoraRef("all", str(adapters["all"])), LoraRef("attn", str(adapters["attn"]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    probe = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    blocks = iter(range(256))

    def run(companions: list[tuple[LoraRef | None, int]]) -> torch.Tensor:
        """The probe's prefill logits in one step beside `companions` (adapter, prompt length) prefills."""
        runner.reset()
        starts, chunks = [], []
        for i, (ref, n) in enumerate([(ref_all, len(probe))] + companions):
            toks = probe if i == 0 else [(7 * i + j) % 300 + 3 for j in range(n)]
            table = [next(blocks) % 256 for _ in range(-(-n // 16) + 1)]
            starts.append(SeqStart(f"s{i}", "", toks, params, lora=ref))
            chunks.append(ScheduledChunk(f"s{i}", 0, n, table))
        logits = _step_logits(runner, StepPlan(0, "w", starts=starts, chunks=chunks))
        # the runner packs one-token chunks first, then the prefills in plan order: the probe's is the first
        return logits[sum(n == 1 for _, n in companions)]

    alone = run([])
    for companions in ([(None, 5)], [(ref_attn, 30), (None, 3)], [(ref_all, 40)], [(ref_all, 1), (ref_attn, 1)],
                       [(None, 17), (ref_all, 7), (ref_attn, 16), (ref_all, 15)]):
        got = run(companions)
        assert torch.equal(got, alone), companions
    runner.reset()  # and the adapter changes the row
    assert not torch.equal(alone, _base_prefill(runner, probe, params))


def _base_prefill(runner, tokens, params):
    return _step_logits(runner, StepPlan(0, "w", starts=[SeqStart("b", "", tokens, params)],
                                         chunks=[ScheduledChunk("b", 0, len(tokens), [0, 1])]))[0]


def test_base_rows_keep_their_bits_beside_adapters(model, adapters):
    from phaseserve.workers.runner import ModelRunner

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = [9, 10, 11, 12, 13, 14, 15]
    runner = ModelRunner(model, dtype="float32", num_blocks=64, block_size=16)
    alone = _base_prefill(runner, tokens, params)
    runner.reset()
    ref = LoraRef("all", str(adapters["all"]))
    mixed = _step_logits(runner, StepPlan(0, "w", starts=[SeqStart("b", "", tokens, params),
                                                          SeqStart("l", "", tokens, params, lora=ref)],
                                          chunks=[ScheduledChunk("b", 0, len(tokens), [0, 1]),
                                                  ScheduledChunk("l", 0, len(tokens), [2, 3])]))
    assert torch.equal(mixed[0], alone)
    assert not torch.equal(mixed[1], alone)


def test_adapters_load_on_demand_and_the_least_recently_used_is_evicted(model, adapters, tmp_path):
    third = tmp_path / "third"
    shutil.copytree(adapters["attn"], third)
    refs = [LoraRef("all", str(adapters["all"])), LoraRef("attn", str(adapters["attn"])),
            LoraRef("third", str(third))]
    engine = Engine(model, dtype="float32", max_loras=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    held = engine.runner.loras
    engine.generate([[5, 6, 7]], greedy, loras=[refs[0]])
    engine.generate([[5, 6, 7]], greedy, loras=[refs[1]])
    assert held.keys() == [refs[0].key, refs[1].key] and held.num_loads == 2
    engine.generate([[5, 6, 7]], greedy, loras=[refs[0]])  # used again: now the most recent
    assert held.num_loads == 2
    engine.generate([[5, 6, 7]], greedy, loras=[refs[2]])
    assert held.keys() == [refs[0].key, refs[2].key] and held.num_evictions == 1
    # three adapters in one batch with room for two: all are held for the step, then one goes
    out = engine.generate([[5, 6, 7]] * 3, greedy, loras=refs)
    assert all(c.finish_reason == "length" for c in out)
    assert len(held.keys()) == 2


def test_an_adapter_whose_folder_went_away_fails_its_sequence_alone(model, adapters, tmp_path):
    gone = tmp_path / "gone"
    shutil.copytree(adapters["all"], gone)
    engine = Engine(model, dtype="float32")
    ref = LoraRef("gone", str(gone))
    shutil.rmtree(gone)
    out = engine.generate([[5, 6, 7], [5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                          loras=[ref, None])
    assert out[0].finish_reason == "error" and "no adapter folder" in out[0].error
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 3


def test_adapter_config_checks(adapters, tmp_path):
    cfg = read_adapter_config(str(adapters["attn"]))
    assert (cfg.r, cfg.target_modules, cfg.use_rslora) == (4, ("q_proj", "v_proj", "o_proj"), True)
    assert cfg.scaling == pytest.approx(8 / 2)  # alpha / sqrt(r)
    assert read_adapter_config(str(adapters["all"])).target_modules == ALL_MODULES
    with pytest.raises(LoraError, match="no adapter folder"):
        read_adapter_config(str(tmp_path / "nowhere"))
    with pytest.raises(LoraError, match="above --max-lora-rank 4"):
        read_adapter_config(str(adapters["all"]), max_rank=4)
    bad = tmp_path / "bad"
    shutil.copytree(adapters["all"], bad)
    for change, message in (({"target_modules": ["embed_tokens"]}, "embed_tokens"),
                            ({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                            ({"r": 0}, "positive integer")):
        d = json.loads((adapters["all"] / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**d, **change}))
        with pytest.raises(LoraError, match=message):
            read_adapter_config(str(bad))
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="not readable JSON"):
        read_adapter_config(str(bad))
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a/b"}') == ("sql", "/a/b")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("sql")


def test_an_adapter_of_another_base_model_is_refused(adapters, tmp_path):
    from phaseserve.workers.lora import load_adapter
    from phaseserve.workers.loader import read_config

    other = make_model(tmp_path, "llama", hidden_size=96)
    with pytest.raises(LoraError, match="another base model"):
        load_adapter(LoraRef("all", str(adapters["all"])), read_config(other), 16, torch.device("cpu"))
