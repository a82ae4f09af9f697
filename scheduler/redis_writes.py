"""The cluster's decided writes (`Cluster.ops`, plain tuples) queued on the service's pipeline as Redis
commands: the one place that turns them into commands."""

from __future__ import annotations

from phaseserve import token_log
from phaseserve.wire import FIELD, OUTPUT_FIELD_PREFIX, STREAM_MAXLEN, Keys

DEAD_LETTER_MAXLEN = 10_000


def queue_writes(pipe, keys: Keys, ops: list[tuple]) -> None:
    """Queue every op on `pipe`, in order, and empty `ops`."""
    for op in ops:
        kind, key = op[0], op[1]
        if kind == "record":
            pipe.hset(key, "submit", op[2])
        elif kind == "hset":
            pipe.hset(key, op[2], op[3])
        elif kind == "outputs":  # one field per offset: a retried pipeline cannot duplicate a token
            pipe.hset(key, mapping={f"{OUTPUT_FIELD_PREFIX}{op[2] + i}": t for i, t in enumerate(op[3])})
        elif kind == "delete":
            pipe.delete(key)
        elif kind == "plan":  # a plan outside a policy's steps (a drained worker's last)
            pipe.xadd(key, {FIELD: op[2]}, maxlen=STREAM_MAXLEN, approximate=True)
        elif kind == "publish":
            pipe.publish(key, op[2])
        elif kind == "error":  # the durable copy first, as the relay does for tokens
            token_log.append_event(pipe, keys, op[3])
            pipe.publish(key, op[2])
        elif kind == "abort":
            token_log.append_abort(pipe, keys, key, 0)
        elif kind == "dead":
            pipe.xadd(keys.dead_letters, {FIELD: op[2], "stream": key, "entry_id": op[3], "reason": op[4]},
                      maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    ops.clear()
