"""The text side: incremental detokenization, chat templates, special tokens (no model, no Redis)."""

from __future__ import annotations

import json

import pytest

from phaseserve.models.tokenizer import ChatTemplateError, Tokenizer
from text_model_factory import make_text_model

MULTIBYTE = "Hello wörld 🙂 日本語 naïve ✓"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(str(make_text_model(tmp_path_factory.mktemp("textmodel"))))


def test_multibyte_characters_are_split_across_tokens(tok):
    # the premise of the detokenizer tests: some tokens are not valid UTF-8 on their own
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any(tok.token_text(i).endswith("\ufffd") for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == MULTIBYTE.encode()


@pytest.mark.parametrize("prompt", ["", "Say:", "café"])
def test_incremental_detokenizer_never_emits_broken_utf8(tok, prompt):
    prompt_ids = tok.encode(prompt)
    out_ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    detok = tok.detokenizer(prompt_ids)
    deltas = [detok.add(i) for i in out_ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == tok.decode(out_ids)
    # text is held back (not lost) while a character is incomplete: some deltas are empty
    assert "" in deltas[:-1]


def test_detokenizer_flush_drops_an_incomplete_tail_but_shows_invalid_bytes(tok):
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1
    # cut by max_tokens: the emoji's last byte never comes; the end is the text before it, not U+FFFD
    ids = tok.encode("ok ", add_special_tokens=False) + emoji[:-1]
    detok = tok.detokenizer([])
    text = "".join(detok.add(i) for i in ids)
    assert text == "ok "
    assert detok.flush() == ""
    assert detok.text == "ok "
    # bytes no continuation could complete (a stray continuation byte) show as U+FFFD, as a full decode does
    stray = tok.encode("ok", add_special_tokens=False) + emoji[-1:]
    detok = tok.detokenizer([])
    assert "".join(detok.add(i) for i in stray) + detok.flush() == tok.decode(stray) == "ok\ufffd"


def test_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("Hello", add_special_tokens=False) + [tok.hf.token_to_id("</s>")]
    detok = tok.detokenizer(tok.encode("x"))
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "Hello"


def test_special_tokens_and_eos_ids(tok):
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.eos_token_ids == frozenset({tok.hf.token_to_id("</s>")})
    assert tok.encode("Hello")[0] == tok.bos_token_id
    assert tok.encode("Hello", add_special_tokens=False)[0] != tok.bos_token_id


def test_add_bos_token_false_overrides_post_processor(tmp_path):
    tok = Tokenizer(str(make_text_model(tmp_path, add_bos_token=False)))
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)


def test_chat_template_renders_like_transformers(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi\nthere</s>\n<|assistant|>\n"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's bos only


def test_chat_template_matches_transformers(tok):
    import transformers

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tok.path)
    messages = [{"role": "user", "content": "Hello wörld"}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Again"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)


def test_chat_template_errors_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="text"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_chat_template_runs_in_the_sandbox(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(str(make_text_model(tmp_path, chat_template=evil)))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_chat_templates_and_helpers(tmp_path):
    templates = [{"name": "default", "template": "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"},
                 {"name": "tool_use", "template": "TOOLS"}]
    tok = Tokenizer(str(make_text_model(tmp_path, chat_template=templates)))
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert out == json.dumps([{"role": "user", "content": "é<b>"}], ensure_ascii=False) + "|4"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], template_name="tool_use") == "TOOLS"
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], template_name="nope")


def test_chat_template_jinja_file_wins(tmp_path):
    path = make_text_model(tmp_path)
    (path / "chat_template.jinja").write_text("FILE{{ messages[0]['content'] }}")
    assert Tokenizer(str(path)).apply_chat_template([{"role": "user", "content": "x"}]) == "FILEx"
