"""--redis-url's forms (one server, Sentinel, cluster): what each names, the errors for what is wrong, the
passwords hidden in logs, and the key prefix a cluster gets (a hash tag) while other users' keys stay as
they were."""

from __future__ import annotations

import pytest

from phaseserve import settings
from phaseserve.redis_url import RedisUrlError, key_prefix_for, parse, redacted, wait_replicas
from phaseserve.wire import Keys

SENTINEL = "redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/2?sentinel_password=sp%40ss"
CLUSTER = "redis+cluster://app:pw@node-a:7000,node-b"


def test_a_plain_url_is_one_server_left_to_redis_py():
    target = parse("rediss://:pw@example.com:6380/3")
    assert target.kind == "single" and target.url == "rediss://:pw@example.com:6380/3"


def test_a_sentinel_url_names_the_sentinels_the_primary_and_both_passwords():
    t = parse(SENTINEL)
    assert t.kind == "sentinel" and t.service == "mymaster" and t.db == 2
    assert t.nodes == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (t.username, t.password) == (None, "s3cret")  # the data nodes'
    assert (t.sentinel_username, t.sentinel_password) == (None, "sp@ss")
    assert parse("redis+sentinel://h1/mymaster").db == 0


def test_a_cluster_url_names_its_seed_nodes():
    t = parse(CLUSTER)
    assert t.kind == "cluster" and t.nodes == (("node-a", 7000), ("node-b", 6379))
    assert (t.username, t.password) == ("app", "pw")
    assert parse("redis+cluster://h:1/0").kind == "cluster"


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h1:26379", "needs the primary's name"),
    ("redis+sentinel://h1:26379/m/0/extra", "needs the primary's name"),
    ("redis+sentinel://h1:26379/m/x", "database must be a number"),
    ("redis+sentinel://h1:26379/m?password=x", "unknown redis+sentinel:// parameters: password"),
    ("redis+sentinel://h1:notaport/m", "not a port"),
    ("redis+sentinel:///m", "at least one host"),
    ("redis+cluster://h1:7000/1", "database 0 only"),
    ("redis+cluster://h1:7000?x=1", "takes no parameters"),
    ("rediss+sentinel://h1:26379/m", "unknown scheme rediss+sentinel://"),
])
def test_what_is_wrong_with_a_url_is_said(url, says):
    with pytest.raises(RedisUrlError, match=says.replace("+", r"\+").replace("?", r"\?")):
        parse(url)


def test_a_bad_url_stops_a_service_at_its_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        settings.parse("scheduler", ["--redis-url", "redis+sentinel://h1:26379"])
    assert e.value.code == 2
    assert "--redis-url: redis+sentinel:// needs the primary's name" in capsys.readouterr().err


def test_logs_show_no_password():
    shown = redacted(SENTINEL)
    assert "s3cret" not in shown and "sp%40ss" not in shown and "sp@ss" not in shown
    assert shown.startswith("redis+sentinel://:***@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/2")
    assert "sentinel_password=***" in shown
    assert redacted("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def test_a_cluster_gets_a_hash_tag_and_every_other_redis_the_keys_it_had():
    assert key_prefix_for(CLUSTER, "ps") == "{ps}"
    assert key_prefix_for(CLUSTER, "{tenant-a}:ps") == "{tenant-a}:ps"  # a tag of the user's own is kept
    assert key_prefix_for(SENTINEL, "ps") == "ps"
    assert key_prefix_for("redis://h/0", "ps") == "ps"
    assert key_prefix_for(None, "ps") == "ps"
    assert Keys(key_prefix_for("redis://h/0", "ps")).requests == "ps:requests"  # byte for byte as before
    tagged = Keys(key_prefix_for(CLUSTER, "ps"))
    assert tagged.requests == "{ps}:requests" and tagged.gateway_channel("g") == "{ps}:gw:g"
    assert settings.parse("scheduler", ["--redis-url", CLUSTER]).key_prefix == "{ps}"
    # a child started with the tagged prefix keeps it as it is
    assert settings.parse("scheduler", ["--redis-url", CLUSTER, "--key-prefix", "{ps}"]).key_prefix == "{ps}"


def test_submits_wait_for_a_replica_behind_sentinel_only_unless_told():
    assert wait_replicas(SENTINEL, None) == 1
    assert wait_replicas("redis://h/0", None) == 0 and wait_replicas(None, None) == 0
    assert wait_replicas(CLUSTER, None) == 0
    assert wait_replicas("redis://h/0", 2) == 2 and wait_replicas(SENTINEL, 0) == 0


def test_a_password_file_fills_in_a_sentinel_urls_password(tmp_path):
    path = tmp_path / "pw"
    path.write_text("n3w pass\n")
    url = settings.with_password_file("redis+sentinel://:old@h1:26379,h2:26379/m/0", str(path))
    assert url == "redis+sentinel://:n3w%20pass@h1:26379,h2:26379/m/0"
    assert parse(url).password == "n3w pass"
