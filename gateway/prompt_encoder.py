"""Prompt text -> token ids off the gateway's event loop, after a length check by characters.

Tokenizing a large prompt takes long (a megabyte: seconds); on the event loop it froze every other
stream for that time. So: a prompt with more characters than the context's tokens could ever span is
refused at once, without tokenizing it, and every other prompt is tokenized (and its chat template
rendered) on a small thread pool; `tokenizers` releases the GIL while it encodes.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from phaseserve.gateway.errors import context_length_exceeded
from phaseserve.models.tokenizer import Tokenizer, message_text

# A normalizer may merge characters (NFKC composes a Hangul syllable from 3 jamo), so a token may then stand
# for more characters than its own text has.
NORMALIZER_SLACK = 4
TOKENIZE_THREADS = 2


def chars_per_token_bound(tokenizer: Tokenizer) -> int:
    """At most how many characters of input one token can stand for: its vocabulary's longest piece (a
    byte-level or byte-fallback piece has at least as many characters as the text it decodes to)."""
    longest = max((len(piece) for piece in tokenizer.hf.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * (NORMALIZER_SLACK if tokenizer.hf.normalizer is not None else 1)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, threads: int = TOKENIZE_THREADS):
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token_bound(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        # start every thread now: a thread started on demand makes the event loop wait for it to run
        everyone = threading.Barrier(threads)
        wait([self._pool.submit(everyone.wait, 10.0) for _ in range(threads)])

    def max_chars(self, max_model_len: int) -> int | None:
        """The most characters a prompt that leaves room for one output token can have (None: no limit known)."""
        return (max_model_len - 1) * self.chars_per_token if max_model_len > 0 else None

    def check_chars(self, chars: int, max_model_len: int, what: str) -> None:
        limit = self.max_chars(max_model_len)
        if limit is not None and chars > limit:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, your {what} has "
                f"{chars} characters, more than {max_model_len} tokens of this model can hold (at most "
                f"{self.chars_per_token} characters a token). Please reduce the length of the {what}.", what)

    async def _run(self, fn, *args: Any, **kwargs: Any):
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, max_model_len: int, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(len(text), max_model_len, "prompt")
        return await self._run(self.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict,
                          max_model_len: int, add_special_tokens: bool = False) -> list[int]:
        # the rendered prompt has at least the messages' characters
        self.check_chars(sum(len(message_text(m.get("content"))) for m in messages), max_model_len, "messages")
        if add_special_tokens:  # /tokenize may ask for them on top of what the template writes
            tok = self.tokenizer
            return await self._run(lambda: tok.encode(tok.apply_chat_template(
                messages, add_generation_prompt, **template_kwargs), add_special_tokens=True))
        return await self._run(self.tokenizer.encode_chat, messages, add_generation_prompt, **template_kwargs)

    async def decode(self, ids: list[int]) -> str:
        """Token ids -> text with the special tokens kept (/detokenize)."""
        return await self._run(self.tokenizer.decode, ids, skip_special_tokens=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
