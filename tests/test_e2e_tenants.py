"""Keys as tenants, end to end: a whole stack started with `--api-keys-file`, the official openai client over
real sockets, the bundled model. A tenant sees its own prefix hits and never another's (in
`usage.prompt_tokens_details.cached_tokens` and in the time to its first token), `cache_salt` narrows the
cache within a key, tenants the operator groups share; a key's priority class bounds `priority`; limits
answer 429 naming the limit while another tenant's stream goes on; `/v1/usage` and `/metrics` count per key
and tenant; the file is reloaded while the stack runs."""

from __future__ import annotations

import hashlib
import re
import statistics
import threading
import time

import openai
import pytest
import requests
import yaml

from e2e_stack import running_stack

KEYS = {"alice": "sk-alice-0001", "alice2": "sk-alice-0002", "bob": "sk-bob-0001", "carol": "sk-carol-0001",
        "dave": "sk-dave-0001", "quinn": "sk-quinn-0001", "pat": "sk-pat-0001", "newbie": "sk-new-0001"}


def keys_file(with_newbie: bool = False) -> dict:
    keys = [{"name": "alice", "key": KEYS["alice"], "tenant": "team-a"},
            # the file may hold a key's digest only
            {"name": "alice2", "sha256": hashlib.sha256(KEYS["alice2"].encode()).hexdigest(), "tenant": "team-a"},
            {"name": "bob", "key": KEYS["bob"], "tenant": "team-b"},
            {"name": "carol", "key": KEYS["carol"], "tenant": "team-c"},
            {"name": "dave", "key": KEYS["dave"], "tenant": "team-d"},
            {"name": "quinn", "key": KEYS["quinn"], "tenant": "team-q"},
            {"name": "pat", "key": KEYS["pat"], "tenant": "team-p"}]
    if with_newbie:
        keys = [k for k in keys if k["name"] != "alice2"] + [{"name": "newbie", "key": KEYS["newbie"],
                                                               "tenant": "team-b"}]
    return {"tenants": {"team-a": {"weight": 1}, "team-b": {"weight": 1},
                        "team-c": {"share_prefix_cache_with": "common"},
                        "team-d": {"share_prefix_cache_with": "common"},
                        "team-q": {"limits": {"max_concurrent_requests": 1, "tokens_per_minute": 400}},
                        "team-p": {"priority": [5, 10]}},
            "keys": keys}


@pytest.fixture(scope="module")
def stack(e2e_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenants")
    path = logs / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_file()))
    with running_stack(e2e_model, logs, api_keys_file=str(path), api_keys_reload_interval=0.2) as s:
        s.keys_path = path
        yield s


def client(stack, who: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api_url, api_key=KEYS[who], max_retries=0, timeout=kw.get("timeout", 120))


def prompt_of(seed: str, words: int) -> str:
    """A prompt of about `words` tokens that no other test shares (the seed leads it)."""
    return f"{seed}: " + " ".join(f"w{(i * 7919 + len(seed)) % 997}" for i in range(words))


def completion(stack, who: str, prompt: str, **extra):
    with client(stack, who) as c:
        t0 = time.perf_counter()
        r = c.completions.create(model=stack.model, prompt=prompt, max_tokens=1, temperature=0.0,
                                 extra_body=extra or None)
        return r, time.perf_counter() - t0


def cached(stack, who: str, prompt: str, **extra) -> int:
    return completion(stack, who, prompt, **extra)[0].usage.prompt_tokens_details.cached_tokens


def test_a_tenant_sees_its_own_prefix_hits_and_never_another_s(stack):
    p = prompt_of("isolation", 400)
    assert cached(stack, "alice", p) == 0
    assert cached(stack, "alice2", p) >= 256  # another key of the same tenant: the cache hits
    assert cached(stack, "bob", p) == 0  # another tenant: nothing, though the blocks are there
    assert cached(stack, "alice", p, cache_salt="s1") == 0  # a salt narrows one key's cache
    assert cached(stack, "alice", p, cache_salt="s1") >= 256
    assert cached(stack, "alice", p, cache_salt="s2") == 0
    q = prompt_of("shared-group", 400)
    assert cached(stack, "carol", q) == 0
    assert cached(stack, "dave", q) >= 256  # tenants the operator put in one group share


def test_another_tenant_s_prefix_does_not_shorten_the_first_token(stack):
    """The timing probe: a long prompt alice sent is quick for alice again (cached) but costs bob as much as a
    fresh prompt. Medians over fresh prompts, judged against each trial's own cold and warm times."""
    cold, warm, probe = [], [], []
    for trial in range(3):
        p = prompt_of(f"probe-{trial}", 550)  # ~1,800 tokens
        r, t = completion(stack, "alice", p)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        cold.append(t)
        warm.append(completion(stack, "alice", p)[1])
        r, t = completion(stack, "bob", p)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        probe.append(t)
    c, w, b = statistics.median(cold), statistics.median(warm), statistics.median(probe)
    assert w < 0.6 * c, (cold, warm)  # the probe can tell a hit: alice's own hit is clearly quicker
    assert b > w + 0.5 * (c - w), (cold, warm, probe)  # bob's time is a miss's, nearer cold than warm


def test_a_key_s_priority_class_bounds_priority(stack):
    with client(stack, "pat") as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=stack.model, prompt="hi", max_tokens=1, extra_body={"priority": 0})
        assert e.value.body["param"] == "priority" and "between 5 and 10 for this API key" in e.value.body["message"]
        assert c.completions.create(model=stack.model, prompt="hi", max_tokens=1,
                                    extra_body={"priority": 5}).usage.completion_tokens == 1


def test_limits_answer_429_naming_the_limit_while_another_tenant_streams_on(stack):
    bob_tokens: list[float] = []

    def bob_stream():
        with client(stack, "bob") as c:
            for chunk in c.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=60,
                                              temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    bob_tokens.append(time.perf_counter())

    with client(stack, "quinn") as q:
        # long enough to outlast the refusals below on a fast machine (its completion counts once it ends)
        long = q.completions.with_streaming_response.create(model=stack.model, prompt="Tell me a story",
                                                            max_tokens=1000, temperature=0.0, stream=True,
                                                            extra_body={"ignore_eos": True})
        with long as held:  # quinn's one allowed request in flight
            it = held.iter_lines()
            next(it)
            bob = threading.Thread(target=bob_stream)
            bob.start()
            refusals = []
            for _ in range(5):
                r = requests.post(stack.api_url + "/completions", json={"model": stack.model, "prompt": "x",
                                                                      "max_tokens": 1},
                                  headers={"Authorization": f"Bearer {KEYS['quinn']}"}, timeout=30)
                refusals.append(r)
                time.sleep(0.05)
            for _ in it:
                pass
        bob.join(timeout=120)
    for r in refusals:
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "concurrent requests" in err["message"]
        assert "team-q" in err["message"]
    # bob's stream was untouched: every token, no long silence
    assert len(bob_tokens) == 60
    gaps = [b - a for a, b in zip(bob_tokens, bob_tokens[1:])]
    assert max(gaps) < 2.0, max(gaps)
    # quinn's 1000 completion tokens spent the 400 tokens a minute: the next request is refused for it
    with client(stack, "quinn") as q:
        hit = None
        for _ in range(6):
            try:
                q.completions.create(model=stack.model, prompt="Tell me a story", max_tokens=100,
                                     extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                hit = e
                break
        assert hit is not None, "tokens per minute never refused"
        assert "tokens per minute" in hit.body["message"] and int(hit.response.headers["Retry-After"]) >= 1


def test_usage_and_metrics_per_key_and_tenant(stack):
    p = prompt_of("usage", 200)
    cached(stack, "carol", p)
    cached(stack, "carol", p)
    with client(stack, "carol") as c:
        usage = c.get("/usage", cast_to=object)
    assert usage["key"] == "carol" and usage["tenant"] == "team-c"
    assert usage["requests"] >= 2 and usage["cached_tokens"] >= 128 and usage["prompt_tokens"] >= 400
    assert usage["this_gateway"]["tenant"]["limits"]["tokens_per_minute"] is None
    with client(stack, "quinn") as c:
        mine = c.get("/usage", cast_to=object)
    assert mine["key"] == "quinn" and mine["this_gateway"]["tenant"]["limits"]["max_concurrent_requests"] == 1
    text = requests.get(stack.base_url + "/metrics", timeout=10).text
    m = re.search(r'^phaseserve_tenant_cached_tokens_total\{tenant="team-c"\} ([0-9.e+]+)$', text, re.M)
    assert m and float(m.group(1)) >= 128
    assert re.search(r'^phaseserve_tenant_requests_total\{tenant="team-c"\} [1-9]', text, re.M)
    assert 'phaseserve_tenant_queue_time_seconds_count{tenant="team-c"}' in text
    doc = requests.get(stack.base_url + "/openapi.json", timeout=10).json()
    assert "/v1/usage" in doc["paths"]
    assert "cache_salt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for secret in KEYS.values():  # no key in the logs, in clear
        assert secret not in stack.logs()


def test_the_keys_file_is_reloaded_without_a_restart(stack):
    with client(stack, "newbie") as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    stack.keys_path.write_text(yaml.safe_dump(keys_file(with_newbie=True)))
    deadline = time.monotonic() + 10
    while True:
        try:
            with client(stack, "newbie") as c:
                c.models.list()
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.2)
    with client(stack, "alice2") as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()  # removed from the file
    stack.keys_path.write_text("tenants: [broken")  # a bad edit: the keys before it stay
    time.sleep(1.0)
    with client(stack, "newbie") as c:
        assert c.models.list().data
    assert "api keys file not reloaded" in stack.logs()


def test_a_high_priority_request_overtakes_a_full_queue_of_low_ones(e2e_model, tmp_path):
    """Two sequence slots held by long streams, a queue of low-priority streams behind them, then one
    high-priority request of the same tenant. The first slot is freed on purpose (its client goes away):
    the high request takes it, and its first token comes before any of the low ones queued ahead of it
    starts (the policy's own test says: within one scheduling round of a slot freeing,
    tests/test_fair_share.py). Freeing the slot by hand, not by a stream's end, keeps the race out: a
    short stream can end before the high request reaches the scheduler."""
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_file()))
    with running_stack(e2e_model, tmp_path, api_keys_file=str(path), max_num_seqs=2, resume_grace=0.1) as stack:
        first_token: dict[str, float] = {}
        release = {name: threading.Event() for name in ("holder0", "holder1")}

        def stream(name: str, priority: int, tokens: int) -> None:
            with client(stack, "alice") as c:
                chunks = c.completions.create(model=stack.model, prompt=f"Story {name}:", max_tokens=tokens,
                                              temperature=0.0, stream=True,
                                              extra_body={"ignore_eos": True, "priority": priority})
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].text:
                        first_token.setdefault(name, time.perf_counter())
                    if name in release and release[name].is_set():
                        chunks.close()  # the client goes away: its slot frees after the resume grace
                        return

        def started(names, timeout: float = 60.0) -> None:
            deadline = time.monotonic() + timeout
            while not set(names) <= set(first_token):
                assert time.monotonic() < deadline, (names, first_token)
                time.sleep(0.02)

        holders = [threading.Thread(target=stream, args=(name, 10, 1900)) for name in release]
        for t in holders:
            t.start()
        started(release)
        waiting = {f"low{i}" for i in range(6)}
        lows = [threading.Thread(target=stream, args=(name, 10, 8)) for name in sorted(waiting)]
        for t in lows:
            t.start()
        time.sleep(0.3)  # the low ones are queued behind the two slots
        high = threading.Thread(target=stream, args=("high", 0, 4))
        high.start()
        time.sleep(0.3)  # the high one is queued too
        assert not waiting & set(first_token) and "high" not in first_token, first_token
        freed = time.perf_counter()
        release["holder0"].set()
        high.join(timeout=120)
        release["holder1"].set()
        for t in lows + holders:
            t.join(timeout=300)
        assert "high" in first_token and waiting <= set(first_token), first_token
        assert all(first_token["high"] < first_token[name] for name in waiting), (
            first_token["high"] - freed, sorted(first_token[n] - freed for n in waiting))