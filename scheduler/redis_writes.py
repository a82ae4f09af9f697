"""The writes the scheduler's decisions lead to, typed: the cluster appends them to `Cluster.ops` as plain
data, and the service queues them on its next turn's pipeline (`queue_writes`), in order. Each says here,
and only here, which Redis commands it is."""

from __future__ import annotations

from dataclasses import dataclass

from phaseserve import token_log
from phaseserve.wire import FIELD, OUTPUT_FIELD_PREFIX, STREAM_MAXLEN, Keys

DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True)
class SaveSubmit:
    """A request's record gets its submit (a scheduler taking over re-admits every record)."""

    key: str  # Keys.request_record
    submit: bytes

    def queue(self, pipe, keys: Keys) -> None:
        pipe.hset(self.key, "submit", self.submit)


@dataclass(frozen=True)
class SetRecordField:
    """One field of a request's record: the worker running it, its quarantine strikes."""

    key: str
    name: str
    value: str | int

    def queue(self, pipe, keys: Keys) -> None:
        pipe.hset(self.key, self.name, self.value)


@dataclass(frozen=True)
class SaveOutputs:
    """Confirmed output tokens from offset `start` on, into a request's record."""

    key: str
    start: int
    tokens: list[int]

    def queue(self, pipe, keys: Keys) -> None:
        # one field per offset: a retried pipeline cannot duplicate a token
        pipe.hset(self.key, mapping={f"{OUTPUT_FIELD_PREFIX}{self.start + i}": t for i, t in enumerate(self.tokens)})


@dataclass(frozen=True)
class DeleteRecord:
    """A request is done with: its record goes."""

    key: str

    def queue(self, pipe, keys: Keys) -> None:
        pipe.delete(self.key)


@dataclass(frozen=True)
class SendPlan:
    """A plan outside a policy's steps (a drained worker's last), after the plans in flight."""

    stream: str  # Keys.steps
    plan: bytes

    def queue(self, pipe, keys: Keys) -> None:
        pipe.xadd(self.stream, {FIELD: self.plan}, maxlen=STREAM_MAXLEN, approximate=True)


@dataclass(frozen=True)
class Publish:
    """A message to a gateway's channel (SequenceProgress)."""

    channel: str
    message: bytes

    def queue(self, pipe, keys: Keys) -> None:
        pipe.publish(self.channel, self.message)


@dataclass(frozen=True)
class TellError:
    """An error event for a request's client: in its token log, then published (as the relay does tokens)."""

    channel: str  # Keys.gateway_channel
    batch: bytes  # TokenBatch with the event
    event: list  # TokenEvent.to_list()

    def queue(self, pipe, keys: Keys) -> None:
        token_log.append_event(pipe, keys, self.event)
        pipe.publish(self.channel, self.batch)


@dataclass(frozen=True)
class LogAbort:
    """A sequence nobody serves was cancelled: its token log ends, so a client resuming later reads the end."""

    request_id: str

    def queue(self, pipe, keys: Keys) -> None:
        token_log.append_abort(pipe, keys, self.request_id, 0)


@dataclass(frozen=True)
class DeadLetter:
    """An entry nobody can read, kept in `Keys.dead_letters` with where it came from and why."""

    stream: str
    data: bytes
    entry_id: object
    reason: str

    def queue(self, pipe, keys: Keys) -> None:
        pipe.xadd(keys.dead_letters, {FIELD: self.data, "stream": self.stream, "entry_id": self.entry_id,
                                      "reason": self.reason}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


RedisWrite = SaveSubmit | SetRecordField | SaveOutputs | DeleteRecord | SendPlan | Publish | TellError | LogAbort \
    | DeadLetter


def queue_writes(pipe, keys: Keys, ops: list[RedisWrite]) -> None:
    """Queue every write on `pipe`, in order, and empty `ops`."""
    for op in ops:
        op.queue(pipe, keys)
    ops.clear()
