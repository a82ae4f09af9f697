"""The reasoning parser, pure: a model's thinking split from its answer as the text streams in pieces cut
anywhere (a tag split across tokens), and the grammar that holds a constraint only after the thinking."""

from __future__ import annotations

import llguidance
import pytest

from phaseserve.gateway.chat_output import ChatOutputReader, read_whole
from phaseserve.gateway.reasoning import FORMATS, reasoning_format
from phaseserve.gateway.tools import HermesParser
from phaseserve import grammar, settings
from phaseserve.models.tokenizer import Tokenizer

R1 = FORMATS["deepseek_r1"]


def _streamed(text: str, opened: bool, cut: int) -> tuple[str, str, bool]:
    """Feed `text` in pieces of `cut` characters (and the rest at the end)."""
    s = R1.splitter(opened)
    reasoning, content = "", ""
    for i in range(0, len(text), cut):
        r, c = s.feed(text[i:i + cut])
        reasoning += r
        content += c
    r, c = s.finish()
    return reasoning + r, content + c, s.reasoned


CASES = [
    # (output, prompt opened the thinking, reasoning, content)
    ("I add 2 and 2.</think>\n\nIt is 4.", True, "I add 2 and 2.", "It is 4."),
    ("<think>Hmm, a < b.</think>Yes", False, "Hmm, a < b.", "Yes"),
    ("\n <think>x</think>y", False, "x", "y"),
    ("No thinking here.", False, None, "No thinking here."),
    ("<thinker>is content", False, None, "<thinker>is content"),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # only the first block is reasoning
    ("still thinking </thi", True, "still thinking </thi", ""),  # ended inside the thinking
    ("", True, "", ""),
    ("<th", False, None, "<th"),
]


@pytest.mark.parametrize("text,opened,reasoning,content", CASES)
def test_the_split_is_the_same_whatever_the_pieces(text, opened, reasoning, content):
    assert R1.split(text, opened) == (reasoning, content)
    for cut in range(1, max(2, len(text) + 1)):
        got_r, got_c, reasoned = _streamed(text, opened, cut)
        assert (got_r if reasoned else None, got_c) == (reasoning, content), cut


def test_text_that_may_begin_a_tag_is_held_back_until_the_next_piece_says():
    s = R1.splitter(True)
    assert s.feed("one </thi") == ("one ", "")
    assert s.feed("nk>two") == ("", "two")
    s = R1.splitter(True)
    assert s.feed("x </") == ("x ", "")
    assert s.feed("div>") == ("</div>", "")  # not the tag after all: it was thinking


def test_whether_the_prompt_opened_the_thinking():
    assert R1.opened_by("<|assistant|>\n<think>\n")
    assert not R1.opened_by("<|assistant|>\n")
    assert not R1.opened_by("<think>a</think>\n")
    assert reasoning_format("none") is None and reasoning_format("qwen3").end == "</think>"
    # the flag offers exactly the formats there are
    flag = next(s for s in settings.SETTINGS if s.name == "reasoning_parser")
    assert flag.choices == ("none", *FORMATS)


def test_reasoning_then_a_tool_call_read_streamed_and_whole_agree():
    text = 'Need weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = read_whole(text, HermesParser(), R1, True)
    assert whole.reasoning == "Need weather." and whole.content is None
    assert [c["function"]["name"] for c in whole.tool_calls] == ["w"]
    reader = ChatOutputReader(HermesParser(), R1, True)
    pieces = [reader.feed(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(p.reasoning for p in pieces) == "Need weather."
    assert not "".join(p.content for p in pieces).strip()
    calls = [c for p in pieces for c in p.tool_calls]
    assert [c["function"]["arguments"] for c in calls] == [whole.tool_calls[0]["function"]["arguments"]]


@pytest.fixture(scope="module")
def engine():
    path = settings.bundled_model_path()
    tok = Tokenizer.from_folder(path)
    return tok, grammar.engine_tokenizer(path + "/tokenizer.json", tok.vocab_size, tuple(sorted(tok.eos_token_ids)))


def _follows(engine, spec, text: str) -> tuple[bool, bool]:
    """(every token of text allowed, the grammar accepts it whole)"""
    tok, llt = engine
    m = llguidance.LLMatcher(llt, grammar.engine_grammar(spec), log_level=0)
    ok = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok, ok and m.is_accepting()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_a_schema_holds_only_after_the_thinking(engine):
    spec = grammar.after_reasoning(grammar.json_schema(SCHEMA), "<think>", "</think>", opened=True)
    grammar.check(spec, engine[1])
    assert _follows(engine, spec, 'free {text}, "quotes" and <tags>\n</think>\n\n{"a":1}') == (True, True)
    assert _follows(engine, spec, "thinking</think>not json")[0] is False
    assert _follows(engine, spec, '{"a":1}') == (True, False)  # still thinking: JSON-like text is thought
    assert _follows(engine, spec, 'one</think>{"a":1}</think>')[0] is False  # the first end tag ends it
    # a prompt that did not open the thinking: the model may open it itself, or answer at once
    free = grammar.after_reasoning(grammar.json_schema(SCHEMA), "<think>", "</think>", opened=False)
    assert _follows(engine, free, '{"a":2}') == (True, True)
    assert _follows(engine, free, '<think>hm</think>{"a":2}') == (True, True)
    assert _follows(engine, free, 'hm</think>{"a":2}')[0] is False


def test_any_kind_of_constraint_nests_after_the_thinking(engine):
    tool = HermesParser().forced_grammar([{"name": "w", "parameters": SCHEMA}])
    for spec, answer in ((grammar.choice(["yes", "no"]), "no"), (tool, '<tool_call>\n{"name": "w", "arguments": '
                                                                         '{"a":3}}\n</tool_call>')):
        wrapped = grammar.after_reasoning(spec, "<think>", "</think>", opened=True)
        assert _follows(engine, wrapped, "ok</think>" + answer) == (True, True)
        assert _follows(engine, wrapped, "ok</think>maybe")[0] is False
