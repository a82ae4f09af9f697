"""The keys file (gateway/tenants.py) and the limits (gateway/quotas.py), without a stack: what a file means,
what it refuses, reloading it, and each limit refusing with its name."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from phaseserve.gateway.quotas import Quotas
from phaseserve.gateway.tenants import DEFAULT, KeyDirectory, KeysFileError, parse_keys_file

EXAMPLE = """
tenants:
  chat: {weight: 3, priority: [0, 5], limits: {max_concurrent_requests: 2}}
  batch:
    weight: 1
    limits: {tokens_per_minute: 100, max_queued_prompt_tokens: 50}
  support: {share_prefix_cache_with: helpdesk}
  sales: {share_prefix_cache_with: helpdesk}
keys:
  - {name: web, key: sk-web, tenant: chat, priority: [2, 5]}
  - {name: nightly, sha256: %s, tenant: batch, limits: {max_concurrent_requests: 1}}
  - {name: bot1, key: sk-sup, tenant: support}
  - {name: bot2, key: sk-sal, tenant: sales}
""" % hashlib.sha256(b"sk-nightly").hexdigest()


def lookup(keys, given: str):
    return keys[hashlib.sha256(given.encode()).digest()]


def test_a_keys_file_names_tenants_weights_priorities_limits_and_cache_scopes():
    keys = parse_keys_file(EXAMPLE)
    web, nightly = lookup(keys, "sk-web"), lookup(keys, "sk-nightly")
    assert (web.name, web.tenant.name, web.tenant.weight, web.priority_range) == ("web", "chat", 3.0, (2, 5))
    assert nightly.priority_range is None and nightly.tenant.limits.tokens_per_minute == 100
    assert nightly.limits.max_concurrent_requests == 1
    # grouped tenants share a scope; others have their own, which no group name can collide with
    assert lookup(keys, "sk-sup").tenant.cache_scope == lookup(keys, "sk-sal").tenant.cache_scope == "group:helpdesk"
    assert web.tenant.cache_scope == "tenant:chat"
    assert "sk-web" not in repr(keys)  # digests only
    assert parse_keys_file(json.dumps({"tenants": {"t": {}}, "keys": [{"name": "k", "key": "x", "tenant": "t"}]}))


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "the file: Input should be a valid dictionary"),
    ("tenants: {t: {}}\nkeys: []", "keys: List should have at least 1 item"),
    ("tenants: {t: {weight: 0}}\nkeys: [{name: k, key: x, tenant: t}]", "tenants.t.weight: Input should be greater"),
    ("tenants: {t: {colour: red}}\nkeys: [{name: k, key: x, tenant: t}]", "tenants.t.colour: Extra inputs"),
    ("tenants: {t: {}}\nkeys: [{name: k, key: x, tenant: u}]", "tenant must name one of"),
    ("tenants: {t: {}}\nkeys: [{name: k, tenant: t}]", "exactly one of `key`"),
    ("tenants: {t: {}}\nkeys: [{name: k, sha256: abc, tenant: t}]", "keys.0.sha256: String should match"),
    ("tenants: {t: {}}\nkeys: [{name: k, key: x, tenant: t}, {name: k, key: y, tenant: t}]", "used twice"),
    ("tenants: {t: {}}\nkeys: [{name: k, key: x, tenant: t}, {name: j, key: x, tenant: t}]", "same key"),
    ("tenants: {t: {priority: [0, 5]}}\nkeys: [{name: k, key: x, tenant: t, priority: [0, 9]}]", "within its tenant"),
    ("tenants: {t: {priority: [5, 1]}}\nkeys: [{name: k, key: x, tenant: t}]", "lowest <= highest"),
    ("tenants: {t: {limits: {tokens_per_minute: -1}}}\nkeys: [{name: k, key: x, tenant: t}]",
     "tokens_per_minute: Input should be greater than or equal to 1"),
    ("tenants: [broken", "not YAML"),
])
def test_a_bad_keys_file_is_refused_naming_what_is_wrong(text, says):
    with pytest.raises(KeysFileError) as e:
        parse_keys_file(text)
    assert says in str(e.value)


def test_a_refusal_never_repeats_a_key():
    with pytest.raises(KeysFileError) as e:
        parse_keys_file("tenants: {t: {}}\nkeys: [{name: k, key: 987654321, tenant: t}]")
    assert "keys.0.key" in str(e.value) and "987654321" not in str(e.value)
    with pytest.raises(KeysFileError) as e:  # nor does a YAML error quote the line
        parse_keys_file("tenants: {t: {}}\nkeys: [{name: k, key: sk-secret-77: x, tenant: t}]")
    assert "line 2" in str(e.value) and "sk-secret-77" not in str(e.value)


def test_the_directory_reloads_a_changed_file_and_keeps_its_keys_over_a_broken_one(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {t: {}}\nkeys: [{name: k, key: sk-1, tenant: t}]\n")
    keys = KeyDirectory([b"sk-plain"], str(path))
    assert keys.lookup(b"sk-1").tenant.name == "t"
    assert keys.lookup(b"sk-plain").tenant is DEFAULT and keys.lookup(b"sk-2") is None
    assert not keys.reload()  # unchanged
    path.write_text("tenants: {t: {}}\nkeys: [{name: k, key: sk-2, tenant: t}]\n")
    os.utime(path, (1, 1))  # a new mtime even within the file system's time resolution
    assert keys.reload()
    assert keys.lookup(b"sk-2") is not None and keys.lookup(b"sk-1") is None
    path.write_text("tenants: {t: {}}\nkeys: []\n")
    os.utime(path, (2, 2))
    with pytest.raises(KeysFileError):
        keys.reload()
    assert keys.lookup(b"sk-2") is not None
    with pytest.raises(SystemExit, match="keys: List should have at least 1 item"):
        KeyDirectory([], str(path))


def test_each_limit_refuses_with_its_name_and_a_retry_after():
    keys = parse_keys_file(EXAMPLE)
    web, nightly = lookup(keys, "sk-web"), lookup(keys, "sk-nightly")
    q = Quotas(retry_after_s=2)
    q.acquire(web, 10)
    assert q.refusal(web, 10) is None
    q.acquire(web, 10)
    r = q.refusal(web, 10)
    assert r.limit == "concurrency" and "tenant chat on concurrent requests: limit 2" in r.message
    assert r.retry_after == 2
    q.release(web, 5)
    assert q.refusal(web, 10) is None
    # the key's own limit (1) before its tenant's (none)
    q.acquire(nightly, 40)
    assert "key nightly on concurrent requests" in q.refusal(nightly, 5).message
    q.release(nightly, 0)
    q = Quotas()
    q.acquire(nightly, 40)
    q.release(nightly, 50)  # 40 prompt + 50 completion tokens spent of 100 a minute
    r = q.refusal(nightly, 20)
    assert r.limit == "tokens_per_minute" and "tenant batch on tokens per minute: limit 100, used 90, requested 20" \
        in r.message
    assert 1 <= r.retry_after <= 60
    assert q.refusal(nightly, 10) is None
    q.acquire(nightly, 5)
    q.release(nightly, 500)  # a completion past the limit fills the minute
    assert q.current(nightly)["tenant"]["tokens_last_minute"] == 100


def test_queued_prompt_tokens_limit():
    keys = parse_keys_file("tenants: {t: {limits: {max_queued_prompt_tokens: 50}}}\n"
                           "keys: [{name: k, key: x, tenant: t}]")
    k = lookup(keys, "x")
    q = Quotas()
    assert q.refusal(k, 500) is None  # alone: let through, as the gateway-wide bound does
    q.acquire(k, 30)
    r = q.refusal(k, 30)
    assert r.limit == "queued_prompt_tokens" and "limit 50, queued 30, requested 30" in r.message
    q.dequeue(k, 30)  # its first token came
    assert q.refusal(k, 30) is None
