"""The text side of a Hugging Face model folder: tokenizer, chat template, EOS ids, streaming decode.

Loads `tokenizer.json` with `tokenizers` (no transformers at run time), the chat
template from `chat_template.jinja` or `tokenizer_config.json` (rendered in
jinja2's sandbox the way transformers does), and the EOS ids from
generation_config.json / config.json / tokenizer_config.json.

`IncrementalDetokenizer` turns a stream of token ids into text deltas that are
always valid UTF-8: vLLM's prefix/read-offset method, holding text back while
the decoded tail ends in U+FFFD (a multi-byte character split across tokens).
At the end, a character still incomplete (cut by max_tokens) is dropped, not
shown as U+FFFD.
"""

from __future__ import annotations

import codecs
import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from phaseserve.models.model_files import config_eos_token_ids, read_json, token_ids

REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt the detokenizer decodes as context (vLLM uses the same 5): enough for
# decoders that strip or merge across token boundaries (SentencePiece's leading space).
_PROMPT_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """No chat template, or the template rejected the conversation (-> HTTP 400)."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson, which HTML-escapes; templates rely on the plain one
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile in the immutable sandbox: chat templates come from model repos and are untrusted code."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable character byte-level BPE vocabularies spell each byte with."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse: the byte a byte-level BPE token's character stands for."""
    return {c: b for b, c in gpt2_bytes_to_unicode().items()}


def message_text(content: Any) -> str:
    """OpenAI message content -> the string a chat template sees.

    A string passes through; a list of {"type": "text", "text": ...} parts is joined with
    newlines (vLLM's "string" content format); None (an assistant turn with no text) is "".
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError("only content parts of type 'text' are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


class Tokenizer:
    """Everything the gateway (and the worker's stop rule) needs from a model folder's text files."""

    def __init__(self, path: str):
        self.path = path
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.hf = HFTokenizer.from_file(tok_file)
        cfg = read_json(os.path.join(path, "tokenizer_config.json"))
        model_cfg = read_json(os.path.join(path, "config.json"))

        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_content(cfg.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        if self.bos_token_id is None:
            ids = token_ids(model_cfg.get("bos_token_id"))
            self.bos_token_id = ids[0] if ids else None
        add_bos = cfg.get("add_bos_token")
        self.add_bos_token: bool | None = add_bos if isinstance(add_bos, bool) else None

        eos = set(config_eos_token_ids(path))
        if self.eos_token is not None and self.hf.token_to_id(self.eos_token) is not None:
            eos.add(self.hf.token_to_id(self.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        self.chat_templates = self._load_chat_templates(path, cfg)
        self.vocab_size = max(self.hf.get_vocab_size(with_added_tokens=True),
                              int(model_cfg.get("vocab_size") or 0))
        state = self.hf.decoder.__getstate__() if self.hf.decoder is not None else b""
        self._byte_level = "ByteLevel" in (state.decode() if isinstance(state, bytes) else str(state))
        self._byte_decoder = _gpt2_byte_decoder() if self._byte_level else {}
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)

    @staticmethod
    def _load_chat_templates(path: str, cfg: dict) -> dict[str, str]:
        """name -> template source; "default" is the one used unless a request names another."""
        templates: dict[str, str] = {}
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            for item in raw:
                if isinstance(item, dict) and isinstance(item.get("name"), str) \
                        and isinstance(item.get("template"), str):
                    templates[item["name"]] = item["template"]
        # transformers >= 4.43 saves the template beside the config; it wins over the config's copy
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                templates["default"] = f.read()
        return templates

    @classmethod
    def from_folder(cls, path: str) -> "Tokenizer":
        return cls(path)

    # ----------------------------------------------------------------- encode / decode

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only it releases the GIL while it works, so a long prompt tokenized on
        # another thread does not stop the gateway's event loop
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode(text, add_special_tokens)
        if add_special_tokens and self.bos_token_id is not None:
            # tokenizer_config's add_bos_token overrides what tokenizer.json's post-processor does
            if self.add_bos_token is True and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id] + ids
            elif self.add_bos_token is False and ids and ids[0] == self.bos_token_id:
                plain = self._encode(text, add_special_tokens=False)
                if not plain or plain[0] != self.bos_token_id:
                    ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """The text of one token on its own (what logprobs report as `token`)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (a byte-level piece may be half a UTF-8 character)."""
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self._token_text(token_id).encode("utf-8")

    # ----------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_name: str | None = None, **kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' apply_chat_template(tokenize=False)."""
        name = template_name or "default"
        source = self.chat_templates.get(name)
        if source is None and template_name is None and self.chat_templates:
            source = next(iter(self.chat_templates.values()))
        if source is None:
            raise ChatTemplateError(
                f"model has no chat template{'' if template_name is None else f' named {template_name!r}'}; "
                "use /v1/completions with a plain prompt")
        conversation = []
        for m in messages:
            msg = {k: v for k, v in m.items() if v is not None}
            msg["content"] = message_text(m.get("content"))
            conversation.append(msg)
        context = {**self.special_tokens, **kwargs, "messages": conversation,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return compile_chat_template(source).render(**context)
        except jinja2.exceptions.TemplateError as e:  # includes raise_exception() and sandbox violations
            raise ChatTemplateError(f"chat template error: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        # The template writes the special tokens itself (as transformers does: add_special_tokens=False)
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    def detokenizer(self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
                    ) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one sequence; never emits a broken UTF-8 character.

    vLLM's method: `prefix_offset..read_offset` are tokens already turned into text,
    decoded again only as context; the delta is decode(prefix..end) minus
    decode(prefix..read). While the result ends in U+FFFD the tail is an incomplete
    character, so nothing is emitted until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-(_PROMPT_CONTEXT_TOKENS + 1):])
        self.prefix_offset = max(len(self.ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached until the offsets move
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (often "", never a partial character)."""
        self.ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = None
        if self.prefix_offset > 256:  # keep the id list short on long generations
            self.ids = self.ids[self.prefix_offset:]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: release what was held back (as a full decode would show it)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        held = self.ids[self.read_offset:]
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = None
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        cut = _incomplete_tail_bytes(b"".join(self.tokenizer.token_bytes(t) for t in held))
        while cut and delta.endswith(REPLACEMENT_CHAR):  # one U+FFFD (byte-level) or one a byte (byte fallback)
            delta = delta[:-1]
            cut -= 1
        self.text += delta
        return delta


def _incomplete_tail_bytes(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that the bytes after would complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return len(decoder.getstate()[0])
