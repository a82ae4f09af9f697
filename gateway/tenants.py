"""API keys as tenants: the keys file (`--api-keys-file`, YAML or JSON), what each key may do, reloaded when
the file changes. docs/tenants.md describes the file; this module reads it.

A key is kept only as its SHA-256 digest: the file may hold a key in clear (`key:`) or its digest
(`sha256:`), and neither a clear key nor its digest is ever logged. A request's key is looked up by its
digest, so the time taken says nothing about how much of any key matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from dataclasses import dataclass, field

import structlog
import yaml

log = structlog.get_logger("gateway.tenants")

DEFAULT_TENANT = ""  # requests of keys given by --api-key / --api-key-file, or of an open server


class KeysFileError(ValueError):
    """A keys file that cannot be used as it is (the message says where)."""


@dataclass(frozen=True)
class Limits:
    """A tenant's (or a key's own) limits; None: none."""

    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    max_queued_prompt_tokens: int | None = None

    FIELDS = ("max_concurrent_requests", "tokens_per_minute", "max_queued_prompt_tokens")

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: tuple[int, int] | None = None  # the `priority` values its keys may claim (None: the server's range)
    limits: Limits = field(default_factory=Limits)
    cache_scope: str = ""  # the scope its prefix blocks are named in: its name, or its share group's

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_TENANT


@dataclass(frozen=True)
class ApiKey:
    """One key as the gateway knows it: a name (for usage and metrics; not secret), its tenant, its own limits
    (besides its tenant's) and priority range (narrowing its tenant's)."""

    name: str
    tenant: Tenant
    limits: Limits = field(default_factory=Limits)
    priority: tuple[int, int] | None = None

    @property
    def priority_range(self) -> tuple[int, int] | None:
        return self.priority or self.tenant.priority


DEFAULT = Tenant(DEFAULT_TENANT)
ANONYMOUS = ApiKey("anonymous", DEFAULT)  # the caller on a server without keys


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _int_or_none(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeysFileError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _limits(raw, where: str) -> Limits:
    if raw is None:
        return Limits()
    if not isinstance(raw, dict):
        raise KeysFileError(f"{where}.limits must be a mapping")
    unknown = set(raw) - set(Limits.FIELDS)
    if unknown:
        raise KeysFileError(f"{where}.limits: unknown {sorted(unknown)} (known: {list(Limits.FIELDS)})")
    return Limits(**{f: _int_or_none(raw.get(f), f"{where}.limits.{f}") for f in Limits.FIELDS})


def _priority(raw, where: str) -> tuple[int, int] | None:
    if raw is None:
        return None
    if (not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in raw) or raw[0] > raw[1]):
        raise KeysFileError(f"{where}.priority must be [lowest, highest] (integers, lowest <= highest), got {raw!r}")
    return raw[0], raw[1]


def _check_keys(raw: dict, known: set[str], where: str) -> None:
    unknown = set(raw) - known
    if unknown:
        raise KeysFileError(f"{where}: unknown {sorted(unknown)} (known: {sorted(known)})")


def parse_keys_file(text: str) -> dict[bytes, ApiKey]:
    """The keys of a keys file's text (YAML, which JSON also is), by digest."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KeysFileError(f"not YAML or JSON: {e}") from None
    if not isinstance(doc, dict):
        raise KeysFileError("the file must be a mapping with `tenants` and `keys`")
    _check_keys(doc, {"tenants", "keys"}, "the file")
    tenants: dict[str, Tenant] = {}
    for name, raw in (doc.get("tenants") or {}).items():
        where = f"tenants.{name}"
        if not isinstance(name, str) or not name:
            raise KeysFileError("a tenant's name must be a non-empty string")
        raw = raw or {}
        if not isinstance(raw, dict):
            raise KeysFileError(f"{where} must be a mapping")
        _check_keys(raw, {"weight", "priority", "limits", "share_prefix_cache_with"}, where)
        weight = raw.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise KeysFileError(f"{where}.weight must be a number > 0, got {weight!r}")
        group = raw.get("share_prefix_cache_with")
        if group is not None and (not isinstance(group, str) or not group):
            raise KeysFileError(f"{where}.share_prefix_cache_with must be a group name (a string)")
        # a group's scope cannot be a tenant's own name: a tenant outside the group would share with it
        scope = f"group:{group}" if group else f"tenant:{name}"
        tenants[name] = Tenant(name, float(weight), _priority(raw.get("priority"), where),
                               _limits(raw.get("limits"), where), scope)
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for i, raw in enumerate(doc.get("keys") or []):
        where = f"keys[{i}]"
        if not isinstance(raw, dict):
            raise KeysFileError(f"{where} must be a mapping")
        _check_keys(raw, {"name", "key", "sha256", "tenant", "limits", "priority"}, where)
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise KeysFileError(f"{where}.name must be a non-empty string (it names the key in usage and metrics)")
        if name in names:
            raise KeysFileError(f"{where}: the name {name!r} is used twice")
        names.add(name)
        if ("key" in raw) == ("sha256" in raw):
            raise KeysFileError(f"{where} ({name}) needs exactly one of `key` (the key) and `sha256` (its hex digest)")
        if "key" in raw:
            if not isinstance(raw["key"], str) or not raw["key"].strip():
                raise KeysFileError(f"{where} ({name}).key must be a non-empty string")
            d = digest(raw["key"].strip())
        else:
            try:
                d = bytes.fromhex(str(raw["sha256"]))
            except ValueError:
                d = b""
            if len(d) != 32:
                raise KeysFileError(f"{where} ({name}).sha256 must be 64 hex digits")
        tenant_name = raw.get("tenant")
        if tenant_name not in tenants:
            raise KeysFileError(f"{where} ({name}).tenant must name one of `tenants` ({sorted(tenants)}), "
                                f"got {tenant_name!r}")
        if d in keys:
            raise KeysFileError(f"{where} ({name}): the same key as {keys[d].name!r}")
        tenant = tenants[tenant_name]
        priority = _priority(raw.get("priority"), where)
        lo, hi = tenant.priority or (priority or (0, 0))
        if priority and not (lo <= priority[0] and priority[1] <= hi):
            raise KeysFileError(f"{where} ({name}).priority must lie within its tenant's {list(tenant.priority)}")
        keys[d] = ApiKey(name, tenant, _limits(raw.get("limits"), where), priority)
    if not keys:
        raise KeysFileError("the file names no key")
    return keys


class KeyDirectory:
    """Every key the gateway accepts, by digest: the keys file's (reloaded when it changes) and the plain
    `--api-key` / `--api-key-file` keys (the default tenant: no weight, limits or priority class of its own)."""

    def __init__(self, plain_keys: list[bytes], keys_file: str | None = None):
        self._plain = {digest(k): ApiKey(f"key-{i + 1}", DEFAULT) for i, k in enumerate(plain_keys)}
        self.path = keys_file
        self._from_file: dict[bytes, ApiKey] = {}
        self._stamp: tuple[float, int] | None = None
        if keys_file:
            try:
                self.reload()
            except (OSError, KeysFileError) as e:
                raise SystemExit(f"phaseserve gateway: --api-keys-file {keys_file}: {e}") from None

    @property
    def required(self) -> bool:
        """Whether a request needs a key at all."""
        return bool(self._plain) or self.path is not None

    def __len__(self) -> int:
        return len(self._plain) + len(self._from_file)

    def lookup(self, given: bytes) -> ApiKey | None:
        d = digest(given)
        return self._from_file.get(d) or self._plain.get(d)

    def reload(self) -> bool:
        """Read the keys file again if it changed (mtime or size); True if the keys changed. A file that does
        not parse raises and leaves the keys as they were."""
        st = os.stat(self.path)
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a broken version is reported once, not at every look
        with open(self.path, encoding="utf-8") as f:
            keys = parse_keys_file(f.read())
        self._from_file = keys
        return True

    async def watch(self, interval_s: float) -> None:
        """Reload the keys file every `interval_s` when it changed; a broken edit is logged and ignored (the
        keys before it stay), so a typo never locks every client out."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if self.reload():
                    log.info("api keys reloaded", keys=len(self._from_file),
                             tenants=len({k.tenant.name for k in self._from_file.values()}))
            except (OSError, KeysFileError) as e:
                log.warning("api keys file not reloaded: the keys before it stay", path=self.path, error=str(e))

