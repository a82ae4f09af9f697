"""Optional bearer API keys on the /v1 routes and /tokenize, /detokenize (/health, /metrics, /version and
/openapi.json stay open).

Keys come from --api-key (comma-separated), --api-key-file (one a line) and --api-keys-file (keys as
tenants, gateway/tenants.py). A given key is looked up by its SHA-256 digest, so the time taken does
not say how much of a key matched, nor which key; the request then carries the key's entry (`CALLER`):
its name, tenant, limits and priority range.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from phaseserve.gateway.errors import invalid_api_key
from phaseserve.gateway.tenants import ANONYMOUS, ApiKey, KeyDirectory, digest

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # outside /v1 (vLLM's paths), but they run the model's tokenizer
# a digest of the key a request came with (absent when no key is needed): a stream's resume token is bound to it
CLIENT_KEY = web.RequestKey("client_key", bytes)
CALLER = web.RequestKey("caller", ApiKey)  # the key a request came with (ANONYMOUS when none is needed)


def load_api_keys(settings: argparse.Namespace) -> list[bytes]:
    """The configured keys (empty: no key needed); a missing key file is a clear exit, not a traceback."""
    keys = [k.strip() for k in (getattr(settings, "api_key", None) or "").split(",")]
    path = getattr(settings, "api_key_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                keys += [line.strip() for line in f]
        except OSError as e:
            raise SystemExit(f"phaseserve gateway: cannot read --api-key-file {path}: {e.strerror}") from None
        if not any(keys):
            raise SystemExit(f"phaseserve gateway: --api-key-file {path} holds no key")
    return [k.encode() for k in keys if k and not k.startswith("#")]


def caller(request: web.Request) -> ApiKey:
    return request.get(CALLER, ANONYMOUS)


def auth_middleware(keys: KeyDirectory):
    @web.middleware
    async def check_api_key(request: web.Request, handler):
        path = request.path
        if path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise invalid_api_key(given=False)
            given = token.strip().encode()
            entry = keys.lookup(given)
            if entry is None:
                raise invalid_api_key(given=True)
            request[CLIENT_KEY] = digest(given)
            request[CALLER] = entry
        return await handler(request)

    return check_api_key
