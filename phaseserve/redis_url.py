"""What a --redis-url names: one Redis, a Sentinel-watched primary, or a Redis Cluster. Parsing only, no I/O
(phaseserve/redis_client.py makes the clients), so settings can refuse a bad URL before anything starts.

Forms (docs/redis.md):
- `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`, `rediss://...` (TLS), `unix://...`: one server, as redis-py
  reads them.
- `redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB][?sentinel_password=...
  &sentinel_username=...]`: the sentinels (port 26379 by default) and the name of the primary they watch.
  The user and password are the data nodes' (the primary's and its replicas'); sentinels often have none,
  or a password of their own, so theirs is a separate parameter.
- `redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...][/0]`: seed nodes of a Redis Cluster (port
  6379 by default); a cluster has only database 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit, urlunsplit

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
SENTINEL_PORT = 26379
REDIS_PORT = 6379
SENTINEL_PARAMS = ("sentinel_password", "sentinel_username")
_HASH_TAG = re.compile(r"\{[^{}]+\}")


class RedisUrlError(ValueError):
    """A --redis-url that names nothing this server can use, with what is wrong."""


@dataclass(frozen=True)
class RedisTarget:
    kind: str  # "single", "sentinel" or "cluster"
    url: str
    nodes: tuple[tuple[str, int], ...] = ()  # the sentinels, or the cluster's seed nodes
    service: str | None = None  # the Sentinel name of the primary
    db: int = 0
    username: str | None = None  # of the data nodes
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def _node(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [v6::addr]:port
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise RedisUrlError(f"a host is empty in {text!r}")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise RedisUrlError(f"not a port: {port!r}") from None


def _db(text: str) -> int:
    if not text.isdigit():
        raise RedisUrlError(f"the database must be a number, got {text!r}")
    return int(text)


def parse(url: str) -> RedisTarget:
    """The target of a --redis-url; RedisUrlError says what is wrong with one it cannot use."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in (SENTINEL_SCHEME, CLUSTER_SCHEME):
        if "+" in scheme:  # rediss+sentinel, a typo: refused here, not by the first connect
            raise RedisUrlError(f"unknown scheme {scheme}:// (known: redis, rediss, unix, {SENTINEL_SCHEME}, "
                                f"{CLUSTER_SCHEME}; TLS to sentinels or cluster nodes is not supported yet)")
        return RedisTarget("single", url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    default_port = SENTINEL_PORT if scheme == SENTINEL_SCHEME else REDIS_PORT
    nodes = tuple(_node(h, default_port) for h in hosts.split(",") if h)
    if not nodes:
        raise RedisUrlError(f"{scheme}:// needs at least one host:port")
    query = parse_qs(parts.query, keep_blank_values=True)
    path = [p for p in parts.path.split("/") if p]
    common = dict(nodes=nodes, username=unquote(username) or None, password=unquote(password) or None)
    if scheme == CLUSTER_SCHEME:
        if query:
            raise RedisUrlError(f"{scheme}:// takes no parameters, got {', '.join(query)}")
        if len(path) > 1 or (path and _db(path[0]) != 0):
            raise RedisUrlError(f"a Redis Cluster has database 0 only, got {parts.path!r}")
        return RedisTarget("cluster", url, **common)
    unknown = set(query) - set(SENTINEL_PARAMS)
    if unknown:
        raise RedisUrlError(f"unknown {scheme}:// parameters: {', '.join(sorted(unknown))} "
                            f"(known: {', '.join(SENTINEL_PARAMS)})")
    if not path or len(path) > 2:
        raise RedisUrlError(f"{scheme}:// needs the primary's name: {scheme}://HOST:PORT[,HOST:PORT...]/NAME[/DB]")
    return RedisTarget("sentinel", url, service=unquote(path[0]), db=_db(path[1]) if len(path) > 1 else 0,
                       sentinel_username=query.get("sentinel_username", [None])[0] or None,
                       sentinel_password=query.get("sentinel_password", [None])[0] or None, **common)


def redacted(url: str | None) -> str | None:
    """A Redis URL fit for a log line or a banner: its passwords (the data nodes' and the sentinels') as ***."""
    if not url:
        return url
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    query = parse_qs(parts.query, keep_blank_values=True)
    if "sentinel_password" in query:
        query["sentinel_password"] = ["***"]
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{hosts}", query=urlencode(query, doseq=True, safe="*")))


def with_password(url: str, password: str) -> str:
    """`url` with the data nodes' password replaced (its user kept)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hosts}"))


def key_prefix_for(url: str | None, prefix: str) -> str:
    """The key prefix a stack uses on this Redis: on a cluster, every key and channel of one stack must hash to
    one slot (its multi-key commands, scripts and pipelines span them), so a prefix without a hash tag
    becomes one (`ps` -> `{ps}`); elsewhere the prefix as given, so keys stay what they were."""
    if url and parse(url).kind == "cluster" and not _HASH_TAG.search(prefix):
        return "{" + prefix + "}"
    return prefix


def wait_replicas(url: str | None, setting: int | None) -> int:
    """Replicas a gateway's submit WAITs for: the setting when given, else 1 behind Sentinel (a primary
    that fails over has a replica to fail over to) and 0 elsewhere, so a single Redis pays nothing."""
    if setting is not None:
        return max(0, setting)
    return 1 if url and parse(url).kind == "sentinel" else 0
