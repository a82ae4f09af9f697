#!/usr/bin/env python
"""Train the small Llama model that phaseserve ships as its default.

No weights can be downloaded where phaseserve is built, so the project trains
its own: a byte-level BPE tokenizer and a ~5M-parameter LlamaForCausalLM on the
Python standard library source that ships with the interpreter running this
script (PSF licence), plus a small share of ChatML-formatted "explain this
function" samples built from the same docstrings. Runs on CPU in under an hour.

    python scripts/train_bundled_model.py --steps 1500 --max-minutes 42

The output folder is a standard Hugging Face checkpoint (config.json,
generation_config.json, model.safetensors in bfloat16, tokenizer.json,
tokenizer_config.json with a chat template, special_tokens_map.json, README.md,
eval.json) that transformers and vLLM load unchanged.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "phaseserve" / "bundled_model"

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|bos|>=1, <|im_start|>=2, <|im_end|>=3, <|pad|>=4.
SPECIAL_TOKENS = [EOS, BOS, IM_START, IM_END, PAD]

# ChatML. The bos token is part of the template because chat prompts are
# tokenized without special tokens (transformers and vLLM both do that), while
# plain completions get it from the tokenizer's post-processor.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT_QUESTIONS = ["Explain `{name}`.", "What does `{name}` do?", "Describe `{name}` in Python."]
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}


# ---------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_generated_codec_table(rel: Path, text: str) -> bool:
    # encodings/cp*.py, mac_*.py ... are 70 gencodec.py tables of hex escapes
    # (a quarter of the corpus); they would teach the model nothing but hex.
    return rel.parts[0] == "encodings" and (
        "### Decoding Table" in text or "### Encoding Map" in text or "### Decoding Map" in text
    )


def read_corpus(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) for every stdlib .py file, sorted by path."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            with tokenize.open(path) as f:  # honours PEP 263 coding cookies
                text = f.read()
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if text.strip() and not is_generated_codec_table(rel, text):
            docs.append((rel.as_posix(), text))
    return docs


def split_held_out(docs: list, every: int) -> tuple[list, list]:
    """Every `every`-th file (by sorted path) is held out and never trained on."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    held = [d for i, d in enumerate(docs) if i % every == every - 1]
    return train, held


def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def docstring_pairs(rel: str, text: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) for public functions/classes with a useful docstring."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    pairs = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if not child.name.startswith("_") and doc and 40 <= len(doc) <= 1500:
                    pairs.append((name, inspect.cleandoc(doc)))
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    visit(tree, module_name(rel))
    return pairs


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS
    )


def chat_samples(docs: list[tuple[str, str]]) -> list[str]:
    samples = []
    for rel, text in docs:
        for i, (name, doc) in enumerate(docstring_pairs(rel, text)):
            question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(name=name)
            samples.append(
                render_chat([{"role": "user", "content": question}, {"role": "assistant", "content": doc}])
            )
    return samples


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every UTF-8 string maps to tokens and back without an unknown token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    # Keep the template inside tokenizer_config.json too: servers that read
    # only that file (the phaseserve loader, older transformers, vLLM) find it there.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 writes a list under "extra_special_tokens", which 4.x
    # (still used by vLLM) expects to be a dict; the classic key works in both.
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def encode_docs(tok, texts: list[str]):
    """One flat id stream: <|bos|> doc <|endoftext|> for each text (bos comes from the post-processor)."""

    eos_id = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=True):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- model


def build_config(args, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
    )


def build_model(config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps_done: int
    seconds: float
    final_train_loss: float
    stopped_by_time: bool


def train(model, stream, args) -> TrainResult:
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    start = time.monotonic()
    deadline = start + args.max_minutes * 60
    ema = None
    step = 0
    bar = tqdm(total=args.steps, desc="train", dynamic_ncols=True, mininterval=5)
    for step in range(args.steps):
        if time.monotonic() > deadline:
            bar.write(f"time budget of {args.max_minutes} min reached at step {step}")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}", ema=f"{ema:.3f}", lr=f"{lr_at(step, args):.2e}")
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - start
            bar.write(f"step {step:5d}  loss {value:.4f}  ema {ema:.4f}  elapsed {elapsed / 60:.1f} min")
    else:
        step = args.steps
    bar.close()
    return TrainResult(step, time.monotonic() - start, ema or float("nan"), step < args.steps)


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def held_out_loss(model, stream, seq_len: int, max_tokens: int = 0, batch: int = 16) -> tuple[float, int]:
    """Mean next-token cross-entropy over non-overlapping windows of the held-out stream."""
    if max_tokens:
        stream = stream[:max_tokens]
    n_windows = (len(stream) - 1) // seq_len
    if n_windows == 0:
        raise ValueError(f"held-out stream has {len(stream)} tokens, fewer than one window of {seq_len}")
    model.eval()
    total, count = 0.0, 0
    for first in range(0, n_windows, batch):
        idx = range(first, min(first + batch, n_windows))
        x = torch.stack([stream[i * seq_len : (i + 1) * seq_len] for i in idx])
        y = torch.stack([stream[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in idx])
        logits = model(input_ids=x).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        ).item()
        count += y.numel()
    return total / count, count


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


@torch.no_grad()
def greedy_chat_reply(model, tokenizer, question: str, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    gen = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------- saving


def save_model(model, out: Path, tok) -> None:
    from transformers import GenerationConfig

    model.to(torch.bfloat16).save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # written 0600 via a temp file; it ships in the package
    # transformers 5 writes "dtype" and "rope_parameters"; older readers (vLLM,
    # transformers 4.x) look for "torch_dtype" and "rope_theta".
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg["rope_theta"] = 10000.0
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        pad_token_id=tok.token_to_id(PAD),
    ).save_pretrained(out)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def write_model_card(out: Path, report: dict) -> None:
    samples = "\n\n".join(
        f"Prompt `{json.dumps(s['prompt'])}` ->\n\n```python\n{s['prompt']}{s['completion']}\n```"
        for s in report["samples"]
    )
    arch = report["architecture"]
    card = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, python, tiny]
---

# phaseserve bundled model

A tiny Llama-architecture causal language model ({report['parameters'] / 1e6:.2f} M parameters,
{report['folder_bytes'] / 1e6:.1f} MB on disk in bfloat16) that phaseserve serves by default, so the
server runs out of the box where no weights can be downloaded. It was trained from scratch on CPU
in {report['train_seconds'] / 60:.1f} minutes. It writes Python-looking code; it is a test fixture with
realistic shapes, not a useful assistant.

## Architecture

`LlamaForCausalLM`: hidden size {arch['hidden_size']}, {arch['num_hidden_layers']} layers,
{arch['num_attention_heads']} attention heads, {arch['num_key_value_heads']} key/value heads (GQA),
MLP size {arch['intermediate_size']}, RoPE theta 10000, tied input/output embeddings,
max_position_embeddings 2048 (trained on {report['seq_len']}-token windows),
byte-level BPE vocabulary of {arch['vocab_size']} tokens.

Special tokens: `<|endoftext|>` (eos, 0), `<|bos|>` (bos, 1, added by the tokenizer's
post-processor to plain prompts), `<|im_start|>` (2), `<|im_end|>` (3), `<|pad|>` (4).
Generation stops on `<|endoftext|>` or `<|im_end|>` (generation_config.json). The chat template is
ChatML and starts with the bos token, so chat prompts are tokenized without special tokens.

## Training data

The `.py` files of the Python {report['python_version']} standard library
(`sysconfig.get_paths()["stdlib"]`), sorted by path, without `test/`, `tests/`, `idle_test/`,
`site-packages/`, `pydoc_data/` and the 70 generated codec tables in `encodings/`:
{report['corpus_files']} files. Every {report['held_out_every']}th file ({report['held_out_files']} files,
{report['held_out_tokens']} tokens) is held out and never trained on (not even by the tokenizer).
Added to the training files: {report['chat_samples']} ChatML samples built from the public docstrings
of those training files (user: "Explain `json.dumps`." -> assistant: the docstring).
Training stream: {report['train_tokens']} tokens.

Licence of the data: the Python standard library is Copyright (c) 2001-2024 Python Software
Foundation and is distributed under the PSF License Agreement (PSF-2.0); this model is derived
from it. The weights are released with phaseserve under Apache-2.0.

## Training

Plain PyTorch: AdamW (betas 0.9/0.95, weight decay 0.1), peak LR {report['lr']}, linear warmup
{report['warmup']} steps then cosine decay, batch {report['batch']} x {report['seq_len']} tokens, bf16 autocast
with fp32 master weights, gradient clipping 1.0, seed {report['seed']}, {report['threads']} CPU thread(s).
{report['steps_done']} steps ({report['steps_done'] * report['batch'] * report['seq_len'] / 1e6:.1f} M tokens seen)
in {report['train_seconds'] / 60:.1f} minutes{' (stopped by the time budget)' if report['stopped_by_time'] else ''}.

Exact command (from the repository root):

```
{report['command']}
```

## Evaluation

Mean next-token cross-entropy on the held-out files (bfloat16 weights as saved):

| model | held-out loss (nats/token) | perplexity |
| --- | --- | --- |
| this model | {report['held_out_loss']:.4f} | {math.exp(report['held_out_loss']):.2f} |
| same architecture, untrained (same init seed) | {report['untrained_held_out_loss']:.4f} | {math.exp(report['untrained_held_out_loss']):.1f} |

Greedy completions ({report['sample_new_tokens']} new tokens):

{samples}

Chat (`Explain `os.path.join`.`, greedy):

```
{report['chat_sample']}
```
"""
    (out / "README.md").write_text(card)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: phaseserve/bundled_model)")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (sets the LR schedule)")
    p.add_argument("--max-minutes", type=float, default=45.0, help="stop training after this wall time")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--held-out-every", type=int, default=50)
    p.add_argument("--eval-max-tokens", type=int, default=0, help="cap on held-out tokens (0 = all)")
    p.add_argument("--sample-new-tokens", type=int, default=48)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    if args.steps <= 0 or args.max_minutes <= 0:
        p.error("--steps and --max-minutes must be positive")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/train_bundled_model.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    docs = read_corpus(stdlib_root())
    train_docs, held_docs = split_held_out(docs, args.held_out_every)
    chats = chat_samples(train_docs)
    print(f"corpus: {len(docs)} files ({len(train_docs)} train, {len(held_docs)} held out), {len(chats)} chat samples")

    t0 = time.monotonic()
    tok = train_tokenizer([text for _, text in train_docs], args.vocab_size)
    save_tokenizer(tok, out, max_len=2048)
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.monotonic() - t0:.0f}s")

    texts = [text for _, text in train_docs] + chats
    random.Random(args.seed).shuffle(texts)
    train_stream = encode_docs(tok, texts)
    held_stream = encode_docs(tok, [text for _, text in held_docs])
    print(f"tokens: {len(train_stream)} train, {len(held_stream)} held out")

    config = build_config(args, tok)
    model = build_model(config, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    result = train(model, train_stream, args)
    save_model(model, out, tok)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    untrained = build_model(config, args.seed).to(torch.bfloat16)
    loss, n_tokens = held_out_loss(trained, held_stream, args.seq_len, args.eval_max_tokens)
    untrained_loss, _ = held_out_loss(untrained, held_stream, args.seq_len, args.eval_max_tokens)
    print(f"held-out loss: trained {loss:.4f}, untrained {untrained_loss:.4f} over {n_tokens} tokens")

    hf_tok = AutoTokenizer.from_pretrained(out)
    completions = greedy_completions(trained, hf_tok, SAMPLE_PROMPTS, args.sample_new_tokens)
    chat_reply = greedy_chat_reply(trained, hf_tok, "Explain `os.path.join`.", args.sample_new_tokens)
    for prompt, completion in zip(SAMPLE_PROMPTS, completions):
        print(f"--- {prompt!r}\n{prompt}{completion}")
    print(f"--- chat\n{chat_reply}")

    report = {
        "command": command,
        "python_version": platform.python_version(),
        "parameters": n_params,
        "architecture": {
            k: getattr(config, k)
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "intermediate_size")
        },
        "corpus_files": len(docs),
        "held_out_every": args.held_out_every,
        "held_out_files": len(held_docs),
        "held_out_paths": [rel for rel, _ in held_docs],
        "held_out_tokens": n_tokens,
        "chat_samples": len(chats),
        "train_tokens": len(train_stream),
        "seed": args.seed,
        "threads": args.threads,
        "lr": args.lr,
        "warmup": args.warmup,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "steps_done": result.steps_done,
        "stopped_by_time": result.stopped_by_time,
        "train_seconds": round(result.seconds, 1),
        "final_train_loss_ema": round(result.final_train_loss, 4),
        "held_out_loss": round(loss, 4),
        "untrained_held_out_loss": round(untrained_loss, 4),
        "sample_new_tokens": args.sample_new_tokens,
        "samples": [{"prompt": p, "completion": c} for p, c in zip(SAMPLE_PROMPTS, completions)],
        "chat_sample": chat_reply,
    }
    # The card states the folder size, so measure it with the card and eval.json in place.
    report["folder_bytes"] = 0
    for _ in range(2):
        (out / "eval.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        write_model_card(out, report)
        report["folder_bytes"] = folder_bytes(out)
    print(f"saved to {out} ({report['folder_bytes'] / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
