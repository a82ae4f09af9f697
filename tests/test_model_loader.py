"""Loader: clear errors for what it cannot run; config quirks read correctly."""

import json
import shutil

import pytest
import torch

from phaseserve.kernels import cpu_isa
from model_factory import make_model
from phaseserve.workers.loader import ModelLoadError, load_checkpoint, read_config, resolve_dtype
from phaseserve.workers.runner import ModelRunner


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("load"), "llama")


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(llama, tmp_path):
    d = copy(llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelRunner(d)


def test_missing_files(llama, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_config(tmp_path / "nowhere")
    d = copy(llama, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(d)


def test_missing_shard_and_missing_tensor(tmp_path):
    sharded = make_model(tmp_path, "sharded")
    d = copy(sharded, tmp_path / "m")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="shards listed .* are missing"):
        load_checkpoint(d)
    from safetensors.torch import load_file, save_file
    d2 = copy(make_model(tmp_path, "llama"), tmp_path / "m2")
    w = load_file(d2 / "model.safetensors")
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, d2 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing weight model.layers.1.mlp.down_proj.weight"):
        ModelRunner(d2, num_blocks=4)


def test_unsupported_rope_type(llama, tmp_path):
    d = copy(llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        read_config(d)


def test_config_quirks(tmp_path):
    c = read_config(make_model(tmp_path, "llama_gqa_llama3"))
    assert (c.num_kv_heads, c.rope_theta, c.rope_scaling["rope_type"]) == (2, 500000.0, "llama3")
    c = read_config(make_model(tmp_path, "llama_linear_head_dim"))
    assert c.head_dim == 32 and c.rope_scaling["factor"] == 2.0
    assert read_config(make_model(tmp_path, "qwen2")).qkv_bias
    assert read_config(make_model(tmp_path, "tied")).tie_word_embeddings
    assert read_config(make_model(tmp_path, "llama")).eos_token_ids == frozenset({1, 2})


def test_old_style_rope_keys(llama, tmp_path):
    """transformers 4.x wrote rope_theta at top level and rope_scaling with 'type'."""
    d = copy(llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 1234.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    c = read_config(d)
    assert c.rope_theta == 1234.0 and c.rope_scaling == {"type": "linear", "factor": 4.0, "rope_type": "linear"}


def test_dtypes(tmp_path):
    bf = make_model(tmp_path, "llama", dtype="bfloat16")
    _, w, dt = load_checkpoint(bf)  # auto: bf16 where the CPU computes it natively, else float32
    native_bf16 = cpu_isa.supports("avx512-bf16")
    assert dt == (torch.bfloat16 if native_bf16 else torch.float32) and w["model.norm.weight"].dtype == dt
    _, _, dt = load_checkpoint(bf, "bfloat16")  # asked for: served, emulated or not
    assert dt == torch.bfloat16
    _, _, dt = load_checkpoint(bf, "float32")
    assert dt == torch.float32
    _, _, dt = load_checkpoint(bf, "float16")  # fp16 is a slow software path on CPU
    assert dt == torch.bfloat16
    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        load_checkpoint(bf, "int8")


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32"])
def test_auto_dtype_follows_what_the_hardware_computes_natively(llama, monkeypatch, checkpoint):
    cfg = read_config(llama)
    cfg.checkpoint_dtype = checkpoint
    native = torch.bfloat16 if checkpoint == "float16" else getattr(torch, checkpoint)
    monkeypatch.setattr(cpu_isa, "detected", lambda: "avx512-bf16")
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    assert resolve_dtype("auto", cfg, "cpu") == native  # the checkpoint's dtype (fp16 -> bf16 on CPU)
    for level in ("avx2", "baseline"):  # bf16 emulated: float32 activations, whatever the checkpoint holds
        monkeypatch.setenv(cpu_isa.ENV_CAP, level)
        assert resolve_dtype("auto", cfg, "cpu") == torch.float32
        assert resolve_dtype("bfloat16", cfg, "cpu") == torch.bfloat16  # an explicit dtype is kept
        assert resolve_dtype("auto", cfg, "cuda") == getattr(torch, checkpoint)  # CUDA: the checkpoint's, as is
