"""A folder servers without a GGUF reader (vLLM) load, for the side-by-side experiments."""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog

from phaseserve.stack.benchmark.models import default_cache_dir

log = structlog.get_logger("bench.safetensors_folder")


def safetensors_folder(model_dir: Path, cache_dir: str | Path | None = None) -> Path:
    """A folder servers without a GGUF reader (vLLM) load: the model itself, or for a folder phaseserve
    reads through a GGUF, that GGUF dequantized by transformers into bf16 safetensors (built once)."""
    gguf = model_dir / "weights.gguf"
    if not gguf.exists():
        return model_dir
    gguf = gguf.resolve()
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{gguf.stem}-bf16"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    import torch
    from safetensors.torch import save_file

    from phaseserve.workers.gguf_weights import load_gguf_weights

    log.info("dequantizing the GGUF into a safetensors folder for vLLM", gguf=str(gguf), path=str(path))
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # phaseserve's own GGUF reader: its tensors equal transformers' dequantized ones (tests/test_gguf.py)
    weights = load_gguf_weights(gguf, torch.bfloat16)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
    # config, tokenizer and chat template as phaseserve serves them (built from the GGUF's metadata)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / f, tmp / f)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path

