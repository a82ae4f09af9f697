"""GGUF files: the model folder made from one, its tokenizer, its weights, and what a model loaded from it generates.

The GGUFs are written here (tests/gguf_factory.py) from tiny random checkpoints the way
llama.cpp's converter writes them; transformers loading the same GGUF is the reference.
"""

import itertools
import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer as HFTokenizer, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_factory import gguf_name, llama3_rope_factors, write_gguf
from phaseserve.kernels import cpu_isa
from model_factory import make_model
from phaseserve.stack.engine import Engine
from phaseserve.models.gguf_files import GGUFError, llama3_rope_from_factors, write_model_folder
from phaseserve.params import SamplingParams
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.workers.gguf_weights import QuantizedTensor, unpermute_rows, load_gguf_weights
from phaseserve.workers.loader import ModelLoadError, load_checkpoint, read_config
from phaseserve.workers.model import rotary_inv_freq
from phaseserve.workers.runner import ModelRunner

# types gguf-py can quantize, cycled over the 2-D weights (Q/K projections get several of them)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 101, 44], [9] * 3 + list(range(20, 60)), [300, 2, 77]]


def cycle_types():
    """A `types` function for write_gguf giving the 2-D weights TYPES in turn."""
    turn = itertools.cycle(TYPES)
    return lambda name: next(turn)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def llama(tmp):
    """A GQA llama (K has fewer heads than Q, so both permutations are exercised)."""
    return make_model(tmp, "llama", num_key_value_heads=2)


def hf_generate(model, prompts, n=16):
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


# ----------------------------------------------------------------------------- weights


def test_weights_of_every_type(tmp):
    bf16_model = make_model(tmp, "llama", dtype="bfloat16", num_key_value_heads=2)  # F32 and BF16 keep it exactly
    path = write_gguf(tmp / "mixed.gguf", bf16_model, types=cycle_types())
    reader = GGUFReader(path)
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    assert set(stored.values()) == set(TYPES)
    original = {k: v.float() for k, v in load_file(bf16_model / "model.safetensors").items()}
    ours = load_gguf_weights(path, torch.float32)
    assert set(ours) == set(original)
    for t in reader.tensors:
        hf = next(k for k in original if gguf_name(k) == t.name)
        # exactly what gguf dequantizes, with llama.cpp's Q/K row order undone
        expected = dequantize(np.asarray(t.data), t.tensor_type).reshape(original[hf].shape)
        heads = {"attn_q": 4, "attn_k": 2}.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if heads:
            expected = unpermute_rows(expected, heads)
        assert torch.equal(ours[hf], torch.from_numpy(np.array(expected))), t.name
        # and the original checkpoint, within what the type keeps
        err = (ours[hf] - original[hf]).abs().max().item()
        scale = original[hf].abs().max().item()
        bound = {"F32": 0, "BF16": 0, "F16": scale / 1024, "Q8_0": scale / 100, "Q5_0": scale / 12,
                 "Q5_1": scale / 12}.get(t.tensor_type.name, scale / 6)
        assert err <= bound, (t.name, t.tensor_type.name, err, bound)

    kept = load_gguf_weights(path, torch.bfloat16, keep_quantized=True)
    for name, value in kept.items():
        ggml_type = stored[gguf_name(name)]
        if ggml_type in ("Q8_0", "Q4_0", "Q4_1"):
            assert isinstance(value, QuantizedTensor) and value.ggml_type == ggml_type
            assert value.shape == tuple(original[name].shape) and value.raw.dtype == torch.uint8
            assert value.raw.shape[0] == value.shape[0]  # rows = output features: blocks never span rows
            assert torch.equal(value.dequantize(torch.float32), ours[name])
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, ours[name].bfloat16())


def with_random_biases(model_dir, dst):
    """A copy of a checkpoint whose biases (zero from transformers' init) are random."""
    shutil.copytree(model_dir, dst, dirs_exist_ok=True)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name, value in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(value.shape, generator=g) * 0.5
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind, types", [("llama", "F32"), ("qwen2", "F16"), ("tied", "F32"), ("llama_biases", "F32")])
def test_gguf_folder_generates_like_transformers(tmp, kind, types):
    """Greedy tokens from the in-process engine on the folder == transformers on the same GGUF
    (== transformers on the original checkpoint where the GGUF keeps fp32 weights)."""
    model_dir = make_model(tmp, kind, **({"num_key_value_heads": 2} if kind == "llama" else {}))
    if kind in ("qwen2", "llama_biases"):
        model_dir = with_random_biases(model_dir, tmp / f"{kind}-biased")
    arch = "qwen2" if kind == "qwen2" else "llama"
    name = f"{kind}-{types}.gguf"
    path = write_gguf(tmp / name, model_dir, types=types, arch=arch)
    folder = write_model_folder(path, tmp / f"{kind}-{types}-folder")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == (kind == "tied")
    assert cfg["mlp_bias"] == (kind == "llama_biases") and cfg["attention_bias"] == (kind != "llama" and kind != "tied")
    assert read_config(folder).architecture == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")

    engine = Engine(folder, dtype="float32", num_blocks=32)
    ours = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    if kind != "llama_biases":  # transformers' GGUF config knows no llama biases
        reference = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=name, dtype=torch.float32).eval()
        assert ours == hf_generate(reference, PROMPTS)
    if types == "F32":
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert ours == hf_generate(original, PROMPTS)


def test_quantized_folder_runs_like_transformers(llama, tmp):
    path = write_gguf(tmp / "q.gguf", llama, types=cycle_types())
    folder = write_model_folder(path, tmp / "q-folder")
    runner = ModelRunner(folder, dtype="float32", num_blocks=32)
    assert runner.dtype == torch.float32
    engine = Engine(folder, dtype="float32", num_blocks=32)
    ours = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    reference = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file="q.gguf", dtype=torch.float32).eval()
    assert ours == hf_generate(reference, PROMPTS)
    # "auto" on a GGUF folder: its bf16 where the CPU computes bf16 natively, else float32
    native_bf16 = cpu_isa.supports("avx512-bf16")
    assert Engine(folder, num_blocks=32).runner.dtype == (torch.bfloat16 if native_bf16 else torch.float32)


def test_k_quants(tmp):
    """Q4_K and Q6_K (256-element super-blocks; gguf-py cannot quantize them, so the blocks are random)."""
    model_dir = make_model(tmp, "llama", hidden_size=256, intermediate_size=256, num_key_value_heads=2,
                           num_hidden_layers=1)
    turn = itertools.cycle(("Q4_K", "Q6_K"))
    path = write_gguf(tmp / "k.gguf", model_dir, types=lambda name: next(turn))
    reader = GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q4_K", "Q6_K"}
    ours = load_gguf_weights(path, torch.float32)
    for t in reader.tensors:
        expected = dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        heads = {"attn_q": 4, "attn_k": 2}.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if heads:
            expected = unpermute_rows(expected, heads)
        value = next(v for k, v in ours.items() if gguf_name(k) == t.name)
        assert torch.equal(value, torch.from_numpy(np.array(expected))) and value.isfinite().all(), t.name
    folder = write_model_folder(path, tmp / "k-folder")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file="k.gguf", dtype=torch.float32).eval()
    engine = Engine(folder, dtype="float32", num_blocks=32)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == hf_generate(reference, PROMPTS)


def test_llama3_rope_scaling_from_rope_freqs(tmp):
    """llama.cpp stores Llama 3 rope scaling as a rope_freqs tensor; the folder's config gives back the
    same inverse frequencies as the original config."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    model_dir = make_model(tmp, "llama_gqa_llama3", rope_scaling=scaling, head_dim=64, num_attention_heads=2,
                           num_key_value_heads=1)
    path = write_gguf(tmp / "llama3.gguf", model_dir)
    folder = write_model_folder(path, tmp / "llama3-folder")
    ours, original = read_config(folder), read_config(model_dir)
    assert ours.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(rotary_inv_freq(ours), rotary_inv_freq(original), rtol=1e-6, atol=0)
    # a ramp that is not Llama 3.1's is recovered too (fitted: only its line matters)
    other = {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 4096}
    factors = llama3_rope_factors(10000.0, 128, other)
    fitted = llama3_rope_from_factors(factors, 10000.0, 128, 8192)
    from types import SimpleNamespace
    inv = rotary_inv_freq(SimpleNamespace(head_dim=128, rope_theta=10000.0, rope_scaling=fitted))
    base = 1.0 / (10000.0 ** (torch.arange(0, 128, 2).float() / 128))
    torch.testing.assert_close(inv, base / torch.from_numpy(factors), rtol=1e-5, atol=0)
    with pytest.raises(GGUFError, match="does not follow Llama 3"):
        llama3_rope_from_factors(np.linspace(1, 3, 64), 10000.0, 128, 8192)


# ----------------------------------------------------------------------------- tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's what they're saying; we've seen it, I'm sure.",
    "Numbers: 3.14159, 2026-11-23, 1,000,000 and 42nd; 12345678901234567890 99 bottles.",
    "def square(x):\n    return x ** 2  # comment\n\n\tif x != 0:\n\t\tprint(f'{x=}')\n" * 3,
    "café crème, naïve résumé, Grüße, Ελληνικά, русский текст, 日本語のテキスト, 한국어 문장",
    "Whitespace   runs\t\t\ttabs\n\n\n\nnewlines     and trailing   ",
    "{\"json\": [1, 2, 3], \"key\": null} <html><body class=\"x\">&amp;</body></html>",
]
TEST_TEXT = (
    "Hello world!  The  quick brown fox's 123456 jumps; they'RE here... 3.14 + 2 = 5.14\n"
    "def f(x):\n    return {'a': [1, 2]}\r\n\t\ttabs   and   spaces    \n\n"
    "naïve café Grüße Ελληνικά русский 日本語 한국어 🙂🚀👍🏽 👨‍👩‍👧 🇫🇷\u00a0nbsp\u200bzw "
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>4</think><|im_end|><|endoftext|>"
    "  trailing  "
)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bpe_tokenizer_json():
    """A byte-level BPE trained here: control tokens, and <think> as a user-defined (non-special) token."""
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT * 3, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    data = json.loads(tok.to_str())
    assert len(data["model"]["merges"]) > 200  # a real merge table: multi-byte, digit and whitespace merges
    return data


def tokenizer_gguf(tmp, tokenizer_json, pre, add_bos=False, **kwargs):
    """A tiny model GGUF carrying this tokenizer (transformers wants a whole model file)."""
    vocab = max(t["id"] for t in tokenizer_json["added_tokens"]) + 1
    model_dir = make_model(tmp, "llama", vocab_size=vocab, num_hidden_layers=1)
    name = f"tok-{pre}-{add_bos}-{kwargs.get('tokenizer_model', 'gpt2')}.gguf"
    metadata = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.padding_token_id": 0}
    return write_gguf(tmp / name, model_dir, tokenizer_json=tokenizer_json, pre=pre, add_bos=add_bos,
                      chat_template=CHAT_TEMPLATE, metadata=metadata, **kwargs), name


@pytest.mark.parametrize("pre, add_bos", [("gpt2", False), ("llama-bpe", True), ("qwen2", False)])
def test_tokenizer_matches_transformers(tmp, bpe_tokenizer_json, pre, add_bos):
    path, name = tokenizer_gguf(tmp, bpe_tokenizer_json, pre, add_bos)
    folder = write_model_folder(path, tmp / f"tok-{pre}")
    ours = Tokenizer(str(folder))
    reference = AutoTokenizer.from_pretrained(str(tmp), gguf_file=name)
    for text in [TEST_TEXT, *TRAIN_TEXT, " ", "", "1", "<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == \
            ("<|im_start|>" if add_bos else "") + text
    assert (ours.encode(TEST_TEXT)[0] == 1) is add_bos  # BOS from add_bos_token, also for plain tokenizers
    assert (HFTokenizer.from_file(str(folder / "tokenizer.json")).encode("hi").ids[0] == 1) is add_bos
    assert ours.encode("<|im_start|>user")[int(add_bos)] == 1  # a control token in the text stays whole
    assert ours.encode("a<think>b") == reference.encode("a<think>b")  # a user-defined token stays whole too
    assert ours.hf.token_to_id("<think>") in ours.encode("a<think>b")
    assert ours.decode(ours.encode("x<|im_end|>y")) == "xy"  # control tokens are special: skipped in output

    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)
    assert ours.eos_token_ids == {2, 0} and ours.eos_token == "<|im_end|>"  # llama.cpp also stops on <|endoftext|>


def test_smollm_pretokenizer_splits_digits(tmp, bpe_tokenizer_json):
    """llama.cpp's "smollm" splits every digit on its own before the GPT-2 regex (as SmolLM's own
    tokenizer.json does); transformers' GGUF tokenizer does not, so it agrees only on text without digits."""
    path, name = tokenizer_gguf(tmp, bpe_tokenizer_json, "smollm")
    ours = Tokenizer(str(write_model_folder(path, tmp / "tok-smollm")))
    reference = AutoTokenizer.from_pretrained(str(tmp), gguf_file=name)
    no_digits = "".join(c for c in TEST_TEXT if not c.isdigit())
    assert ours.encode(no_digits) == reference.encode(no_digits)
    pieces = [ours.hf.id_to_token(i) for i in ours.encode("year 2026 and 12345678901234567890")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("202612345678901234567890")
    # the vocabulary has multi-digit tokens, so the split matters: there transformers and llama.cpp part ways
    assert any(len(t.strip("Ġ")) > 1 and t.strip("Ġ").isdigit() for t in bpe_tokenizer_json["model"]["vocab"])
    assert ours.encode("12345678901234567890") != reference.encode("12345678901234567890")


def test_default_pretokenizer_is_llama_cpps(tmp, bpe_tokenizer_json):
    """A file without tokenizer.ggml.pre gets llama.cpp's "default": punctuation runs and digit triples split off."""
    path, _ = tokenizer_gguf(tmp, bpe_tokenizer_json, None)
    ours = Tokenizer(str(write_model_folder(path, tmp / "tok-default")))
    pieces = [p for p, _ in ours.hf.pre_tokenizer.pre_tokenize_str("x 1234567!? don't")]
    assert pieces == ["x", "Ġ", "123", "456", "7", "!?", "Ġdon", "'", "t"]


def test_sentencepiece_tokenizer_matches_transformers(tmp):
    """tokenizer.ggml.model="llama" (Llama 2 / Mistral): scored pieces and <0xXX> byte tokens."""
    tok = HFTokenizer(BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(TRAIN_TEXT * 3, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(p for p, _ in pieces)]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # merge order, as SentencePiece BPE scores
    model_dir = make_model(tmp, "llama", vocab_size=len(tokens), num_hidden_layers=1)
    name = "spm.gguf"
    write_gguf(tmp / name, model_dir, sentencepiece=(tokens, types, scores), add_bos=None,
               metadata={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                         "tokenizer.ggml.unknown_token_id": 0})
    ours = Tokenizer(str(write_model_folder(tmp / name, tmp / "spm")))
    reference = AutoTokenizer.from_pretrained(str(tmp), gguf_file=name)
    for text in [TEST_TEXT.replace("<|im_start|>", "<s>"), *TRAIN_TEXT, "Hello", " leading", "日本語 🙂"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # add_bos_token defaults to true for SentencePiece vocabularies, as in llama.cpp
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert any(tokens[i].startswith("<0x") for i in ours.encode("🙂"))  # bytes the vocabulary lacks fall back


# ----------------------------------------------------------------------------- the folder and errors


def test_model_folder_is_written_once_and_atomically(llama, tmp):
    path = write_gguf(tmp / "once.gguf", llama)
    folder = write_model_folder(path, tmp / "once", name="my-model")
    assert os.path.realpath(folder / "weights.gguf") == str(path.resolve())
    assert json.loads((folder / "config.json").read_text())["_name_or_path"] == "my-model"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1]
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert write_model_folder(path, tmp / "once") == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # complete already: not rewritten
    assert not [p for p in tmp.iterdir() if p.name.startswith(".once")]  # no temporary folder left

    # where symlinks cannot be made, a gguf.json pointer stands for the link
    pointer = tmp / "once-pointer"
    shutil.copytree(folder, pointer, symlinks=True)
    (pointer / "weights.gguf").unlink()
    (pointer / "gguf.json").write_text(json.dumps({"path": str(path)}))
    assert set(load_checkpoint(pointer)[1]) == set(load_checkpoint(folder)[1])
    (pointer / "gguf.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="gguf.json should be"):
        load_checkpoint(pointer)

    write_gguf(path, make_model(tmp, "tied"))  # the file changed: the folder is made again
    assert json.loads((write_model_folder(path, tmp / "once") / "config.json").read_text())["tie_word_embeddings"]
    (tmp / "not-ours").mkdir()
    with pytest.raises(GGUFError, match="exists and is not a model folder made from a GGUF"):
        write_model_folder(path, tmp / "not-ours")


def test_model_folder_written_by_several_at_once(llama, tmp):
    """Gateway and worker may both make the folder at start-up: every caller gets the one complete folder."""
    from concurrent.futures import ThreadPoolExecutor

    path = write_gguf(tmp / "race.gguf", llama)
    with ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: write_model_folder(path, tmp / "race"), range(4)))
    assert set(folders) == {tmp / "race"}
    assert Tokenizer(str(tmp / "race")).vocab_size == 320 and read_config(tmp / "race").num_layers == 2
    assert not [p for p in tmp.iterdir() if p.name.startswith(".race")]


def test_clear_errors(llama, tmp):
    (tmp / "text.gguf").write_text("hello, not a GGUF")
    with pytest.raises(GGUFError, match=r"is not a GGUF file \(it starts with b'hell'"):
        write_model_folder(tmp / "text.gguf", tmp / "e1")
    with pytest.raises(GGUFError, match="does not exist"):
        write_model_folder(tmp / "missing.gguf", tmp / "e2")
    whole = write_gguf(tmp / "whole.gguf", llama).read_bytes()
    (tmp / "truncated.gguf").write_bytes(whole[:len(whole) // 3])
    with pytest.raises(GGUFError, match="truncated.gguf could not be read as GGUF"):
        write_model_folder(tmp / "truncated.gguf", tmp / "e2b")

    falcon = write_gguf(tmp / "falcon.gguf", llama, arch="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported; supported GGUF architectures: "
                                        "llama, qwen2"):
        write_model_folder(falcon, tmp / "e3")

    write_gguf(tmp / "f64.gguf", llama, types=lambda name: "F64" if name == "blk.0.ffn_up.weight" else "F32")
    with pytest.raises(GGUFError, match="'blk.0.ffn_up.weight' has type F64; supported tensor types: F32, F16, BF16, "
                                        "Q8_0, Q4_0, Q4_1"):
        write_model_folder(tmp / "f64.gguf", tmp / "e4")
    with pytest.raises(GGUFError, match="has type F64"):
        load_gguf_weights(tmp / "f64.gguf", torch.float32)

    # a folder whose GGUF went bad after it was made: the worker's loader says so, no traceback
    folder = write_model_folder(write_gguf(tmp / "later-bad.gguf", llama), tmp / "later-bad")
    shutil.copy(tmp / "text.gguf", tmp / "later-bad.gguf")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        ModelRunner(folder, num_blocks=4)
    (tmp / "later-bad.gguf").unlink()
    with pytest.raises(ModelLoadError, match="later-bad.gguf does not exist"):
        ModelRunner(folder, num_blocks=4)


def test_unsupported_tokenizers(tmp, bpe_tokenizer_json):
    path, _ = tokenizer_gguf(tmp, bpe_tokenizer_json, "tekken-like")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre='tekken-like' is not supported; supported: .*llama-bpe"):
        write_model_folder(path, tmp / "e5")
    path, _ = tokenizer_gguf(tmp, bpe_tokenizer_json, "gpt2", tokenizer_model="bert")
    with pytest.raises(GGUFError, match="tokenizer.ggml.model='bert' is not supported; supported: gpt2, llama"):
        write_model_folder(path, tmp / "e6")
