"""A GGUF file (llama.cpp's format) as a Hugging Face model folder, weights left in the GGUF.

`write_model_folder(gguf_path, folder)` reads the GGUF's metadata once and writes
config.json, tokenizer.json, tokenizer_config.json and generation_config.json,
plus a `weights.gguf` symlink to the GGUF itself, so that the gateway's
`Tokenizer` and the worker's loader read the folder like any other checkpoint
(the worker loads the tensors through workers/gguf_weights.py).

The metadata is read by gguf_metadata.py, the tokenizer rebuilt by gguf_tokenizer.py.
No torch here: the gateway imports this module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import structlog

from phaseserve.models.gguf_metadata import GGUFError, GGUFMetadata, check_tensors
from phaseserve.models.gguf_tokenizer import build_tokenizer_files, stop_token_ids

log = structlog.get_logger(__name__)

# GGUF `general.architecture` -> transformers architecture the worker runs
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
WEIGHTS_LINK = "weights.gguf"
WEIGHTS_POINTER = "gguf.json"  # {"path": ...}, written where a symlink cannot be
SOURCE_FILE = "gguf_source.json"  # which GGUF (path, size, mtime) the folder was made from
_FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", SOURCE_FILE)


# ----------------------------------------------------------------------------- config.json


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                              original_len: int) -> dict | None:
    """llama.cpp stores Llama 3 rope scaling as a per-frequency divisor tensor (rope_freqs), not as
    parameters. Recover transformers' llama3 parameters from it: the divisors are 1 for short
    wavelengths, `factor` for long ones, and 1/((1-s)/factor + s) between, with s linear in
    1/wavelength; only that line matters, so original_len is free and the rest is fitted."""
    factors = np.asarray(factors, dtype=np.float64)
    if np.allclose(factors, 1.0):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(factors) != len(inv_freq):
        raise GGUFError(f"rope_freqs has {len(factors)} entries; expected head_dim/2 = {len(inv_freq)}")
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    tol = 1e-4 * factor
    medium = (factors > 1 + tol) & (factors < factor - tol)
    if medium.sum() >= 2:
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[medium], s, 1)  # s = a / wavelen + b
        low = -b * original_len / a
        high = low + original_len / a
    else:  # no ramp in between: put its ends just outside the two plateaus
        high_wavelen = wavelen[factors <= 1 + tol].max() * 1.0001
        low_wavelen = wavelen[factors >= factor - tol].min() * 0.9999
        low, high = original_len / low_wavelen, original_len / high_wavelen
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
              "high_freq_factor": float(high), "original_max_position_embeddings": original_len}
    # the fitted parameters must give back the file's divisors (as workers/model.py computes them)
    low_wl, high_wl = original_len / low, original_len / high
    smooth = (original_len / wavelen - low) / (high - low)
    divisor = np.where(wavelen < high_wl, 1.0,
                       np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(divisor, factors, rtol=1e-3):
        raise GGUFError("rope_freqs does not follow Llama 3 rope scaling (the only per-frequency scaling supported)")
    return params


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def build_config(meta: GGUFMetadata, name: str) -> dict:
    arch = meta.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{meta.path}: architecture {arch!r} is not supported; supported GGUF architectures: "
                        f"{', '.join(ARCHITECTURES)}")
    if "token_embd.weight" not in meta.tensors:
        raise GGUFError(f"{meta.path} has no token_embd.weight tensor")
    vocab_size, hidden = meta.tensor_shape("token_embd.weight")
    num_heads = int(meta.require("attention.head_count"))
    num_kv_heads = meta.arch("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts (hybrid models)
        if len(set(num_kv_heads)) != 1:
            raise GGUFError(f"{meta.path}: per-layer KV head counts {sorted(set(num_kv_heads))} are not supported")
        num_kv_heads = num_kv_heads[0]
    rope_dim = meta.arch("rope.dimension_count")
    head_dim = int(meta.arch("attention.key_length") or rope_dim or hidden // num_heads)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise GGUFError(f"{meta.path}: rotary dimension {rope_dim} != head dim {head_dim} "
                        "(partial rotary embeddings are not supported)")
    theta = _f32(meta.arch("rope.freq_base", 10000.0))
    context = int(meta.arch("context_length", 2048))

    rope_scaling = None
    scaling_type = meta.arch("rope.scaling.type")
    factor = meta.arch("rope.scaling.factor") or meta.arch("rope.scale_linear")
    if scaling_type in (None, "linear") and factor and float(factor) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": _f32(factor)}
    elif scaling_type not in (None, "none", "linear"):
        raise GGUFError(f"{meta.path}: rope scaling {scaling_type!r} is not supported (supported: linear, "
                        "and Llama 3 scaling given as a rope_freqs tensor)")
    if "rope_freqs.weight" in meta.tensors:
        if rope_scaling is not None:
            raise GGUFError(f"{meta.path} has both rope_freqs and {rope_scaling['rope_type']} rope scaling")
        original = int(meta.arch("rope.scaling.original_context_length") or 8192)
        factors = np.asarray(meta.tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        rope_scaling = llama3_rope_from_factors(factors, theta, head_dim, original)

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "_name_or_path": name,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden),
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in meta.tensors,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


# ----------------------------------------------------------------------------- the folder


def source_stamp(gguf_path: Path) -> dict:
    """What identifies a GGUF's version: path, size and mtime in whole seconds. Not nanoseconds: a file
    copied into an image layer (a tar entry, whole seconds) comes out with its fraction gone, and the folder
    made from it at build time would never be recognised in a container."""
    st = gguf_path.stat()
    return {"path": str(gguf_path), "size": st.st_size, "mtime_s": int(st.st_mtime)}


def gguf_weights_path(folder: str | Path) -> Path | None:
    """The GGUF holding a folder's weights (its weights.gguf link or gguf.json pointer), or None."""
    folder = Path(folder)
    link = folder / WEIGHTS_LINK
    if link.is_symlink() or link.is_file():  # a dangling link is reported by the reader, naming the file
        return link.resolve()
    pointer = folder / WEIGHTS_POINTER
    if pointer.is_file():
        try:
            return Path(json.loads(pointer.read_text())["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise GGUFError(f"{pointer} should be {{\"path\": <GGUF file>}}: {e!r}") from e
    return None


def _is_complete(folder: Path, stamp: dict) -> bool:
    if not all((folder / f).is_file() for f in _FOLDER_FILES) or gguf_weights_path(folder) is None:
        return False
    try:
        return json.loads((folder / SOURCE_FILE).read_text()) == stamp
    except (ValueError, OSError):
        return False


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_folder(gguf_path: str | Path, folder: str | Path, name: str | None = None) -> Path:
    """Turn a GGUF into a model folder (config, tokenizer, generation config, link to the weights).

    Built in a temporary folder beside `folder` and renamed into place, so a reader never sees
    half a folder. A complete folder already made from this same file (path, size, mtime) is
    returned as it is; one made from an older version of the file is replaced.
    """
    gguf_path = Path(gguf_path).resolve()
    folder = Path(folder).absolute()
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {gguf_path} does not exist")
    stamp = source_stamp(gguf_path)
    if _is_complete(folder, stamp):
        return folder
    if folder.exists() and not (folder / SOURCE_FILE).is_file():
        raise GGUFError(f"{folder} exists and is not a model folder made from a GGUF; choose another folder")

    meta = GGUFMetadata(gguf_path)
    name = name or gguf_path.stem
    config = build_config(meta, name)
    check_tensors(meta)
    tokenizer_json, tokenizer_config = build_tokenizer_files(meta)
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": stop_token_ids(meta)}

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary one
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer.json", tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "generation_config.json", generation_config)
        try:
            os.symlink(gguf_path, tmp / WEIGHTS_LINK)
        except OSError:  # no symlinks on this filesystem
            _write_json(tmp / WEIGHTS_POINTER, {"path": str(gguf_path)})
        _write_json(tmp / SOURCE_FILE, stamp)  # last: its presence marks the folder complete
        if _is_complete(folder, stamp):  # another process finished the same folder meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        if folder.exists():  # made from an older version of the file: move it aside, then drop it
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=folder.parent))
            os.replace(folder, stale / folder.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if _is_complete(folder, stamp):  # another process finished the same folder first
                shutil.rmtree(tmp, ignore_errors=True)
                return folder
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("gguf model folder written", gguf=str(gguf_path), folder=str(folder), arch=meta.architecture,
             tokenizer=meta.get("tokenizer.ggml.model"), pre=meta.get("tokenizer.ggml.pre"),
             vocab=len(tokenizer_json["model"]["vocab"]))
    return folder
