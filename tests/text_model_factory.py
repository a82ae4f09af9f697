"""A text-only Hugging Face model folder for gateway tests: byte-level BPE tokenizer.json
(trained here on a few sentences), tokenizer_config.json with a chat template, config.json,
generation_config.json. No weights: the gateway never loads any.

Few merges on purpose: characters outside the training text (emoji, CJK) stay split into
single-byte tokens, which is what the incremental detokenizer must handle.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRAIN_TEXT = [
    "Hello world, this is a tiny tokenizer for the gateway tests.",
    "The quick brown fox jumps over the lazy dog. Stop here, or go on.",
    "Café crème and naïve résumé are French words.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def make_text_model(path: Path, max_position_embeddings: int = 256, **tokenizer_config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS, "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE, **tokenizer_config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": tok.get_vocab_size(), "max_position_embeddings": max_position_embeddings,
        "bos_token_id": bos_id, "eos_token_id": eos_id}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    return path
