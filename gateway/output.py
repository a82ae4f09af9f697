"""One sequence's output as the client sees it: token events in, text deltas out.

Runs the incremental detokenizer and the stop-string matcher token by token, so
a stop string ends the sequence at the exact token that completed it (usage and
logprobs count up to that token). Also formats logprobs in the OpenAI shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.gateway.stop_strings import StopStringMatcher
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import TokenEvent


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int  # where the token's text starts in the choice's text (echoed prompt included)


@dataclass
class Delta:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None  # TokenEvent.error_kind of an error
    num_tokens: int = 0  # tokens this delta consumed


class SequenceOutput:
    def __init__(self, index: int, seq_id: str, tokenizer: Tokenizer, prompt_ids: list[int],
                 stops: list[str], min_tokens: int = 0, text_offset_base: int = 0):
        self.index = index
        self.seq_id = seq_id
        self.detok = tokenizer.detokenizer(prompt_ids)
        self.matcher = StopStringMatcher(stops)
        self.min_tokens = min_tokens
        self.text_offset_base = text_offset_base
        self.text = ""  # emitted so far
        self.num_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_kind: str | None = None
        self.stopped_by_string = False  # the gateway ended it: the worker must be told (CancelRequest)
        self.cached_tokens = 0  # prompt positions the prefix cache held, told with the first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_event(self, ev: TokenEvent) -> Delta:
        if self.finished:
            return Delta()
        delta = Delta()
        if ev.offset == 0 and ev.cached_tokens:
            self.cached_tokens = ev.cached_tokens
        pieces: list[str] = []
        for j, token_id in enumerate(ev.token_ids):
            self.num_tokens += 1
            delta.num_tokens += 1
            if ev.logprobs is not None and j < len(ev.logprobs):
                chosen, top = ev.logprobs[j][0], ev.logprobs[j][1] or []
                delta.logprobs.append(TokenLogprob(token_id, float(chosen), [(int(t), float(lp)) for t, lp in top],
                                                   self.text_offset_base + len(self.detok.text)))
            safe, stopped = self.matcher.feed(self.detok.add(token_id), check=self.num_tokens >= self.min_tokens)
            pieces.append(safe)
            if stopped:
                self.stopped_by_string = True
                delta.finish_reason = "stop"
                break
        if delta.finish_reason is None and (ev.finish_reason or ev.error):
            safe, stopped = self.matcher.feed(self.detok.flush())
            pieces.append(safe)
            if not stopped:
                pieces.append(self.matcher.flush())
            delta.finish_reason = "stop" if stopped else ("error" if ev.error else ev.finish_reason)
            delta.error = ev.error
            delta.error_kind = ev.error_kind if ev.error else None
        delta.text = "".join(pieces)
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.error = delta.error
        self.error_kind = delta.error_kind
        return delta


# ------------------------------------------------------------------ logprobs in the OpenAI shapes


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """/v1/completions: parallel lists; top_logprobs maps token text -> logprob (chosen token included)."""
    tops = []
    for e in entries:
        top = {tokenizer.token_text(t): lp for t, lp in e.top}
        top.setdefault(tokenizer.token_text(e.token_id), e.logprob)
        tops.append(top)
    return {
        "tokens": [tokenizer.token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """/v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.token_text(token_id), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
