"""The admission bounds of a generation (gateway/admission.py): max_tokens against the model's context and the
live workers' KV caches, each endpoint with its own default and parameter name."""

from __future__ import annotations

import pytest

from phaseserve.gateway import protocol as P
from phaseserve.gateway.admission import output_bound
from phaseserve.gateway.endpoints import DEFAULT_COMPLETION_MAX_TOKENS, ChatEndpoint, ChatPlan, CompletionEndpoint
from phaseserve.gateway.errors import APIError
from phaseserve.kv_admission import KVCapacity

SMALL_CACHE = [KVCapacity(num_blocks=8, block_size=16, max_model_len=1024)]


def chat(**fields) -> ChatEndpoint:
    req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    return ChatEndpoint(req, ChatPlan([1, 2, 3], None, None, None, False))


def completion(**fields) -> CompletionEndpoint:
    return CompletionEndpoint(P.CompletionRequest(model="m", prompt="hi", **fields))


def test_without_max_tokens_chat_gets_what_fits_and_completions_get_openai_s_default():
    fits = SMALL_CACHE[0].max_new_tokens(20)
    assert 0 < fits < 1024 - 20
    assert output_bound(chat(), 1024, SMALL_CACHE, 20) == fits
    assert output_bound(completion(), 1024, SMALL_CACHE, 20) == DEFAULT_COMPLETION_MAX_TOKENS
    assert output_bound(chat(), 1024, [], 20) == 1024 - 20  # no cache known: the context's room


def test_a_request_over_the_context_or_the_cache_is_refused_naming_its_field():
    with pytest.raises(APIError) as e:
        output_bound(chat(max_completion_tokens=2000), 1024, SMALL_CACHE, 20)
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"
    with pytest.raises(APIError) as e:
        output_bound(completion(max_tokens=500), 1024, SMALL_CACHE, 20)  # fits the context, not the cache
    assert e.value.param == "max_tokens" and "KV cache" in e.value.message
    with pytest.raises(APIError) as e:
        output_bound(completion(), 1024, SMALL_CACHE, 1024)
    assert e.value.param == "prompt" and "1024 tokens" in e.value.message
    assert output_bound(chat(max_tokens=10), 1024, SMALL_CACHE, 20) == 10
