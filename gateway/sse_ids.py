"""SSE event ids, which let a client resume its stream (Last-Event-ID) on this or another gateway.

An id is `<request_id>:<offset>` (n = 1) or `<request_id>:<o0>.<o1>...` (one per choice). A choice's
offset is the number of its output tokens the gateway had consumed when it sent the event, plus one
once the choice has finished (so a finish that came in an event of its own is not sent twice). A
resuming gateway replays those tokens through a fresh detokenizer and stop-string matcher without
output: the text they made was sent, and text they left held back (an incomplete character, a
possible stop string) is held again, so it comes out once, with the tokens that follow.
"""

from __future__ import annotations

import re

from gateway.errors import bad_request

_REQUEST_ID = re.compile(r"[0-9a-f]{32}")  # error_middleware's uuid4().hex


def event_id(request_id: str, offsets: list[int]) -> str:
    return f"{request_id}:{'.'.join(map(str, offsets))}"


def parse_last_event_id(header: str, n: int) -> tuple[str, list[int]]:
    """-> (request id, per-choice offsets); a malformed header is a 400 naming it."""
    request_id, _, rest = header.strip().partition(":")
    parts = rest.split(".") if rest else []
    if not _REQUEST_ID.fullmatch(request_id) or len(parts) != n or not all(p.isdigit() and len(p) < 10 for p in parts):
        raise bad_request(f"Malformed Last-Event-ID header {header[:100]!r}: expected the `id` of an event of this "
                          f"request's stream (`<request id>:<offset>`, one offset per choice; n = {n}).")
    return request_id, [int(p) for p in parts]
