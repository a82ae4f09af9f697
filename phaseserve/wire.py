"""The wire contract: every message that crosses Redis, and every key name.

msgpack everywhere. Each message is a dataclass with `to_wire()` (bytes) and
`from_wire(bytes)`; the payload carries the protocol version and the message
kind, so a receiver rejects what it does not understand instead of guessing.

Flow (see docs/architecture.md):
  gateway  --SubmitRequest/CancelRequest--> stream `requests`      --> scheduler
  scheduler --StepPlan-->                   stream `steps:<worker>` --> worker
  worker   --StepResult-->                  stream `results`        --> scheduler
  worker   --TokenBatch-->                  channel `gw:<gateway>`  --> gateway
  scheduler --SequenceProgress-->           channel `gw:<gateway>`  --> gateway
  worker   --WorkerInfo-->                  key `worker:<id>` (expires: heartbeat)

Every token carries its offset in the sequence's output, so receivers can drop
duplicates and notice gaps (what makes recompute after a crash invisible).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import msgpack

from phaseserve.params import SamplingParams

PROTOCOL_VERSION = 1
FIELD = "m"  # every stream entry is {FIELD: <msgpack message>}
FIELD_BYTES = FIELD.encode()  # the same key as redis-py returns it in read entries


class WireError(ValueError):
    """A payload that is not a message of this protocol version."""


# approximate cap (XADD MAXLEN ~) on the steps and results streams: acked entries are history only
STREAM_MAXLEN = 10_000


class Keys:
    """Redis key, stream and channel names, all under one prefix."""

    def __init__(self, prefix: str = "ps"):
        self.prefix = prefix
        self.requests = f"{prefix}:requests"  # stream: SubmitRequest / CancelRequest
        self.results = f"{prefix}:results"  # stream: StepResult
        self.workers = f"{prefix}:workers"  # set of worker ids ever announced
        self.scheduler_group = "schedulers"
        self.worker_group = "workers"

    def steps(self, worker_id: str) -> str:
        return f"{self.prefix}:steps:{worker_id}"

    def gateway_channel(self, gateway_id: str) -> str:
        return f"{self.prefix}:gw:{gateway_id}"

    def worker_heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def request_record(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def scheduler_alive(self) -> str:
        """Set by the scheduler every worker refresh, expiring after a few: its liveness for health checks."""
        return f"{self.prefix}:scheduler:alive"

    def kv_transfer(self, transfer_id: str) -> str:
        """Stream: one KV transfer's chunks over Redis (workers/kv_transfer/redis_transport.py), with a TTL."""
        return f"{self.prefix}:kv:{transfer_id}"

    def scheduler_stats(self) -> str:
        """msgpack dict written by the scheduler on change (throttled): num_waiting, num_running,
        kv_blocks_used, kv_blocks_total, num_preemptions, num_workers, num_steps_held_by_itl_target, updated_at. Read by the gateway's /metrics."""
        return f"{self.prefix}:scheduler:stats"

    # --- delivery and client leases (gateway side)

    def token_log(self, seq_id: str) -> str:
        """Stream: every TokenEvent of one sequence, written by the worker's relay beside its PUBLISH; entry id
        `<next offset>-0` (`-1` for an event without tokens), so a duplicate offset is refused. Capped and
        expiring (TOKEN_LOG_MAXLEN, TOKEN_LOG_TTL_S). See phaseserve/token_log.py."""
        return f"{self.prefix}:out:{seq_id}"

    def client_lease(self, seq_id: str) -> str:
        """Key with a short TTL, refreshed by the gateway serving a client of this sequence (value: that
        serving's attachment token). Gone for longer than the resume grace: nobody serves it, cancel it."""
        return f"{self.prefix}:lease:{seq_id}"

    def resume_secret(self) -> str:
        """Random bytes, set once (SET NX) by the first gateway that needs them: the key of every stream's
        resume token (gateway/sse_ids.py), shared by the stack's gateways."""
        return f"{self.prefix}:resume-secret"

    def gateway_heartbeat(self, gateway_id: str) -> str:
        """A gateway's GatewayInfo, with a TTL: the gateway is alive."""
        return f"{self.prefix}:gateway:{gateway_id}"

    # ---- reliability (scheduler/worker side): fail-over, dead letters, confirmed outputs

    @property
    def dead_letters(self) -> str:
        """Stream of messages nobody could read: {FIELD: the raw bytes, "stream", "entry_id", "reason"}."""
        return f"{self.prefix}:dead"

    def scheduler_lease(self) -> str:
        """Holds the active scheduler's consumer name, with a TTL (SET NX PX); a standby waits for it."""
        return f"{self.prefix}:scheduler:lease"

    def scheduler_epoch(self) -> str:
        """INCR'ed by each scheduler that takes the lease; every StepPlan carries it."""
        return f"{self.prefix}:scheduler:epoch"

    # A request record (`request_record`, a hash) holds "submit" (the SubmitRequest as admitted, with the
    # seed the scheduler drew for an unseeded sampled request), "worker", and one field per confirmed output
    # token, OUTPUT_FIELD_PREFIX + offset -> token id, written as step results confirm them (idempotent, so
    # a retried pipeline cannot duplicate a token). A scheduler that takes over resumes from these.


OUTPUT_FIELD_PREFIX = "o"


def _pack(kind: str, body: dict) -> bytes:
    body["v"] = PROTOCOL_VERSION
    body["k"] = kind
    return msgpack.packb(body, use_bin_type=True)


def _unpack(data: bytes, kind: str) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack: {e}") from e
    if not isinstance(body, dict) or body.get("v") != PROTOCOL_VERSION:
        raise WireError(f"unsupported protocol version: {body.get('v') if isinstance(body, dict) else body!r}")
    if body.get("k") != kind:
        raise WireError(f"expected {kind}, got {body.get('k')}")
    return body


def peek_kind(data: bytes) -> str:
    """The kind of a message, for streams that carry more than one kind."""
    body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(body, dict) or body.get("v") != PROTOCOL_VERSION:
        raise WireError("unsupported protocol version")
    return body.get("k", "")


# --------------------------------------------------------------- gateway -> scheduler


@dataclass
class SubmitRequest:
    """One sequence to generate (a request with n > 1 is n of these)."""

    KIND: ClassVar[str] = "submit"
    request_id: str
    gateway_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value = served first (vLLM's convention)
    arrival_time: float = 0.0

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "gateway_id": self.gateway_id,
            "prompt_ids": list(self.prompt_ids),
            "params": self.params.to_wire(),
            "priority": self.priority,
            "arrival_time": self.arrival_time,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SubmitRequest":
        return cls(
            d["request_id"], d["gateway_id"], d["prompt_ids"], SamplingParams.from_wire(d["params"]),
            d.get("priority", 0), d.get("arrival_time", 0.0),
        )

    def to_wire(self) -> bytes:
        return _pack(self.KIND, self.to_dict())

    @classmethod
    def from_wire(cls, data: bytes) -> "SubmitRequest":
        return cls.from_dict(_unpack(data, cls.KIND))


@dataclass
class CancelRequest:
    """The client went away, or a stop string matched: free the sequence."""

    KIND: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "abort"

    def to_wire(self) -> bytes:
        return _pack(self.KIND, {"request_id": self.request_id, "reason": self.reason})

    @classmethod
    def from_wire(cls, data: bytes) -> "CancelRequest":
        d = _unpack(data, cls.KIND)
        return cls(d["request_id"], d.get("reason", "abort"))


# --------------------------------------------------------------- scheduler -> worker


@dataclass
class SeqStart:
    """Tells a worker about a sequence it has not seen (new, preempted or migrated).

    `output_ids` is non-empty when the sequence is recomputed: the worker feeds
    prompt + output through prefill and continues sampling at offset len(output_ids).
    `num_cached` positions already have their KV in the sequence's blocks (moved there by a KV transfer,
    workers/kv_transfer): its first chunk starts there instead of at 0.
    `send_kv` (a prefill worker's sequence): stream the prefill's KV out as its chunks fill blocks,
    as transfer `send_kv.transfer_id`, for the decode worker the scheduler hands the sequence to.
    """

    seq_id: str
    gateway_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    send_kv: KVSend | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the worker knows at start: prompt + outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

    def to_dict(self) -> dict:
        d = {
            "seq_id": self.seq_id, "gateway_id": self.gateway_id, "prompt_ids": list(self.prompt_ids),
            "params": self.params.to_wire(), "output_ids": list(self.output_ids),
        }
        if self.num_cached:
            d["num_cached"] = self.num_cached
        if self.send_kv is not None:
            d["send_kv"] = self.send_kv.to_list()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SeqStart":
        send = d.get("send_kv")
        return cls(d["seq_id"], d["gateway_id"], d["prompt_ids"], SamplingParams.from_wire(d["params"]),
                   d.get("output_ids", []), d.get("num_cached", 0), KVSend.from_list(send) if send else None)


# KV transports (workers/kv_transfer): "shm" between workers on one host, "redis" between any two
KV_TRANSPORTS = ("shm", "redis")


@dataclass
class KVSend:
    """Where a prefill worker ships one sequence's KV: a single-use transfer id over a transport."""

    transfer_id: str
    transport: str  # one of KV_TRANSPORTS

    def to_list(self) -> list:
        return [self.transfer_id, self.transport]

    @classmethod
    def from_list(cls, x: list) -> "KVSend":
        return cls(x[0], x[1])


@dataclass
class KVReceive:
    """A decode worker takes transfer `transfer_id` into `block_ids` before this step's chunks run: the KV of
    positions [0, num_tokens) of a sequence started in the same plan with `SeqStart.num_cached = num_tokens`.
    If it fails, the worker forgets that sequence (its chunks are skipped, no token is sampled) and the
    scheduler recomputes it; it never decodes over blocks whose transfer did not arrive whole."""

    seq_id: str
    transfer_id: str
    transport: str
    block_ids: list[int]
    num_tokens: int
    timeout_s: float = 2.0

    def to_list(self) -> list:
        return [self.seq_id, self.transfer_id, self.transport, self.block_ids, self.num_tokens, self.timeout_s]

    @classmethod
    def from_list(cls, x: list) -> "KVReceive":
        return cls(*x[:6])


@dataclass
class KVHandoffResult:
    """How a KVReceive went, in the decode worker's StepResult (for the scheduler's handoff counters)."""

    seq_id: str
    transfer_id: str
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def to_list(self) -> list:
        return [self.seq_id, self.transfer_id, self.ok, self.num_blocks, self.num_bytes, self.seconds, self.error]

    @classmethod
    def from_list(cls, x: list) -> "KVHandoffResult":
        return cls(*x[:7])


@dataclass
class ScheduledChunk:
    """Run tokens [start_pos, start_pos + num_tokens) of a sequence this step.

    The tokens themselves are the worker's (prompt + outputs it sampled), so a
    decode chunk needs no token id from the scheduler. `block_table` lists the
    KV block ids covering positions [0, start_pos + num_tokens); the scheduler
    owns allocation, the worker only writes where it is told. The worker samples
    a token when the chunk reaches the end of the sequence's known tokens.
    """

    seq_id: str
    start_pos: int
    num_tokens: int
    block_table: list[int]

    def to_list(self) -> list:
        return [self.seq_id, self.start_pos, self.num_tokens, self.block_table]

    @classmethod
    def from_list(cls, x: list) -> "ScheduledChunk":
        return cls(x[0], x[1], x[2], x[3])


@dataclass
class StepPlan:
    """Everything a worker needs for one forward pass. Decodes come first."""

    KIND: ClassVar[str] = "plan"
    step_id: int
    worker_id: str
    starts: list[SeqStart] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # seq ids the worker may forget
    # reliability fields (defaults: what older schedulers mean). `epoch`: the sending scheduler's lease
    # epoch; a worker drops plans of an epoch older than one it has seen. `reset`: the first plan of an
    # adoption; the worker forgets every sequence it holds (they belong to a scheduler or adoption gone).
    epoch: int = 0
    reset: bool = False
    # seconds this step may take from when it is due (0: the worker's --step-timeout); the scheduler
    # scales it up for a step larger than its budget (a whole long prompt with chunked prefill off)
    timeout_s: float = 0.0
    receives: list[KVReceive] = field(default_factory=list)  # KV handed in from a prefill worker
    # the answer to a draining worker (WorkerInfo.draining): the scheduler holds no sequence on it any
    # more and sends it nothing after this plan, so once the plans before it are run the worker may exit
    drained: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def to_wire(self) -> bytes:
        body = {
            "step_id": self.step_id, "worker_id": self.worker_id,
            "starts": [s.to_dict() for s in self.starts],
            "chunks": [c.to_list() for c in self.chunks],
            "releases": list(self.releases), "epoch": self.epoch, "reset": self.reset,
            "timeout_s": self.timeout_s, "drained": self.drained,
        }
        if self.receives:
            body["receives"] = [r.to_list() for r in self.receives]
        return _pack(self.KIND, body)

    @classmethod
    def from_wire(cls, data: bytes) -> "StepPlan":
        d = _unpack(data, cls.KIND)
        return cls(d["step_id"], d["worker_id"], [SeqStart.from_dict(s) for s in d["starts"]],
                   [ScheduledChunk.from_list(c) for c in d["chunks"]], d["releases"], d.get("epoch", 0),
                   bool(d.get("reset", False)), float(d.get("timeout_s", 0.0)),
                   [KVReceive.from_list(r) for r in d.get("receives", ())], bool(d.get("drained", False)))


# --------------------------------------------------------------- worker -> gateway / scheduler


# TokenEvent.error_kind of an "error" finish: the scheduler refused to admit the sequence because its
# prompt + max_tokens can never fit a worker (max_model_len or KV cache). The request was bad input, so a
# gateway answers 400 (context_length_exceeded) with `error` as the message. Any other error (error_kind
# None) is a failure while serving: 500.
ERROR_REJECTED = "rejected"


@dataclass
class TokenEvent:
    """New output tokens of one sequence; `offset` is the index of token_ids[0] in its output.

    `logprobs`, when asked for, has one entry per token: [chosen_logprob, [[id, logprob], ...top-N]].
    `finish_reason` is "stop", "length", "abort" or "error" on the last event of a sequence.
    `error_kind` says what an "error" was (ERROR_REJECTED, or None: a serving failure).
    """

    seq_id: str
    offset: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None
    error: str | None = None
    error_kind: str | None = None

    def to_list(self) -> list:
        x = [self.seq_id, self.offset, self.token_ids, self.finish_reason, self.logprobs, self.error]
        if self.error_kind is not None:  # only when set: every other event stays as older receivers know it
            x.append(self.error_kind)
        return x

    @classmethod
    def from_list(cls, x: list) -> "TokenEvent":
        return cls(*x[:7])  # a newer peer's extra trailing fields are ignored


@dataclass
class TokenBatch:
    """All tokens of one step for one gateway: one pub/sub message per gateway per step."""

    KIND: ClassVar[str] = "tokens"
    step_id: int
    worker_id: str
    events: list[TokenEvent]

    def to_wire(self) -> bytes:
        return _pack(self.KIND, {"step_id": self.step_id, "worker_id": self.worker_id,
                                 "events": [e.to_list() for e in self.events]})

    @classmethod
    def from_wire(cls, data: bytes) -> "TokenBatch":
        d = _unpack(data, cls.KIND)
        return cls(d["step_id"], d["worker_id"], [TokenEvent.from_list(e) for e in d["events"]])


@dataclass
class SequenceProgress:
    """Sequences the scheduler vouches for though they show no new token: waiting in its queue, or
    prefilling a long prompt whose chunks keep being computed. A gateway counts this as progress for its
    no-progress deadline (a slow prefill or a queue is not a stall). Sent on the gateway's channel about
    once a scheduler refresh, beside the workers' TokenBatches."""

    KIND: ClassVar[str] = "progress"
    seq_ids: list[str]

    def to_wire(self) -> bytes:
        return _pack(self.KIND, {"seq_ids": list(self.seq_ids)})

    @classmethod
    def from_wire(cls, data: bytes) -> "SequenceProgress":
        return cls(list(_unpack(data, cls.KIND)["seq_ids"]))


def channel_message(data: bytes) -> TokenBatch | SequenceProgress:
    """A message on a gateway's channel: a worker's TokenBatch (nearly all of them, tried first) or the
    scheduler's SequenceProgress. Raises WireError for anything else."""
    try:
        return TokenBatch.from_wire(data)
    except WireError as e:
        try:
            return SequenceProgress.from_wire(data)
        except WireError:
            raise e from None


@dataclass
class StepResult:
    """What a step produced, for the scheduler: sampled tokens and finished sequences."""

    KIND: ClassVar[str] = "result"
    step_id: int
    worker_id: str
    events: list[TokenEvent]
    num_tokens: int = 0
    step_time_s: float = 0.0
    epoch: int = 0  # the plan's epoch, echoed: a scheduler ignores results of another epoch's plans
    handoffs: list[KVHandoffResult] = field(default_factory=list)  # how the plan's KVReceives went

    def to_wire(self) -> bytes:
        body = {"step_id": self.step_id, "worker_id": self.worker_id, "events": [e.to_list() for e in self.events],
                "num_tokens": self.num_tokens, "step_time_s": self.step_time_s, "epoch": self.epoch}
        if self.handoffs:
            body["handoffs"] = [h.to_list() for h in self.handoffs]
        return _pack(self.KIND, body)

    @classmethod
    def from_wire(cls, data: bytes) -> "StepResult":
        d = _unpack(data, cls.KIND)
        return cls(d["step_id"], d["worker_id"], [TokenEvent.from_list(e) for e in d["events"]],
                   d.get("num_tokens", 0), d.get("step_time_s", 0.0), d.get("epoch", 0),
                   [KVHandoffResult.from_list(h) for h in d.get("handoffs", ())])


@dataclass
class WorkerInfo:
    """A worker's heartbeat: who it is and what it can hold. Stored with a TTL."""

    KIND: ClassVar[str] = "worker"
    worker_id: str
    role: str  # "mixed" | "prefill" | "decode"
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    pid: int = 0
    # when this life of the worker began: its process start, or (set anew by its relay) the moment its model
    # moved again after stalling past the step deadline. A new value = a new life: the scheduler retires
    # the old one (its plans are void) and adopts the worker afresh
    started_at: float = 0.0
    # context length at which a token's attention costs as much as its linear layers: the scheduler's
    # prefill cost model (0 = unknown / off, as in messages from older workers)
    attention_horizon: int = 0
    # the machine it runs on: workers on one host hand KV over through shared memory, others through Redis
    host: str = ""
    # the worker got SIGTERM and is leaving: the scheduler places nothing new on it, moves its waiting
    # sequences elsewhere, lets its running ones finish (up to its --drain-timeout), then answers with a
    # `drained` StepPlan (docs/architecture.md, "Workers joining and leaving")
    draining: bool = False
    # what it computes with, for people (the gateway's /health and /metrics): the activations' dtype, the
    # CPU level it runs at (kernels/cpu_isa.py; "" on CUDA), and which implementation runs each op family
    # ({"attention": "native avx512-bf16" | "native avx2" | "torch" | "triton", ...}); empty from older workers
    dtype: str = ""
    cpu_level: str = ""
    kernels: dict[str, str] = field(default_factory=dict)
    # the model's vocabulary (embedding rows): the scheduler refuses a prompt with a token id outside
    # [0, vocab_size) before it reaches a batch (0 = unknown, as from older workers: not checked)
    vocab_size: int = 0

    def to_wire(self) -> bytes:
        return _pack(self.KIND, {k: getattr(self, k) for k in (
            "worker_id", "role", "model", "num_blocks", "block_size", "max_model_len", "pid", "started_at",
            "attention_horizon", "host", "draining", "dtype", "cpu_level", "kernels", "vocab_size")})

    @classmethod
    def from_wire(cls, data: bytes) -> "WorkerInfo":
        d = _unpack(data, cls.KIND)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # a newer worker's extra fields are ignored


# --------------------------------------------------------------- delivery (gateway side)

# a sequence's token log (Keys.token_log): XADD MAXLEN ~ cap in entries (one a step) and its TTL, refreshed
# on write, so a finished request can still be resumed for a while and an abandoned one goes away
TOKEN_LOG_MAXLEN = 16_384
TOKEN_LOG_TTL_S = 300


@dataclass
class GatewayInfo:
    """A gateway's heartbeat (Keys.gateway_heartbeat, stored with a TTL of `lease_ttl` seconds)."""

    KIND: ClassVar[str] = "gateway"
    gateway_id: str
    pid: int = 0
    started_at: float = 0.0
    lease_ttl: float = 5.0  # its client leases (Keys.client_lease) live this long unless refreshed
    resume_grace: float = 10.0  # how long a request without a client may wait for a resume

    def to_wire(self) -> bytes:
        return _pack(self.KIND, {k: getattr(self, k) for k in (
            "gateway_id", "pid", "started_at", "lease_ttl", "resume_grace")})

    @classmethod
    def from_wire(cls, data: bytes) -> "GatewayInfo":
        d = _unpack(data, cls.KIND)
        return cls(d["gateway_id"], d.get("pid", 0), d.get("started_at", 0.0), d.get("lease_ttl", 5.0),
                   d.get("resume_grace", 10.0))
