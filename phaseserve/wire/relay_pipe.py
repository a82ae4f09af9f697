"""The two pipes between a worker's model process and its relay (workers/relay.py has the protocol). Both
ends are one install, so these carry no version; a list is a step's traffic, a map a notice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack

from phaseserve.wire.codec import Record, Row, sent_if_set


class PipeNotice(Record):
    """A map on a pipe: the relay's configuration, a notice."""

    def to_pipe(self) -> bytes:
        return msgpack.packb(self.to_dict())


class PipeRow(Row):
    """A list on a pipe: a step's traffic."""

    def to_pipe(self) -> bytes:
        return msgpack.packb(self.to_list())


@dataclass
class RelayConfig(PipeNotice):
    """The first message on `writes`: how the relay reaches Redis and announces the worker."""

    redis_url: str
    key_prefix: str
    info: bytes  # WorkerInfo, as the heartbeat carries it
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0
    block_ms: int = 500
    log_level: str = "info"
    log_json: bool = False
    cpus: list[int] | None = None  # run on these CPUs (None: wherever the model process may run)
    step_timeout: float = 30.0  # a model step due longer than this: the model is hung (see ModelLiveness)

    @classmethod
    def from_pipe(cls, data: bytes) -> "RelayConfig":
        return cls.from_dict(msgpack.unpackb(data))


class GatewayBatch(NamedTuple):
    """One gateway's tokens of a step: the relay appends them to the token logs and publishes them on the
    gateway's channel. A tuple, so on the pipe it stays the pair `[gateway id, bytes]` it always was."""

    gateway_id: str
    token_batch: bytes  # TokenBatch


@dataclass
class StepWrites(PipeRow):
    """model -> relay, one a plan: what to write for it. No result (None): the plan is only acked."""

    entry_id: bytes  # the plan's entry in `steps:<worker>`, to XACK
    result: bytes | None = None  # StepResult
    batches: list[GatewayBatch] = field(default_factory=list)
    reset: bool = False  # the plan's `reset`: a new adoption (ends a hung model's void writes)


@dataclass
class PlanDelivery(PipeRow):
    """relay -> model: a plan read from `steps:<worker>`, or (no entry id) why the relay failed."""

    entry_id: bytes | None
    data: bytes | str  # StepPlan bytes; with no entry id, the failure's message


@dataclass
class RelayNotice(PipeNotice):
    """A notice on either pipe."""

    draining: bool = sent_if_set(False)  # model -> relay: SIGTERM; announce WorkerInfo.draining now
    no_scheduler: bool = sent_if_set(False)  # relay -> model: draining, and no scheduler holds the lease


def model_to_relay(data: bytes) -> StepWrites | RelayNotice:
    message = msgpack.unpackb(data)
    return RelayNotice.from_dict(message) if isinstance(message, dict) else StepWrites.from_list(message)


def relay_to_model(data: bytes) -> PlanDelivery | RelayNotice:
    message = msgpack.unpackb(data)
    return RelayNotice.from_dict(message) if isinstance(message, dict) else PlanDelivery.from_list(message)
