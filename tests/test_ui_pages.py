"""The chat page and the live view in headless Chromium, on one real stack (two workers, an API key, a small
step budget so a long prompt takes many steps): a wrong key shows the error, a two-turn conversation streams
into the page, a busy gateway's 429 is shown with its Retry-After, the live view shows a long prompt's chunks
beside the decodes, a killed worker leaves it, and with none left the chat page says so (503).
Screenshots go to runs/ui-screenshots (desktop and 360 px wide)."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import openai
import pytest

from browser import DESKTOP, PHONE, chromium, screenshot
from e2e_stack import running_stack, wait_for

KEY = "sk-ui-test-key"
BUDGET = 16  # tokens a step, of which a long prompt beside decodes gets LONG_CAP: many chunks, however fast
LONG_CAP = 4
LONG_PROMPT_TOKENS = 2000
IN_FLIGHT = 3
RETRY_AFTER = 3


@pytest.fixture(scope="module")
def ui_stack(e2e_model, tmp_path_factory):
    with running_stack(e2e_model, tmp_path_factory.mktemp("ui-stack"), api_key=KEY, workers=2,
                       max_num_batched_tokens=BUDGET, max_num_seqs=8, long_prefill_threshold=LONG_CAP,
                       # three streams fill the gateway: a fourth request gets a 429
                       max_waiting_requests=IN_FLIGHT, retry_after=RETRY_AFTER) as stack:
        yield stack


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, ui_stack):
    """A page whose session already holds the right key (the key form is tested on its own)."""
    context = browser.new_context(viewport=DESKTOP)
    context.add_init_script(f"sessionStorage.setItem('phaseserve.apiKey', {json.dumps(KEY)})")
    page = context.new_page()
    yield page
    context.close()


def test_a_wrong_api_key_shows_the_error(browser, ui_stack):
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    try:
        page.goto(ui_stack.base_url + "/")
        # no key: the models list is refused, the page says what to do and opens its settings
        error = page.locator("#error")
        error.wait_for(state="visible")
        assert "needs an API key (401)" in error.inner_text()
        assert page.locator("#settings").get_attribute("open") is not None
        assert error.get_attribute("role") == "alert"
        page.fill("#api-key", "sk-wrong")
        page.press("#api-key", "Tab")  # change: saved, the models asked for again
        page.fill("#prompt", "Hello")
        page.press("#prompt", "Enter")
        page.wait_for_function("document.querySelector('#error').dataset.kind === 'auth' && "
                               "document.querySelector('#status').textContent === ''")
        assert "refused (401)" in error.inner_text()
        assert page.locator(".message").count() == 0  # nothing came: no empty answer left behind,
        assert page.locator("#prompt").input_value() == "Hello"  # and the question is back in the box
        assert page.evaluate("sessionStorage.getItem('phaseserve.apiKey')") == "sk-wrong"
        assert page.evaluate("localStorage.getItem('phaseserve.apiKey')") is None  # not remembered unasked
        screenshot(page, "chat-wrong-key-360px")
        # the right key: the error goes, models load
        page.fill("#api-key", KEY)
        page.press("#api-key", "Tab")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        assert page.locator("#error").is_hidden()
        assert page.locator("#model").input_value() == ui_stack.model
        # the live view, with the wrong key again, says so too
        page.evaluate("sessionStorage.setItem('phaseserve.apiKey', 'sk-wrong')")
        page.goto(ui_stack.base_url + "/ui/stack")
        page.locator("#error").wait_for(state="visible")
        assert "401" in page.locator("#error").inner_text()
    finally:
        context.close()


def test_a_two_turn_conversation_streams_into_the_page(page, ui_stack):
    sent = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    page.goto(ui_stack.base_url + "/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    # count the answer's updates as they land: a streamed answer grows in several, not at once
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
          .observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true}); }""")
    for turn, text in enumerate(("Tell me a story.", "And then?"), start=1):
        page.focus("#prompt")
        page.keyboard.type(text)
        page.keyboard.press("Shift+Enter")  # a new line, not a send
        page.keyboard.type("Please.")
        page.keyboard.press("Enter")
        meta = page.locator(".message.assistant .meta").nth(turn - 1)
        page.wait_for_function(f"document.querySelectorAll('.message.assistant .meta').length >= {turn} && "
                               f"document.querySelectorAll('.message.assistant .meta')[{turn - 1}].textContent", timeout=60_000)
        words = meta.inner_text()
        assert "completion tokens" in words and "TTFT" in words and "tok/s" in words, words
        assert page.locator(".message.assistant .content").nth(turn - 1).inner_text().strip()
    assert page.evaluate("window.updates") > 6  # two questions, two answers, each answer in several pieces
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]  # the history went along
    assert sent[0]["messages"][0]["content"] == "Tell me a story.\nPlease."
    assert sent[1]["messages"][1]["content"] == page.locator(".message.assistant .content").nth(0).inner_text()
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
               and b["max_tokens"] == 24 for b in sent)
    assert not page.locator("#regenerate").is_disabled()
    screenshot(page, "chat-desktop")
    page.set_viewport_size(PHONE)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # nothing runs off the side
    screenshot(page, "chat-360px")
    # regenerate: the last answer is asked for again, over the same history
    page.click("#regenerate")
    page.wait_for_function("document.querySelectorAll('.message.assistant .meta').length === 2 && "
                           "document.querySelectorAll('.message.assistant .meta')[1].textContent", timeout=60_000)
    assert [m["role"] for m in sent[2]["messages"]] == ["user", "assistant", "user"]


def stream_in_background(client, model: str, stop: threading.Event, errors: list) -> threading.Thread:
    """Long greedy streams read in a thread until `stop`, one after another (on a fast machine one ends before
    the test is done with it); returns once the first token came."""
    started = threading.Event()

    def run():
        try:
            while not stop.is_set():
                stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=2000,
                                                   stream=True, temperature=0, extra_body={"ignore_eos": True})
                with stream:
                    for _ in stream:
                        started.set()
                        if stop.is_set():
                            break
        except Exception as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60) and not errors, errors
    return t


def in_flight(stack) -> float:
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as resp:
        body = resp.read().decode()
    return float(re.search(r"^phaseserve_gateway_requests_in_flight (\S+)$", body, re.M).group(1))


def test_the_live_view_shows_a_long_prompts_chunks_beside_the_decodes(page, ui_stack):
    stops, errors, threads = [threading.Event() for _ in range(IN_FLIGHT)], [], []
    with openai.OpenAI(base_url=ui_stack.api_url, api_key=KEY, max_retries=0, timeout=120) as client:
        page.goto(ui_stack.base_url + "/ui/stack")
        page.wait_for_function("document.querySelectorAll('.worker').length === 2")
        try:
            # the gateway's limit of requests in flight, all long streams: the chat page gets a 429
            threads += [stream_in_background(client, ui_stack.model, stop, errors) for stop in stops]
            busy_chat_says_when_to_retry(page.context.new_page(), ui_stack)
            # one stream ends: one decodes on each worker (the scheduler spreads them), and a long prompt
            # goes beside one of them
            stops[-1].set()
            assert wait_for(lambda: in_flight(ui_stack) == IN_FLIGHT - 1, 30)
            long_done = threading.Event()

            def long_prompt():
                try:
                    client.completions.create(model=ui_stack.model, max_tokens=2, temperature=0,
                                              prompt=list(range(100, 100 + LONG_PROMPT_TOKENS)))
                except Exception as e:  # noqa: BLE001 -- reported by the test
                    errors.append(e)
                long_done.set()

            threading.Thread(target=long_prompt, daemon=True).start()
            # a worker's step of decode tokens and prompt-chunk tokens together, drawn as one stacked bar
            page.wait_for_function("""() => [...document.querySelectorAll('.step')].some(
                g => +g.dataset.decode > 0 && +g.dataset.prefill > 0)""", timeout=60_000)
            # and the long prompt in the queue, well into its prefill (many chunks drawn) and not through it
            page.wait_for_function(f"""() => [...document.querySelectorAll('#queue progress')].some(
                p => +p.max === {LONG_PROMPT_TOKENS} && +p.value > {16 * LONG_CAP} && +p.value < +p.max)""",
                                   timeout=120_000)
            screenshot(page, "stack-desktop")
            page.set_viewport_size(PHONE)
            assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
            screenshot(page, "stack-360px")
            page.set_viewport_size(DESKTOP)
            # each bar says what it is in words too (its title, for a screen reader or a hover)
            titles = page.locator(".step title").all_text_contents()
            assert any(re.match(r"[1-9]\d* decode \+ [1-9]\d* prompt-chunk tokens", t) for t in titles), titles
            # chunks never exceed the step budget; decodes ride beside them
            for g in page.locator(".step").all():
                assert int(g.get_attribute("data-decode")) + int(g.get_attribute("data-prefill")) <= BUDGET
            assert long_done.wait(180) and not errors, errors
            totals = page.locator("#totals").inner_text()
            assert "Tokens/s" in totals and "TTFT p50 / p99" in totals
        finally:
            for stop in stops:
                stop.set()
            for t in threads:
                t.join(30)


def busy_chat_says_when_to_retry(chat, ui_stack):
    """While the gateway holds its limit of requests, a question from the chat page gets a 429: the page
    says when to try again and holds Send that long."""
    chat.goto(ui_stack.base_url + "/")
    chat.wait_for_function("document.querySelector('#model').options.length > 0")
    chat.fill("#prompt", "Are you busy?")
    chat.press("#prompt", "Enter")
    chat.locator("#error").wait_for(state="visible")
    words = chat.locator("#error").inner_text()
    assert "busy (429)" in words and f"Try again in {RETRY_AFTER} s" in words, words
    assert chat.locator("#send").is_disabled() and "s)" in chat.locator("#send").inner_text()
    assert chat.locator("#prompt").input_value() == "Are you busy?"
    screenshot(chat, "chat-busy-429")
    chat.wait_for_function("document.querySelector('#send').textContent === 'Send'", timeout=(RETRY_AFTER + 5) * 1000)
    assert not chat.locator("#send").is_disabled()
    chat.close()
    assert in_flight(ui_stack) == IN_FLIGHT  # the streams were in flight all along


def test_killed_workers_leave_the_live_view_and_the_chat_says_none_is_left(page, ui_stack):
    page.goto(ui_stack.base_url + "/ui/stack")
    page.wait_for_function("document.querySelectorAll('.worker[data-worker-id]').length === 2")
    shown = page.evaluate("[...document.querySelectorAll('.worker')].map(w => w.dataset.workerId)")
    victim = ui_stack.stack.procs["worker-1"]
    killed = next(w for w in shown if w.endswith(f"-{victim.pid}"))
    victim.kill()
    victim.wait(10)
    page.wait_for_function("document.querySelectorAll('.worker').length === 1", timeout=30_000)
    left = page.evaluate("[...document.querySelectorAll('.worker')].map(w => w.dataset.workerId)")
    assert left == [w for w in shown if w != killed]
    assert f"Worker {killed} left" in page.locator("#notices").inner_text()
    screenshot(page, "stack-worker-killed")
    assert wait_for(lambda: ui_stack.scheduler_stats().get("num_workers") == 1, 30)
    # the last one too: the live view says no worker is alive, and a question gets the 503 in words
    last = ui_stack.stack.procs["worker-0"]
    last.kill()
    last.wait(10)
    page.wait_for_function("document.querySelectorAll('.worker').length === 0", timeout=30_000)
    assert "No worker is alive" in page.locator("#status").inner_text()
    chat = page.context.new_page()
    chat.goto(ui_stack.base_url + "/")
    chat.fill("#prompt", "Anyone there?")
    chat.press("#prompt", "Enter")
    chat.locator("#error").wait_for(state="visible")
    words = chat.locator("#error").inner_text()
    assert "cannot serve this right now (503)" in words and "No worker is alive" in words, words
    screenshot(chat, "chat-no-worker-503")
