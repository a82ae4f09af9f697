"""POST /v1/completions and /v1/chat/completions: validate, tokenize, plan, and run a Generation
(gateway/generation.py) with the endpoint's object (gateway/endpoints.py)."""

from __future__ import annotations

from aiohttp import web

from phaseserve.gateway import protocol as P
from phaseserve.gateway.auth import CLIENT_KEY
from phaseserve.gateway.endpoints import ChatEndpoint, ChatPlan, CompletionEndpoint
from phaseserve.gateway.errors import bad_request, read_body
from phaseserve.gateway.generation import Generation, Prompt
from phaseserve.gateway.state import GATEWAY, Gateway
from phaseserve.gateway.structured import requested_grammar
from phaseserve.gateway.tools import plan_tools
from phaseserve import grammar
from phaseserve.models.tokenizer import ChatTemplateError
from phaseserve.wire import LoraRef


async def check_request(gw: Gateway, req: P.CompletionRequest | P.ChatCompletionRequest) -> LoraRef | None:
    """What the request schema alone cannot check: the model's name (the LoRA adapter it names, or None for the
    base model; 404 for neither) and vocabulary."""
    lora = await gw.loras.resolve(req.model)
    req.check_token_ids(gw.tokenizer.vocab_size)
    return lora


async def _completion_prompt(gw: Gateway, prompt: str | list[int], echo: bool, max_len: int) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(await gw.prompts.encode(prompt, max_len), prompt if echo else "")
    out_of_vocab = [t for t in prompt if t >= gw.tokenizer.vocab_size]
    if out_of_vocab:
        raise bad_request(f"'prompt' has token ids outside the vocabulary (size {gw.tokenizer.vocab_size}): "
                          f"{out_of_vocab[:5]}", "prompt")
    return Prompt(list(prompt), gw.tokenizer.decode(prompt) if echo else "")


def client_of(request: web.Request) -> bytes | str | None:
    """Who sent the request, for the fair share of the grammar checks: its API key, else its address."""
    return request.get(CLIENT_KEY) or request.remote


async def create_completion(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    req = P.parse_body(P.CompletionRequest, await read_body(request))
    lora = await check_request(gw, req)
    max_len = gw.max_model_len(await gw.backend.workers.alive())
    prompts = [await _completion_prompt(gw, p, req.echo, max_len) for p in req.prompts]
    spec, param = requested_grammar(req, gw.grammars.budgets)
    if spec is not None:
        await gw.check_grammar(spec, param, client_of(request))
    return await Generation(request, gw, req, CompletionEndpoint(req, spec, param), prompts, lora=lora).run()


async def plan_chat(gw: Gateway, req: P.ChatCompletionRequest, messages: list[dict], client=None) -> ChatPlan:
    """Tools, output constraint, reasoning and the rendered prompt of a chat request (a 400 naming the field
    for what is malformed; `client` has one grammar proof at a time). The Responses API renders its
    conversations through here too."""
    template = gw.tokenizer.chat_templates.get("default", "") or next(iter(gw.tokenizer.chat_templates.values()), "")
    tools = plan_tools(req, messages, gw.tool_parser, template)
    spec, param = requested_grammar(req, gw.grammars.budgets)
    if tools.grammar is not None:
        if spec is not None:
            raise bad_request(f"'tool_choice' forces a tool call; it cannot be combined with '{param}'", param)
        spec, param = tools.grammar, "tool_choice" if req.tool_choice is not None else "tools"
        gw.grammars.budgets.check_size(spec, param)
    kwargs = {**(req.chat_template_kwargs or {}), **tools.template_kwargs}
    if req.reasoning_effort is not None and "reasoning_effort" in template:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)  # only a template that reads it gets it
    max_len = gw.max_model_len(await gw.backend.workers.alive())
    try:
        prompt_ids = await gw.prompts.encode_chat(tools.messages, req.add_generation_prompt, kwargs, max_len)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    fmt, opened = gw.reasoning, False
    if fmt is not None:
        opened = fmt.opened_by(gw.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False))
        if spec is not None:  # the constraint holds for the answer, after the thinking
            try:
                spec = grammar.after_reasoning(spec, fmt.start, fmt.end, opened)
            except grammar.GrammarError as e:
                raise bad_request(f"Invalid output constraint in '{param}': {e}", param) from None
    if spec is not None:
        await gw.check_grammar(spec, param, client)
    return ChatPlan(prompt_ids, spec, tools.parser, fmt, opened, param)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    req = P.parse_body(P.ChatCompletionRequest, await read_body(request))
    lora = await check_request(gw, req)
    plan = await plan_chat(gw, req, [m.model_dump(exclude_none=True) for m in req.messages], client_of(request))
    return await Generation(request, gw, req, ChatEndpoint(req, plan), [Prompt(plan.prompt_ids)], lora=lora).run()
