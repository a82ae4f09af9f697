"""POST /tokenize and /detokenize in vLLM's shapes: the served model's tokenizer (and chat template) for
clients that count or build prompts themselves.

/tokenize takes `prompt` (text; `add_special_tokens` defaults to true) or `messages` (rendered with the
chat template; `add_generation_prompt` true and `add_special_tokens` false by default) and answers
{"count", "max_model_len", "tokens", "token_strs"}. /detokenize takes `tokens` and answers {"prompt"}.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, model_validator

from phaseserve.gateway.errors import bad_request, read_body
from phaseserve.gateway.limits import MAX_DETOKENIZE_TOKENS
from phaseserve.gateway.protocol import RESERVED_TEMPLATE_KWARGS, ChatMessage, TokenId, StrictModel, parse_body
from phaseserve.gateway.state import GATEWAY, Gateway
from phaseserve.models.tokenizer import ChatTemplateError


class TokenizeRequest(StrictModel):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true with `prompt`, false with "
                                            "`messages` (the chat template writes its own)")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("'prompt' or 'messages' is required (exactly one of them)")
        clash = [k for k in self.chat_template_kwargs or {} if k in RESERVED_TEMPLATE_KWARGS]
        if clash:
            raise ValueError(f"'chat_template_kwargs' may not set {', '.join(map(repr, clash))}")
        return self


class DetokenizeRequest(StrictModel):
    """POST /detokenize"""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


async def _check_model(gw: Gateway, model: str | None) -> None:
    """404 unless `model` is unset, the base model or one of its LoRA adapters (they share its tokenizer)."""
    await gw.loras.resolve(model)


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_body(TokenizeRequest, await read_body(request))
    await _check_model(gw, req.model)
    max_len = gw.max_model_len(await gw.backend.workers.alive())
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await gw.prompts.encode(req.prompt, max_len, add_special_tokens=add_special)
    else:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = await gw.prompts.encode_chat(messages, req.add_generation_prompt, req.chat_template_kwargs or {},
                                               max_len, add_special_tokens=bool(req.add_special_tokens))
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
    token_strs = [gw.tokenizer.hf.id_to_token(t) for t in ids] if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": max_len, "tokens": ids,
                              "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_body(DetokenizeRequest, await read_body(request))
    await _check_model(gw, req.model)
    outside = [t for t in req.tokens if t >= gw.tokenizer.vocab_size]
    if outside:
        raise bad_request(f"'tokens' has token ids outside the vocabulary (size {gw.tokenizer.vocab_size}): "
                          f"{outside[:5]}", "tokens")
    # special tokens kept, as vLLM answers: detokenize(tokenize(text)) gives the text the model saw
    text = await gw.prompts.decode(req.tokens)
    return web.json_response({"prompt": text}, dumps=lambda o: json.dumps(o, ensure_ascii=False))
