"""The Responses output items and typed events, pure: a reasoning part, an answer and a tool call, fed in pieces,
give OpenAI's event order with consecutive sequence numbers, and the events validate as the official
client's types; the conversation's items become the chat messages the template renders."""

from __future__ import annotations

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from phaseserve.gateway.responses_events import ResponseBuilder, usage
from phaseserve.gateway.responses_protocol import chat_messages

EVENTS = TypeAdapter(ResponseStreamEvent)


def _response() -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": None, "model": "m", "output": [],
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "metadata": {}, "usage": None}


def test_reasoning_then_text_then_a_call_give_openai_events_in_order():
    b = ResponseBuilder(_response())
    events = b.start()
    events += b.piece("Let me ", "", [])
    events += b.piece("think.", "\n", [])  # blank content opens no message
    events += b.piece("", "Hel", [])
    events += b.piece("", "lo", [])
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    events += b.piece("", "", [call])
    events += b.finish("completed", usage(10, 5, 4, 2))
    types = [e["type"] for e in events]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)  # each is one of the client's event types, fields and all
    final = Response.model_validate(events[-1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Hello" and final.output[0].content[0].text == "Let me think."
    assert final.output[2].arguments == '{"a":1}' and final.output[2].call_id == "call_1"
    assert final.usage.input_tokens_details.cached_tokens == 4 and final.usage.total_tokens == 15
    # the snapshot in response.created does not change as the output grows
    assert events[0]["response"]["output"] == []


def test_max_output_tokens_ends_incomplete_and_an_error_fails():
    b = ResponseBuilder(_response())
    events = b.piece("", "partial", []) + b.finish("incomplete", usage(3, 2, 0, 0), "max_output_tokens")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    b = ResponseBuilder(_response())
    end = b.finish("failed", None, error={"code": "server_error", "message": "worker died"})
    assert end[-1]["type"] == "response.failed" and EVENTS.validate_python(end[-1]).response.error.code == "server_error"


def test_a_conversation_becomes_chat_messages():
    items = [{"type": "message", "role": "user", "content": "Weather?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
             {"role": "user", "content": "Thanks"}]
    assert chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "user", "content": "Thanks"}]
