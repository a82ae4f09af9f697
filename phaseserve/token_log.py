"""The durable token log: every TokenEvent of a sequence in a capped, expiring Redis stream of its own.

Pub/sub stays the fast push from the worker to the gateway, but it drops messages (a resubscribe, a full
output buffer, a gateway that is gone). So the worker's relay, in the same pipeline and just before it
PUBLISHes a step's TokenBatch, XADDs each event to `Keys.token_log(seq_id)`. A gateway that sees a gap or
a silence, or that resumes a client of another gateway (SSE Last-Event-ID), XREADs it from the offset
it has.

Entry ids are `<offset after the event>-0` (`-1` for an event without tokens: a finish or an error), so
a gateway reads "everything after offset k" as XREAD from `k-0`, and Redis itself refuses a second entry
for the same offset (a step replayed after a worker died): the first writer wins, duplicates never
reach the log. A gateway that cancels a sequence appends an `abort` event with an automatic id, after
which no worker entry is accepted.
"""

from __future__ import annotations

import msgpack
import redis.exceptions
import structlog

from phaseserve.wire import FIELD, FIELD_BYTES, TOKEN_LOG_MAXLEN, TOKEN_LOG_TTL_S, Keys, TokenEvent

log = structlog.get_logger(__name__)

# the TTL is refreshed on the first event, every REFRESH_EVERY tokens and on the last one
REFRESH_EVERY = 32
_DUPLICATE_ID = "equal or smaller than the target stream top item"


def entry_id(offset: int, num_tokens: int) -> str:
    return f"{offset + num_tokens}-{0 if num_tokens else 1}"


def read_from(offset: int) -> str:
    """The XREAD id that returns every entry holding tokens at or after `offset`, and a finish at it."""
    return f"{offset}-0"


def append_event(pipe, keys: Keys, ev: list) -> None:
    """Queue one event (TokenEvent.to_list() form) on a pipeline: XADD with its offset id, EXPIRE when due."""
    seq_id, offset, token_ids, finish = ev[0], ev[1], ev[2], ev[3]
    error = ev[5] if len(ev) > 5 else None
    key = keys.token_log(seq_id)
    end = offset + len(token_ids)
    # execute_command, not pipe.xadd: its argument handling was a third of the relay's cost per event
    pipe.execute_command("XADD", key, "MAXLEN", "~", TOKEN_LOG_MAXLEN, f"{end}-{0 if token_ids else 1}",
                         FIELD, msgpack.packb(ev, use_bin_type=True))
    if offset == 0 or finish is not None or error is not None or offset // REFRESH_EVERY != end // REFRESH_EVERY:
        pipe.execute_command("EXPIRE", key, TOKEN_LOG_TTL_S)


# One command for a whole step's events: redis-py's packing and reply parsing cost the relay per command,
# so an XADD (+ EXPIRE) per sequence added up in a step's pipeline where one script does not
# (bench/token_log_cost.py measures both, on the relay's process, off the model's).
# KEYS: the logs; ARGV: maxlen, ttl, then per key: entry id, payload, refresh the TTL (1/0).
_APPEND_SCRIPT = """
for i, key in ipairs(KEYS) do
  local a = 2 + (i - 1) * 3
  redis.pcall('XADD', key, 'MAXLEN', '~', ARGV[1], ARGV[a + 1], '%s', ARGV[a + 2])
  if ARGV[a + 3] == '1' then redis.call('EXPIRE', key, ARGV[2]) end
end
return #KEYS
""" % FIELD


def append_batch(pipe, keys: Keys, token_batch: bytes) -> None:
    """Every event of a TokenBatch (as the relay has it: wire bytes) onto the pipeline, as one EVAL (an entry
    for an offset the log already has is refused inside the script). EVAL, not EVALSHA: redis-py's pipeline
    would check SCRIPT EXISTS in an extra round trip every time, and EVAL never meets NOSCRIPT after a
    Redis restart; Redis caches the compiled script by its hash either way."""
    events = msgpack.unpackb(token_batch, raw=False)["events"]
    log_keys, args = [], [TOKEN_LOG_MAXLEN, TOKEN_LOG_TTL_S]
    for ev in events:
        offset, token_ids, finish = ev[1], ev[2], ev[3]
        error = ev[5] if len(ev) > 5 else None
        end = offset + len(token_ids)
        refresh = offset == 0 or finish is not None or error is not None or \
            offset // REFRESH_EVERY != end // REFRESH_EVERY
        log_keys.append(keys.token_log(ev[0]))
        args += [f"{end}-{0 if token_ids else 1}", msgpack.packb(ev, use_bin_type=True), 1 if refresh else 0]
    if log_keys:
        pipe.execute_command("EVAL", _APPEND_SCRIPT, len(log_keys), *log_keys, *args)


def append_abort(pipe, keys: Keys, seq_id: str, offset: int, reason: str = "abort") -> None:
    """A gateway ended the sequence: an auto id (now, in ms) is above every offset, so nothing follows it."""
    key = keys.token_log(seq_id)
    ev = TokenEvent(seq_id, offset, [], reason).to_list()
    pipe.xadd(key, {FIELD: msgpack.packb(ev, use_bin_type=True)}, maxlen=TOKEN_LOG_MAXLEN, approximate=True)
    pipe.expire(key, TOKEN_LOG_TTL_S)


def is_duplicate(result) -> bool:
    """A pipeline result that is Redis refusing an entry for an offset the log already has."""
    return isinstance(result, redis.exceptions.ResponseError) and _DUPLICATE_ID in str(result)


def raise_unexpected(results: list) -> None:
    """After `pipe.execute(raise_on_error=False)`: raise the first error that is not a refused duplicate."""
    for r in results:
        if isinstance(r, Exception) and not is_duplicate(r):
            raise r


def decode_entry(fields: dict) -> TokenEvent:
    raw = fields.get(FIELD_BYTES, fields.get(FIELD))
    return TokenEvent.from_list(msgpack.unpackb(raw, raw=False))


def replay(entries: list) -> tuple[list[int], bool]:
    """A sequence's log (XRANGE entries, in order) as a recovering scheduler reads it: the tokens contiguous
    from offset 0 (what its client may already have, so a sampled sequence continues where the client is),
    and whether the log holds its end (a finish, an error, an abort). An unreadable entry is skipped."""
    tokens: list[int] = []
    ended = False
    for _entry_id, fields in entries:
        try:
            ev = decode_entry(fields)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("unreadable token log entry", error=str(e))
            continue
        if ev.offset <= len(tokens):  # after a gap (a trimmed or expired log) nothing is contiguous any more
            tokens.extend(ev.token_ids[len(tokens) - ev.offset:])
        ended = ended or ev.finish_reason is not None
    return tokens, ended
