"""Chat templates that keep the prefix stable: turn N+1's rendered prompt starts with turn N's rendered prompt
followed by turn N's answer, so a chat that resends its history finds all of it in the prefix cache. Checked
for the templates of the models we serve (SmolLM2's, Llama 3's, Qwen2's) as text, and for SmolLM2 as tokens
too. Where a template breaks it (Llama 3 trims an answer's surrounding whitespace; Llama 3.2 and later write
today's date into the system header) the test pins it, and docs/architecture.md ("Prefix caching") says so."""

from __future__ import annotations

import pytest

from phaseserve.models.model_source import resolve_model
from phaseserve.models.tokenizer import Tokenizer, compile_chat_template

# as shipped in each model's tokenizer_config.json
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3.2's header (its system turn), which fills in today's date
LLAMA32_HEADER = ("{%- if not date_string is defined %}{%- if strftime_now is defined %}"
                  "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}"
                  "{%- endif %}{%- endif %}<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}"
                  "<|eot_id|>")

QUESTIONS = ["What is a prefix?", "And a suffix?\nTwo lines.", "Thanks! One more: an example?", "Bye"]
ANSWERS = ["A start of a string.", "The end of one.\n\nLike 'ing'.", "Pre-fix and suff-ix.", "Bye!"]


def render(template: str, messages: list[dict], **context) -> str:
    return compile_chat_template(template).render(messages=messages, add_generation_prompt=True,
                                                  bos_token="<|begin_of_text|>", **context)


def turns(with_system: bool):
    history = [{"role": "system", "content": "Be brief."}] if with_system else []
    for q, a in zip(QUESTIONS, ANSWERS):
        history.append({"role": "user", "content": q})
        yield list(history), a
        history.append({"role": "assistant", "content": a})


@pytest.mark.parametrize("template", [SMOLLM2, LLAMA3, QWEN2], ids=["smollm2", "llama3", "qwen2"])
@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
def test_each_turn_starts_with_the_previous_prompt_and_its_answer(template, with_system):
    rendered = [(render(template, msgs), answer) for msgs, answer in turns(with_system)]
    for (prompt, answer), (nxt, _) in zip(rendered, rendered[1:]):
        assert nxt.startswith(prompt + answer), (prompt, nxt)


def test_smollm2_turns_extend_each_other_as_tokens():
    """The cache compares token ids: SmolLM2's tokenizer must cut turn N+1 where it cut turn N and the answer."""
    tok = Tokenizer.from_folder(resolve_model(None).path)
    prev = None
    for msgs, answer in turns(with_system=True):
        ids = tok.encode_chat(msgs)
        if prev is not None:
            assert ids[:len(prev)] == prev
        prev = ids + tok.encode(answer, add_special_tokens=False)


def test_where_templates_break_the_prefix():
    # Llama 3 trims each message: an answer ending in whitespace is resent without it, so the cache matches
    # up to the answer's last word, not past it
    msgs = [{"role": "user", "content": "Hi"}]
    first = render(LLAMA3, msgs)
    answer = "Hello there. \n"
    nxt = render(LLAMA3, msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More"}])
    assert not nxt.startswith(first + answer) and nxt.startswith(first + answer.strip())
    # Llama 3.2 and later write today's date into the system header: a new day changes an early token, and every
    # cached prefix misses from there
    assert render(LLAMA32_HEADER, msgs, date_string="25 Nov 2026") != render(LLAMA32_HEADER, msgs,
                                                                              date_string="26 Nov 2026")
