"""SSE event ids, which let a client resume its stream (Last-Event-ID) on this or another gateway.

Only a client that asks for them gets ids (request header `X-Resume: 1`): OpenAI's stream has none, and
clients that read every event as one `data:` line break on them. Such a client's response carries its
resume token (`X-Resume-Token`), and every event the id `<request_id>:<token>:<offset>` (n = 1) or
`<request_id>:<token>:<o0>.<o1>...` (one offset per choice). The request id is no secret (it is in the
response's `id` and `X-Request-Id`); the token is: an HMAC of the request id and the client's API key
under a secret the stack keeps in Redis, so only the client that submitted the request (with the same key,
when keys are on) can resume it, on any gateway, and nothing is stored per request.

A choice's offset is the number of its output tokens the gateway had consumed when it sent the event, plus
one once the choice has finished (so a finish that came in an event of its own is not sent twice). A
resuming gateway replays those tokens through a fresh detokenizer and stop-string matcher without output:
the text they made was sent, and text they left held back (an incomplete character, a possible stop
string) is held again, so it comes out once, with the tokens that follow.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from phaseserve.gateway.errors import bad_request

RESUME_HEADER = "X-Resume"  # request: "1" to get event ids (and the token); "0" or absent: OpenAI's stream
RESUME_TOKEN_HEADER = "X-Resume-Token"  # response: the token, for a resume before the first event
_REQUEST_ID = re.compile(r"[0-9a-f]{32}")  # error_middleware's uuid4().hex
_TOKEN = re.compile(r"[0-9a-f]{32}")


def wants_resume(header: str | None) -> bool:
    """The X-Resume request header; anything but 1/0 (true/false) is a 400 naming it."""
    value = (header or "0").strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise bad_request(f"Malformed {RESUME_HEADER} header {value[:20]!r}: expected 1 (event ids, to resume "
                          f"the stream with Last-Event-ID) or 0.")
    return value in ("1", "true")


def resume_token(stack_secret: bytes, request_id: str, client_key: bytes) -> str:
    """The secret that lets the submitting client (client_key: a digest of its API key, or b"") resume."""
    return hmac.new(stack_secret, request_id.encode() + b"\0" + client_key, hashlib.sha256).hexdigest()[:32]


def token_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def event_id(request_id: str, token: str, offsets: list[int]) -> str:
    return f"{request_id}:{token}:{'.'.join(map(str, offsets))}"


def parse_last_event_id(header: str, n: int) -> tuple[str, str, list[int]]:
    """-> (request id, resume token, per-choice offsets); a malformed header is a 400 naming it."""
    request_id, _, rest = header.strip().partition(":")
    token, _, rest = rest.partition(":")
    parts = rest.split(".") if rest else []
    if (not _REQUEST_ID.fullmatch(request_id) or not _TOKEN.fullmatch(token) or len(parts) != n
            or not all(p.isdigit() and len(p) < 10 for p in parts)):
        raise bad_request(f"Malformed Last-Event-ID header {header[:120]!r}: expected the `id` of an event of "
                          f"this request's stream (`<request id>:<resume token>:<offset>`, one offset per "
                          f"choice; n = {n}), as sent to a request with `{RESUME_HEADER}: 1`.")
    return request_id, token, [int(p) for p in parts]
