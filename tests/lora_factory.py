"""Tiny LoRA adapters trained with `peft` on a test model, saved in PEFT's format (adapter_config.json +
adapter_model.safetensors), and the merged model as the reference (merge_and_unload, transformers float32).

`make_adapter(model_dir, out_dir, seed, target_modules, r, lora_alpha, use_rslora) -> Path` trains a few steps
of next-token prediction on a random token sequence drawn from `seed` (so each adapter pulls the model toward
its own text and greedy outputs differ from the base model's). Identical requests in one session return the
folder already built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_built: dict[tuple, Path] = {}


def make_adapter(model_dir: Path, out_dir: Path, seed: int, target_modules=ALL_MODULES, r: int = 8,
                 lora_alpha: float = 16, use_rslora: bool = False, steps: int = 30) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), seed, tuple(target_modules), r, lora_alpha, use_rslora, steps)
    if key in _built and (_built[key] / "adapter_config.json").is_file():
        return _built[key]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                                                  lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM"))
    text = torch.randint(3, vocab, (1, 48))
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=text, labels=text).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = Path(out_dir) / f"adapter-{seed}-{r}-{'-'.join(target_modules)}-{int(use_rslora)}"
    peft_model.save_pretrained(path)
    assert json.loads((path / "adapter_config.json").read_text())["r"] == r
    _built[key] = path
    return path


def merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt from transformers in float32: the base model, or with `adapter` merged into
    it by peft (merge_and_unload)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out
