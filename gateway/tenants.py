"""API keys as tenants: the keys file (`--api-keys-file`, YAML or JSON), what each key may do, reloaded when
the file changes. docs/tenants.md describes the file; this module reads it.

A key is kept only as its SHA-256 digest: the file may hold a key in clear (`key:`) or its digest
(`sha256:`), and neither a clear key nor its digest is ever logged. The file's shape is a pydantic schema. A request's key is looked up by its
digest, so the time taken says nothing about how much of any key matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, field
from typing import Annotated

import structlog
import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SecretStr, StrictInt, ValidationError,
                      model_validator)

log = structlog.get_logger("gateway.tenants")

DEFAULT_TENANT = ""  # requests of keys given by --api-key / --api-key-file, or of an open server


class KeysFileError(ValueError):
    """A keys file that cannot be used as it is (the message says where)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Count = Annotated[StrictInt, Field(ge=1)]
Priority = tuple[StrictInt, StrictInt]  # [lowest, highest] `priority` a key may send


class Limits(_Strict):
    """A tenant's (or a key's own) limits; None: none."""

    max_concurrent_requests: Count | None = None
    tokens_per_minute: Count | None = None
    max_queued_prompt_tokens: Count | None = None

    def as_dict(self) -> dict:
        return self.model_dump()


def _ordered(priority: Priority | None) -> Priority | None:
    if priority is not None and priority[0] > priority[1]:
        raise ValueError("must be [lowest, highest] with lowest <= highest")
    return priority


class TenantSpec(_Strict):
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    priority: Annotated[Priority | None, AfterValidator(_ordered)] = None
    limits: Limits = Limits()
    share_prefix_cache_with: Annotated[str, Field(min_length=1)] | None = None


class KeySpec(_Strict):
    name: Annotated[str, Field(min_length=1, description="names the key in usage and metrics; not secret")]
    key: SecretStr | None = None  # in clear (SecretStr: never in a repr or an error message)
    sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")] | None = None
    tenant: str
    limits: Limits = Limits()
    priority: Annotated[Priority | None, AfterValidator(_ordered)] = None

    @model_validator(mode="after")
    def _one_key(self) -> "KeySpec":
        if (self.key is None) == (self.sha256 is None):
            raise ValueError("needs exactly one of `key` (the key) and `sha256` (its hex digest)")
        if self.key is not None and not self.key.get_secret_value().strip():
            raise ValueError("`key` is empty")
        return self

    @property
    def digest(self) -> bytes:
        return digest(self.key.get_secret_value().strip()) if self.key is not None else bytes.fromhex(self.sha256)


class KeysFileSpec(_Strict):
    tenants: dict[Annotated[str, Field(min_length=1)], TenantSpec | None]
    keys: Annotated[list[KeySpec], Field(min_length=1)]


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: tuple[int, int] | None = None  # the `priority` values its keys may claim (None: the server's range)
    limits: Limits = field(default_factory=Limits)
    cache_scope: str = ""  # the scope its prefix blocks are named in: its name, or its share group's


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


def _errors(e: ValidationError) -> str:
    """The schema's complaints, where and what, never the values (a key must not reach a log)."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'the file'}: {err['msg']}" for err in e.errors())


def parse_keys_file(text: str) -> dict[bytes, ApiKey]:
    """The keys of a keys file's text (YAML, which JSON also is), by digest. The shape is checked by the
    schema above (pydantic); what spans entries (a key's tenant, names and keys used once, a key's priority
    range within its tenant's) here."""
    try:
        doc = KeysFileSpec.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as e:  # where and what only: PyYAML's own message quotes the line, a key perhaps
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise KeysFileError(f"not YAML or JSON{at}: {getattr(e, 'problem', None) or 'unreadable'}") from None
    except ValidationError as e:
        raise KeysFileError(_errors(e)) from None
    tenants: dict[str, Tenant] = {}
    for name, spec in doc.tenants.items():
        spec = spec or TenantSpec()
        # a group's scope cannot be a tenant's own name: a tenant outside the group would share with it
        group = spec.share_prefix_cache_with
        tenants[name] = Tenant(name, spec.weight, spec.priority, spec.limits,
                               f"group:{group}" if group else f"tenant:{name}")
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for i, spec in enumerate(doc.keys):
        where = f"keys.{i} ({spec.name})"
        if spec.name in names:
            raise KeysFileError(f"{where}: the name is used twice")
        names.add(spec.name)
        tenant = tenants.get(spec.tenant)
        if tenant is None:
            raise KeysFileError(f"{where}: tenant must name one of `tenants` ({sorted(tenants)}), "
                                f"got {spec.tenant!r}")
        d = spec.digest
        if d in keys:
            raise KeysFileError(f"{where}: the same key as {keys[d].name!r}")
        lo, hi = tenant.priority or (spec.priority or (0, 0))
        if spec.priority and not (lo <= spec.priority[0] and spec.priority[1] <= hi):
            raise KeysFileError(f"{where}: priority must lie within its tenant's {[lo, hi]}")
        keys[d] = ApiKey(spec.name, tenant, spec.limits, spec.priority)
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

