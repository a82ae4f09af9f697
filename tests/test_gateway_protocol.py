"""Gateway units: request parsing/validation, stop strings, per-sequence output, offset dedup."""

from __future__ import annotations

import json

import pytest

from phaseserve.gateway import protocol as P
from phaseserve.gateway.token_delivery import TokenRoutes
from phaseserve.gateway.errors import APIError
from phaseserve.gateway.output import SequenceOutput, chat_logprobs, completion_logprobs
from phaseserve.gateway.stop_strings import StopStringMatcher
from phaseserve.models.tokenizer import Tokenizer
from phaseserve.wire import TokenEvent
from text_model_factory import make_text_model


def parse(model, body) -> object:
    return P.parse_body(model, json.dumps(body).encode() if not isinstance(body, bytes) else body)


def error_of(model, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


# ----------------------------------------------------------------------------- parsing


def test_completion_request_fields_map_to_sampling_params():
    req = parse(P.CompletionRequest, {
        "model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
        "presence_penalty": 1, "frequency_penalty": -1, "repetition_penalty": 1.2, "seed": 5, "stop": "\n",
        "stop_token_ids": [9], "ignore_eos": True, "logprobs": 2, "n": 3, "user": "u", "min_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True}, "some_future_field": 1})
    sp = P.sampling_params(req, 7)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (7, 0.0, 0.5, 3, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (1.0, -1.0, 1.2)
    assert (sp.seed, sp.stop_token_ids, sp.ignore_eos, sp.logprobs, sp.min_tokens) == (5, [9], True, 2, 2)
    assert req.stop_strings() == ["\n"] and req.n == 3 and req.include_usage


def test_token_id_prompt_and_defaults():
    req = parse(P.CompletionRequest, {"prompt": [1, 2, 3]})
    assert req.prompt == [1, 2, 3] and req.model is None and not req.stream
    sp = P.sampling_params(req, 16)
    assert sp.temperature == 1.0 and sp.logprobs is None and sp.top_k == 0


def test_chat_request_logprobs_and_max_completion_tokens():
    req = parse(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                          "top_logprobs": 3, "max_tokens": 5, "max_completion_tokens": 9})
    assert req.requested_logprobs() == 3 and req.requested_max_tokens() == 9
    req = parse(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert req.requested_logprobs() == 0
    assert parse(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}).requested_logprobs() \
        is None


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "Malformed JSON"),
    (b"", None, "empty"),
    (b"[1, 2]", None, "JSON object"),
    ({}, "prompt", "Missing required field 'prompt'"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": [1, True]}, "prompt", "prompt"),
    ({"prompt": [1, -2]}, "prompt", ">= 0"),
    ({"prompt": "x", "max_tokens": "7"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "n": 1000}, "n", "less than or equal to 16"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "stop"),
    ({"prompt": "x", "stop": 3}, "stop", "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", "less than or equal to 100"),
    ({"prompt": "x", "logit_bias": {"1": -100.5}}, "logit_bias", "greater than or equal to -100"),
    ({"prompt": "x", "logit_bias": {"one": 2}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias", "number"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", "at least"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of", "streamed"),
    ({"prompt": "x", "best_of": 17}, "best_of", "less than or equal to 16"),
    ({"prompt": [[1], []]}, "prompt", "array"),
    ({"prompt": ["a", 1]}, "prompt", "array"),
    ({"prompt": ["x"] * 129}, "prompt", "array"),
    ({"prompt": ["x"] * 20, "n": 16}, "prompt", "at most 256"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "x", "presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
])
def test_completion_validation_errors(body, param, words):
    err = error_of(P.CompletionRequest, body)
    assert err.param == param
    assert words in err.message


def test_min_tokens_above_max_tokens_is_rejected_by_sampling_params():
    req = parse(P.CompletionRequest, {"prompt": "x", "min_tokens": 10})
    with pytest.raises(APIError) as e:
        P.sampling_params(req, 5)
    assert e.value.status == 400 and e.value.param == "min_tokens"


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "Missing required field 'messages'"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages", "needs 'content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages",
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "requires"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "Missing required field 'tools[0].function'"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "needs 'tool_call_id'"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
])
def test_chat_validation_errors(body, param, words):
    err = error_of(P.ChatCompletionRequest, body)
    assert err.param == param
    assert words in err.message


def test_response_shapes():
    chunk = P.chat_chunk("chatcmpl-1", 1, "m", [P.chat_chunk_choice(0, {"content": "x"})], None, True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert set(chunk["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    body = P.completion_response("cmpl-1", 1, "m", [P.completion_choice(0, "t", None, "length")], P.usage(3, 4))
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert "usage" not in P.completion_chunk("cmpl-1", 1, "m", [])


# ----------------------------------------------------------------------------- stop strings


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for p in pieces:
        text, stopped = matcher.feed(p)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_split_across_deltas_never_leaks():
    out, stopped = feed_all(StopStringMatcher(["STOP"]), ["Hello S", "T", "O", "P and more"])
    assert stopped and "".join(out) == "Hello "
    assert all("S" not in o for o in out)  # the partial "S", "ST", "STO" were held back, then dropped


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ARS") == ("STAR", False)  # "S" could still begin "STOP"
    assert m.flush() == "S"


def test_earliest_of_several_stop_strings_wins():
    out, stopped = feed_all(StopStringMatcher(["world", "lo w"]), ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_held_text_is_released_at_the_end():
    out, stopped = feed_all(StopStringMatcher(["\n\n"]), ["line\n"])
    assert not stopped and out == ["line", "\n"]


# ----------------------------------------------------------------------------- per-sequence output


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(str(make_text_model(tmp_path_factory.mktemp("textmodel"))))


def test_sequence_output_stops_at_the_token_that_completes_the_stop_string(tok):
    ids = tok.encode("Hello wörld. Stop here, or go on.", add_special_tokens=False)
    out = SequenceOutput(0, "r-0", tok, tok.encode("x"), ["Stop"])
    deltas = [out.on_event(TokenEvent("r-0", i, [t])) for i, t in enumerate(ids)]
    assert out.text == "Hello wörld. " and out.finish_reason == "stop" and out.stopped_by_string
    assert "".join(d.text for d in deltas) == out.text
    assert out.num_tokens == len(tok.encode("Hello wörld. Stop", add_special_tokens=False))


def test_min_tokens_defers_stop_strings(tok):
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    assert [tok.token_text(i) for i in ids] == ["a", "b", " a", "b", " a", "b"]
    for min_tokens, text, used in ((0, "", 2), (5, "ab ab ", 6)):
        out = SequenceOutput(0, "r-0", tok, [], ["ab"], min_tokens=min_tokens)
        out.on_event(TokenEvent("r-0", 0, ids))
        assert (out.finish_reason, out.text, out.num_tokens) == ("stop", text, used)


def test_sequence_output_with_logprobs_and_worker_finish(tok):
    ids = tok.encode("Café 🙂", add_special_tokens=False)
    lps = [[-0.5, [[t, -0.5], [7, -1.5]]] for t in ids]
    out = SequenceOutput(0, "r-0", tok, [], [], text_offset_base=2)
    d1 = out.on_event(TokenEvent("r-0", 0, ids[:-1], None, lps[:-1]))
    d2 = out.on_event(TokenEvent("r-0", len(ids) - 1, ids[-1:], "length", lps[-1:]))
    assert d1.text + d2.text == "Café 🙂" and "\ufffd" not in d1.text and d2.finish_reason == "length"
    c = completion_logprobs(tok, out.logprobs)
    assert c["token_logprobs"] == [-0.5] * len(ids) and c["text_offset"][0] == 2
    assert all(len(t) in (1, 2) for t in c["top_logprobs"])
    ch = chat_logprobs(tok, out.logprobs)["content"]
    assert bytes(sum((e["bytes"] for e in ch), [])) == "Café 🙂".encode()
    assert ch[0]["top_logprobs"][1]["token"] == tok.token_text(7)


def test_error_event_finishes_with_error(tok):
    out = SequenceOutput(0, "r-0", tok, [], [])
    d = out.on_event(TokenEvent("r-0", 0, [], "error", None, "worker died"))
    assert d.finish_reason == "error" and d.error == "worker died"


# ----------------------------------------------------------------------------- offsets


def test_request_stream_drops_duplicates_trims_overlaps_and_holds_gaps_for_a_fill():
    routes = TokenRoutes()
    stream = routes.open(["a-0"])
    stream.deliver(TokenEvent("a-0", 0, [1, 2]))
    stream.deliver(TokenEvent("a-0", 0, [1, 2]))  # replayed: dropped
    stream.deliver(TokenEvent("a-0", 1, [2, 3], None, [[-1.0, []], [-2.0, []]]))  # overlap: keep [3]
    stream.deliver(TokenEvent("a-0", 5, [6], "stop"))  # gap (3, 4 missing): held, a fill from the log asked for
    assert stream.queue.qsize() == 2 and stream in routes.fill_wanted and "a-0" in routes.by_seq
    stream.deliver(TokenEvent("a-0", 3, [4, 5]), from_log=True)  # the fill
    stream.release_held()
    got = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert [(e.offset, e.token_ids) for e in got] == [(0, [1, 2]), (2, [3]), (3, [4, 5]), (5, [6])]
    assert got[1].logprobs == [[-2.0, []]]
    assert "a-0" not in routes.by_seq  # final event: the route is gone


def test_a_choice_cut_by_max_tokens_mid_character_ends_before_it(tok):
    """finish_reason 'length' after half of a multi-byte character: the text ends before the character
    instead of in U+FFFD."""
    ids = tok.encode("Hello 🙂", add_special_tokens=False)[:-1]
    out = SequenceOutput(0, "r-0", tok, tok.encode("x"), [])
    d1 = out.on_event(TokenEvent("r-0", 0, ids[:3], None))
    d2 = out.on_event(TokenEvent("r-0", 3, ids[3:], "length"))
    assert d2.finish_reason == "length" and out.num_tokens == len(ids)
    assert d1.text + d2.text == out.text == "Hello "


def test_integers_beyond_64_bits_and_template_argument_clashes_are_400_naming_the_field():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert error_of(P.CompletionRequest, {"prompt": "hi", "seed": 1 << 64}).param == "seed"
    assert error_of(P.CompletionRequest, {"prompt": "hi", "seed": -(1 << 63) - 1}).param == "seed"
    assert error_of(P.ChatCompletionRequest, {**chat, "top_k": 1 << 63}).param == "top_k"
    assert error_of(P.ChatCompletionRequest, {**chat, "stop_token_ids": [2, 1 << 64]}).param == "stop_token_ids"
    too_many = error_of(P.CompletionRequest, {"prompt": "hi", "stop_token_ids": [1] * (P.MAX_STOP_TOKEN_IDS + 1)})
    assert too_many.param == "stop_token_ids"
    for name in ("messages", "add_generation_prompt"):
        e = error_of(P.ChatCompletionRequest, {**chat, "chat_template_kwargs": {name: 1}})
        assert e.param == "chat_template_kwargs" and name in e.message
    req = parse(P.ChatCompletionRequest, {**chat, "stop_token_ids": [3, 99], "seed": (1 << 63) - 1})
    req.check_token_ids(100)
    with pytest.raises(APIError) as e:
        req.check_token_ids(99)
    assert e.value.status == 400 and e.value.param == "stop_token_ids"
