"""The bundled model folder: standard HF layout that transformers loads, and weights that learned Python."""

import json
import re
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import phaseserve

BUNDLED = Path(phaseserve.__file__).parent / "bundled_model"
MAX_FOLDER_BYTES = 25 * 1024 * 1024

# Hand-written here, so it is in neither the training nor the held-out files.
UNSEEN_PYTHON = '''import os
import sys


class Inventory:
    """Keep track of items and how many of each are in stock."""

    def __init__(self, items=None):
        self.items = dict(items or {})

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must not be negative")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def remove(self, name):
        try:
            del self.items[name]
        except KeyError:
            return False
        return True


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    path = os.path.join(os.getcwd(), argv[0])
    with open(path, encoding="utf-8") as f:
        for line in f:
            print(line.rstrip())
    return 0
'''

UTF8_SAMPLES = [
    "def f(x):\n\treturn x ** 2  # square\n",
    "emoji: 😀🐍🚀 👩‍👩‍👧‍👦 flags 🇯🇵",
    "CJK: 你好，世界 こんにちは 안녕하세요",
    "accents: naïve café Ångström, combining: e\u0301",
    "rtl: مرحبا שלום, math: ∑∫√∞ ≠ ≤",
    "\x00 control \x7f chars and \u2028 separators \ufeff",
    "   leading and trailing whitespace   \n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED)


@pytest.fixture(scope="module")
def model():
    # bf16: fp32 GEMMs on a few rows are pathologically slow on this CPU.
    return AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def eval_report():
    return json.loads((BUNDLED / "eval.json").read_text())


def test_folder_has_the_standard_hf_layout():
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "README.md",
        "eval.json",
    ):
        assert (BUNDLED / name).is_file(), name
    config = json.loads((BUNDLED / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    with safe_open(BUNDLED / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


def test_folder_is_at_most_25_mb():
    size = sum(p.stat().st_size for p in BUNDLED.iterdir() if p.is_file())
    assert size <= MAX_FOLDER_BYTES, f"{size / 1e6:.1f} MB"


def test_generation_stops_on_eos_and_im_end(tokenizer):
    gen = json.loads((BUNDLED / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.pad_token is not None


@pytest.mark.parametrize("text", UTF8_SAMPLES)
def test_tokenizer_round_trips_utf8(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids and max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == text
    # The raw `tokenizers` file (what phaseserve itself loads) agrees.
    raw = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert raw.decode(ids) == text


def test_plain_prompts_start_with_bos(tokenizer):
    ids = tokenizer("def f():")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_renders_with_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Explain `os.path.join`."},
    ]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    expected = (
        "<|bos|><|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nExplain `os.path.join`.<|im_end|>\n"
    )
    assert without == expected
    assert with_prompt == expected + "<|im_start|>assistant\n"
    # Rendering the template from tokenizer_config.json with plain jinja2 (as a
    # server without transformers does) gives the same text.
    template = json.loads((BUNDLED / "tokenizer_config.json").read_text())["chat_template"]
    rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=True, bos_token="<|bos|>")
    assert rendered == with_prompt
    ids = tokenizer(with_prompt, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")]


def test_held_out_loss_is_far_below_untrained(eval_report):
    trained, untrained = eval_report["held_out_loss"], eval_report["untrained_held_out_loss"]
    # An untrained model sits near ln(vocab) = 8.3 nats; a trained one well under half of that.
    assert untrained > 7.5
    assert trained < untrained - 3.0, (trained, untrained)
    assert eval_report["held_out_tokens"] > 10_000


def test_model_card_states_the_figures_and_licence(eval_report):
    card = (BUNDLED / "README.md").read_text()
    assert f"{eval_report['held_out_loss']:.4f}" in card
    assert f"{eval_report['untrained_held_out_loss']:.4f}" in card
    assert "PSF" in card
    assert eval_report["command"] in card


def _mean_loss(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_bundled_weights_beat_random_init_on_unseen_code(model, tokenizer):
    ids = tokenizer(UNSEEN_PYTHON, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    untrained = LlamaForCausalLM(AutoConfig.from_pretrained(BUNDLED)).to(torch.bfloat16).eval()
    trained_loss, untrained_loss = _mean_loss(model, ids), _mean_loss(untrained, ids)
    assert trained_loss < untrained_loss - 3.0, (trained_loss, untrained_loss)


def test_greedy_completion_of_def_is_a_function_signature(model, tokenizer):
    # The prompt ends in "def", not "def ": byte-level BPE glues a space to the
    # word after it, so a prompt ending in a bare space is off-distribution.
    prompt = "class Stack:\n    def"
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=24)
    completion = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    # A method signature: space, name, parenthesised arguments, colon, newline.
    assert re.match(r" \w+\(.*\)( -> .+)?:\n", completion), completion
