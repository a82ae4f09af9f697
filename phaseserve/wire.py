"""The wire contract: every message that crosses Redis, and every key name.

msgpack everywhere. Each message is a dataclass with `to_wire()` (bytes) and
`from_wire(bytes)`; the payload carries the protocol version and the message
kind, so a receiver rejects what it does not understand instead of guessing.
No message has a hand-written codec: one generic codec (`_Codec`, below) reads
its dataclass fields in declaration order. A top-level `Message` is a map of
field names; a `Record` nested in one is a map too; a `Row` (many of them a
message: chunks, token events) is a list, positional. Receiving, a field that
is missing takes its default (an older sender), unknown keys and trailing list
items are ignored (a newer one). Adding a field: give it a default, at the end
of a Row, and `sent_if_set()` if older receivers must keep getting exactly the
bytes they know unless it is used.

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

import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Self

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

    def scheduler_seen(self, consumer: str) -> str:
        """Set by each scheduler process, the active one every worker refresh and a standby every look at
        the lease, expiring after a few: that process's own liveness (`python -m phaseserve.healthcheck
        scheduler`), where `scheduler_alive` is the stack's."""
        return f"{self.prefix}:scheduler:seen:{consumer}"

    def kv_transfer(self, transfer_id: str) -> str:
        """Stream: one KV transfer's chunks over Redis (workers/kv_transfer/redis_transport.py), with a TTL."""
        return f"{self.prefix}:kv:{transfer_id}"

    def scheduler_stats(self) -> str:
        """msgpack dict written by the scheduler on change (throttled): num_waiting, num_running,
        kv_blocks_used, kv_blocks_total, num_preemptions, num_workers, num_steps_held_by_itl_target,
        num_steps_past_itl_patience, updated_at. Read by the gateway's /metrics."""
        return f"{self.prefix}:scheduler:stats"

    def stack_view(self) -> str:
        """A StackView (phaseserve/stack_view.py) the scheduler writes at most every STACK_VIEW_INTERVAL_S,
        with a TTL: what the gateway's live view shows (docs/ui.md)."""
        return f"{self.prefix}:scheduler:view"

    def stack_view_wanted(self) -> str:
        """Set with a short TTL by a gateway while someone watches its live view: the scheduler writes
        `stack_view` only then."""
        return f"{self.prefix}:scheduler:view-wanted"

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

    def lora_adapters(self) -> str:
        """Hash: LoRA adapter name -> its LoraRef (msgpack), the adapters the stack serves as models: written by
        the gateway (--lora-modules at start, POST /v1/load_lora_adapter and unload), so every gateway knows
        them (docs/lora.md)."""
        return f"{self.prefix}:lora:adapters"

    def key_usage(self, key_name: str) -> str:
        """Hash: one API key's usage so far (requests, prompt, cached and completion tokens), added to by every
        gateway as its requests end; read by GET /v1/usage (docs/tenants.md)."""
        return f"{self.prefix}:usage:{key_name}"

    def gateway_heartbeat(self, gateway_id: str) -> str:
        """A gateway's GatewayInfo, with a TTL: the gateway is alive."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def response(self, response_id: str) -> str:
        """A stored Response of /v1/responses (JSON: owner digest, the Response, its conversation), with a
        TTL (--responses-ttl); written and read by any gateway (gateway/responses_store.py)."""
        return f"{self.prefix}:response:{response_id}"

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


# --------------------------------------------------------------- the codec: every message from its fields

_SENT_IF_SET = "sent_if_set"


def sent_if_set(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A field left out of the message while it holds its default: a field added after older peers were
    out, so every message that does not use it stays byte for byte what they know. In a Row, only trailing
    fields can be (a list has no names)."""
    return field(default=default, default_factory=default_factory, metadata={_SENT_IF_SET: True})


class Record:
    """A message nested in another, encoded as a map of its field names (`to_dict` / `from_dict`)."""

    def to_dict(self) -> dict:
        return _codec(type(self)).encode(self)

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        return _codec(cls).decode(d)


class Message(Record):
    """A top-level message: a Record plus the protocol version and its KIND."""

    KIND: ClassVar[str]

    def to_wire(self) -> bytes:
        return _pack(self.KIND, self.to_dict())

    @classmethod
    def from_wire(cls, data: bytes) -> Self:
        return cls.from_dict(_unpack(data, cls.KIND))


class Row:
    """A message nested in another, many times over: a list of its fields, positional (`to_list` / `from_list`)."""

    def to_list(self) -> list:
        return _codec(type(self)).encode(self)

    @classmethod
    def from_list(cls, x: list) -> Self:
        return _codec(cls).decode(x)


def _converters(hint: Any) -> tuple[Callable | None, Callable | None]:
    """(encode, decode) of a field's non-None values by its type; None where msgpack carries it as it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = [a for a in args if a is not type(None)]
        return _converters(inner[0]) if len(inner) == 1 else (None, None)
    if origin is list and args and is_dataclass(args[0]):
        item = _codec(args[0])
        enc, dec, quick = item.encode, item.decode, item.encode_quick
        if quick is not None:  # one call a row instead of two: a step has dozens of them
            return (lambda xs: [quick(x) or enc(x) for x in xs]), (lambda xs: [dec(x) for x in xs])
        return (lambda xs: [enc(x) for x in xs]), (lambda xs: [dec(x) for x in xs])
    if is_dataclass(hint):
        item = _codec(hint)
        return item.encode, item.decode
    return None, None


class _Codec:
    """Encodes one dataclass as a map (a Record; also a dataclass from elsewhere, SamplingParams) or a list
    (a Row) of its fields in declaration order, those marked sent_if_set after the others, and decodes it.
    Built for speed (a step's plan has dozens of Rows): one compiled call (`_reader`) reads the fields sent
    always."""

    def __init__(self, cls: type):
        self.cls, self.as_list = cls, issubclass(cls, Row)
        hints = typing.get_type_hints(cls)
        sent: list[tuple[str, Callable | None]] = []  # always in the message
        self.if_set: list[tuple[str, Callable | None, Any]] = []  # (name, encode, default)
        self.decoders: list[tuple[str, Callable | None, bool]] = []  # (name, decode, required), declaration order
        for f in fields(cls):
            enc, dec = _converters(hints[f.name])
            required = f.default is MISSING and f.default_factory is MISSING
            self.decoders.append((f.name, dec, required))
            if f.metadata.get(_SENT_IF_SET):
                self.if_set.append((f.name, enc, f.default if f.default_factory is MISSING else f.default_factory()))
            elif self.if_set and self.as_list:
                raise TypeError(f"{cls.__name__}.{f.name}: a Row's sent_if_set fields must be its last")
            else:
                sent.append((f.name, enc))
        self.names = tuple(name for name, _ in sent)
        self.get_sent = _reader(self.names, "[]" if self.as_list else "{}")
        # a Row's tail (its sent_if_set fields), nearly always at its defaults: `get_row` reads the fields
        # sent always and checks that in one call, None if a tail field is set
        tail_names = tuple(name for name, _, _ in self.if_set)
        self.get_tail = _reader(tail_names, "()")
        self.tail_defaults = tuple(default for _, _, default in self.if_set)
        self.get_row = _reader(self.names, "[]", unless_set=dict(zip(tail_names, self.tail_defaults)))
        self.sent_encoders = [(i, name, enc) for i, (name, enc) in enumerate(sent) if enc is not None]
        self.num_fields = len(self.decoders)
        self.row_decoders = [(i, dec) for i, (_, dec, _) in enumerate(self.decoders) if dec is not None]

        self.encode: Callable[[Any], dict | list] = self._row_encoder() if self.as_list else self._map_encoder()
        self.decode: Callable[[Any], Any] = self._row_decoder() if self.as_list else self._map_decoder()
        # a Row with nothing to convert: `get_row` alone encodes it unless a tail field is set (None)
        self.encode_quick = self.get_row if self.as_list and not self.sent_encoders else None

    # The encoders are closures over their codec's parts (no attribute lookups per call): encoding runs
    # for every chunk and token event of every step.

    def _row_encoder(self) -> Callable[[Any], list]:
        get_row, get_sent = self.get_row, self.get_sent
        encoders, if_set = [(i, enc) for i, _, enc in self.sent_encoders], self.if_set
        get_tail, tail_defaults = self.get_tail, self.tail_defaults

        def encode(obj) -> list:
            out = get_row(obj)
            if out is None:  # a tail field is set
                out = get_sent(obj)
                tail = list(get_tail(obj))
                while tail[-1] == tail_defaults[len(tail) - 1]:
                    tail.pop()  # a Row has no names: only trailing defaults can stay off the wire
                out += [v if enc is None or v is None else enc(v) for v, (_, enc, _) in zip(tail, if_set)]
            for i, enc in encoders:
                if out[i] is not None:
                    out[i] = enc(out[i])
            return out

        return encode

    def _map_encoder(self) -> Callable[[Any], dict]:
        get_sent, if_set = self.get_sent, self.if_set
        encoders = [(name, enc) for _, name, enc in self.sent_encoders]

        def encode(obj) -> dict:
            out = get_sent(obj)
            for name, enc in encoders:
                if out[name] is not None:
                    out[name] = enc(out[name])
            for name, enc, default in if_set:
                v = getattr(obj, name)
                if v != default:
                    out[name] = v if enc is None or v is None else enc(v)
            return out

        return encode

    def _row_decoder(self) -> Callable[[list], Any]:
        cls, num_fields, decoders = self.cls, self.num_fields, self.row_decoders

        def decode(x: list):
            if type(x) is not list:
                raise WireError(f"{cls.__name__}: expected a list, got {x!r:.80}")
            args = x[:num_fields]  # a newer sender's extra trailing fields are ignored
            for i, dec in decoders:
                if i < len(args) and args[i] is not None:
                    args[i] = dec(args[i])
            try:
                return cls(*args)  # missing trailing fields (an older sender) take their defaults
            except TypeError as e:
                raise WireError(f"{cls.__name__}: {e}") from None

        return decode

    def _map_decoder(self) -> Callable[[dict], Any]:
        cls, decoders = self.cls, self.decoders

        def decode(x: dict):
            if type(x) is not dict:
                raise WireError(f"{cls.__name__}: expected a map, got {x!r:.80}")
            kwargs = {}
            for name, dec, required in decoders:
                if name in x:
                    v = x[name]
                    kwargs[name] = v if dec is None or v is None else dec(v)
                elif required:
                    raise WireError(f"{cls.__name__}: no '{name}'")
            return cls(**kwargs)  # fields an older sender did not know take their defaults

        return decode


def _reader(names: tuple[str, ...], shape: str, unless_set: dict[str, Any] | None = None) -> Callable[[Any], Any]:
    """`obj -> [obj.a, obj.b]` (shape "[]"), `(obj.a, obj.b)` ("()") or `{"a": obj.a, "b": obj.b}` ("{}"),
    compiled once: a display of attribute reads is several times faster than attrgetter or a loop, and
    this runs for every chunk and token event of every step. `unless_set` {name: default}: None instead
    when one of those fields is not at its default."""
    unless_set = unless_set or {}
    for name in (*names, *unless_set):
        assert name.isidentifier(), name
    if shape == "{}":
        items = ", ".join(f"{name!r}: obj.{name}" for name in names)
    else:
        items = ", ".join(f"obj.{name}" for name in names) + ("," if shape == "()" and names else "")
    body = f"{shape[0]}{items}{shape[1]}"
    if unless_set:
        body += " if " + " and ".join(f"obj.{name} == defaults[{name!r}]" for name in unless_set) + " else None"
    return eval(f"lambda obj: {body}", {"defaults": unless_set})  # noqa: S307 -- field names only


_CODECS: dict[type, _Codec] = {}


def _codec(cls: type) -> _Codec:
    """Built on first use, when every class a message's fields name is defined."""
    try:
        return _CODECS[cls]
    except KeyError:
        codec = _CODECS[cls] = _Codec(cls)
        return codec


# --------------------------------------------------------------- gateway -> scheduler

# GrammarSpec.kind: a JSON schema (its JSON text), a regular expression, or a Lark grammar (llguidance's
# dialect: JSON schemas inline with %json). The gateway turns every request form (json_object, choice,
# tool_choice) into one of these.
GRAMMAR_KINDS = ("json_schema", "regex", "lark")


@dataclass
class GrammarSpec(Record):
    """A constraint on a sequence's output: the gateway checked that it compiles before enqueuing; the
    worker keeps a matcher for it and masks the logits (phaseserve/grammar.py)."""

    kind: str  # one of GRAMMAR_KINDS
    source: str



@dataclass
class LoraRef(Record):
    """A LoRA adapter a sequence runs with: its served name and the folder (PEFT's adapter_config.json and
    adapter_model.safetensors) every worker loads it from. `name` and `path` together are its identity: the
    prefix cache keys blocks by them (an adapter reloaded from another folder under the same name shares
    nothing with the old one), and a worker keeps an adapter loaded under them."""

    name: str
    path: str

    @property
    def key(self) -> str:
        return f"{self.name}\0{self.path}"


@dataclass
class SubmitRequest(Message):
    """One sequence to generate (a request with n > 1 is n of these)."""

    KIND: ClassVar[str] = "submit"
    request_id: str
    gateway_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value = served first (vLLM's convention)
    arrival_time: float = 0.0
    grammar: GrammarSpec | None = sent_if_set(None)  # structured output / forced tool call
    # tenants (docs/tenants.md): the key's tenant and its weight, which the scheduler shares tokens by; the
    # cache scope its prefix blocks are named in (the tenant, or the group the operator lets share), narrowed
    # by the request's `cache_salt`. All empty without tenants: the message is what it was.
    tenant: str = sent_if_set("")
    tenant_weight: float = sent_if_set(1.0)
    cache_scope: str = sent_if_set("")
    cache_salt: str = sent_if_set("")
    lora: LoraRef | None = sent_if_set(None)  # the adapter the request's `model` names (None: the base model)


@dataclass
class CancelRequest(Message):
    """The client went away, or a stop string matched: free the sequence."""

    KIND: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "abort"


# --------------------------------------------------------------- scheduler -> worker


@dataclass
class SeqStart(Record):
    """Tells a worker about a sequence it has not seen (new, preempted or migrated).

    `output_ids` is non-empty when the sequence is recomputed: the worker feeds
    prompt + output through prefill and continues sampling at offset len(output_ids).
    `num_cached` positions already have their KV in the sequence's blocks (moved there by a KV transfer,
    workers/kv_transfer): its first chunk starts there instead of at 0.
    `send_kv` (a prefill worker's sequence): stream the prefill's KV out as its chunks fill blocks,
    as transfer `send_kv.transfer_id`, for the decode worker the scheduler hands the sequence to.
    `cached_tokens`: how many of `num_cached` the scheduler's prefix cache found on this worker (a handoff's
    are not counted); the worker reports it with the sequence's first token, for the response's usage.
    """

    seq_id: str
    gateway_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = sent_if_set(0)
    send_kv: KVSend | None = sent_if_set(None)
    cached_tokens: int = sent_if_set(0)
    # the request's grammar: the worker builds the matcher and advances it over output_ids (a recompute or a
    # handed-over sequence continues valid)
    grammar: GrammarSpec | None = sent_if_set(None)
    lora: LoraRef | None = sent_if_set(None)  # its LoRA adapter: the worker loads it on demand (workers/lora.py)

    @property
    def num_tokens(self) -> int:
        """Positions the worker knows at start: prompt + outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

# KV transports (workers/kv_transfer): "shm" between workers on one host, "redis" between any two
KV_TRANSPORTS = ("shm", "redis")


@dataclass
class KVSend(Row):
    """Where a prefill worker ships one sequence's KV: a single-use transfer id over a transport."""

    transfer_id: str
    transport: str  # one of KV_TRANSPORTS


@dataclass
class KVReceive(Row):
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


@dataclass
class KVHandoffResult(Row):
    """How a KVReceive went, in the decode worker's StepResult (for the scheduler's handoff counters)."""

    seq_id: str
    transfer_id: str
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class ScheduledChunk(Row):
    """Run tokens [start_pos, start_pos + num_tokens) of a sequence this step.

    The tokens themselves are the worker's (prompt + outputs it sampled), so a
    decode chunk needs no token id from the scheduler. `block_table` lists the
    KV block ids covering positions [0, start_pos + num_tokens); the scheduler
    owns allocation, the worker only writes where it is told. The worker samples
    a token when the chunk reaches the end of the sequence's known tokens.

    A speculative decode (`num_draft` > 0) lets the worker verify up to `num_draft` tokens it proposes
    after the sequence's last one, in this pass. Its position is the worker's: earlier steps in flight may
    have accepted fewer than they were allowed, so `start_pos` is the highest it can be and `slack` how far
    below that it may be; the block table covers start_pos + 1 + num_draft positions (docs/speculative.md).
    """

    seq_id: str
    start_pos: int
    num_tokens: int
    block_table: list[int]
    num_draft: int = sent_if_set(0)
    slack: int = sent_if_set(0)


@dataclass
class StepPlan(Message):
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
    receives: list[KVReceive] = sent_if_set(default_factory=list)  # KV handed in from a prefill worker
    # the answer to a draining worker (WorkerInfo.draining): the scheduler holds no sequence on it any
    # more and sends it nothing after this plan, so once the plans before it are run the worker may exit
    drained: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


# --------------------------------------------------------------- worker -> gateway / scheduler


# TokenEvent.error_kind of an "error" finish: the scheduler refused to admit the sequence because its
# prompt + max_tokens can never fit a worker (max_model_len or KV cache). The request was bad input, so a
# gateway answers 400 (context_length_exceeded) with `error` as the message. Any other error (error_kind
# None) is a failure while serving: 500.
ERROR_REJECTED = "rejected"
# ... or the sequence's grammar failed at a later token (the engine refused a mask or a token the gateway's
# proof did not reach), or the worker could not prepare it within its --grammar-prepare-timeout: the
# request's grammar was bad input, a 400 naming its field (an error event in a stream), never a 500.
ERROR_GRAMMAR = "grammar"
# The scheduler dead-lettered the sequence: it was running on --quarantine-after workers that failed
# (docs/architecture.md, "Poison requests"). Not retried by clients (422): it may take the next worker down.
ERROR_QUARANTINED = "quarantined"


@dataclass
class TokenEvent(Row):
    """New output tokens of one sequence; `offset` is the index of token_ids[0] in its output.

    `logprobs`, when asked for, has one entry per token: [chosen_logprob, [[id, logprob], ...top-N]].
    `finish_reason` is "stop", "length", "abort" or "error" on the last event of a sequence.
    `error_kind` says what an "error" was (ERROR_REJECTED, ERROR_GRAMMAR, or None: a serving failure).
    `cached_tokens` (on a sequence's first token): prompt positions its prefill found in the prefix cache.
    """

    seq_id: str
    offset: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None
    error: str | None = None
    error_kind: str | None = sent_if_set(None)
    cached_tokens: int = sent_if_set(0)


@dataclass
class TokenBatch(Message):
    """All tokens of one step for one gateway: one pub/sub message per gateway per step."""

    KIND: ClassVar[str] = "tokens"
    step_id: int
    worker_id: str
    events: list[TokenEvent]


@dataclass
class SequenceProgress(Message):
    """Sequences the scheduler vouches for though they show no new token: waiting in its queue, or
    prefilling a long prompt whose chunks keep being computed. A gateway counts this as progress for its
    no-progress deadline (a slow prefill or a queue is not a stall). Sent on the gateway's channel about
    once a scheduler refresh, beside the workers' TokenBatches."""

    KIND: ClassVar[str] = "progress"
    seq_ids: list[str]


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
class StepResult(Message):
    """What a step produced, for the scheduler: sampled tokens and finished sequences."""

    KIND: ClassVar[str] = "result"
    step_id: int
    worker_id: str
    events: list[TokenEvent]
    num_tokens: int = 0
    step_time_s: float = 0.0
    epoch: int = 0  # the plan's epoch, echoed: a scheduler ignores results of another epoch's plans
    handoffs: list[KVHandoffResult] = sent_if_set(default_factory=list)  # how the plan's KVReceives went
    # (tokens, keys, prefill chunks) the step ran, when that differs from its plan (speculative decodes
    # verify as many tokens as the worker proposed): what the scheduler learns its step costs from
    ran: list[int] = sent_if_set(default_factory=list)
    # speculative decodes: seq id -> drafts the worker proposed and verified (its event's token_ids are
    # those it kept, then the token drawn after them)
    drafted: dict[str, int] = sent_if_set(default_factory=dict)
    # token masks the step computed for constrained sequences: counts per bucket of phaseserve.grammar's
    # MASK_BUCKETS_S (the last: slower than all), then the sum of their seconds
    grammar_masks: list[float] = sent_if_set(default_factory=list)
    # sequences whose sampling chunk sat out this step, their preparation (a grammar matcher) not ready:
    # seq id -> the position the worker holds it at (its next chunk must start there). Nothing of theirs
    # ran or was sampled; the scheduler plans them again from there (docs/architecture.md, "Poison requests")
    deferred: dict[str, int] = sent_if_set(default_factory=dict)


@dataclass
class WorkerInfo(Message):
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
    # the host it runs on (phaseserve/host_identity.py: hostname and network namespace, or --host-id): workers
    # on one host hand KV over through shared memory, others through Redis
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
    # speculative decoding (--speculative-config): the most tokens it verifies a step per sequence (0: off),
    # and whether the scheduler chooses fewer by acceptance and step cost (docs/speculative.md)
    speculative_tokens: int = sent_if_set(0)
    speculative_fixed: bool = sent_if_set(False)
    # the CPU threads its model runs with (torch's; 0: unknown, or CUDA), for people (the live view)
    threads: int = sent_if_set(0)
    # how many LoRA adapters it keeps loaded (--max-loras; docs/lora.md): the scheduler, which sends it every
    # sequence's adapter, follows which ones it holds and routes a sequence to a worker holding its own
    max_loras: int = sent_if_set(0)


# --------------------------------------------------------------- delivery (gateway side)

# a sequence's token log (Keys.token_log): XADD MAXLEN ~ cap in entries (one a step) and its TTL, refreshed
# on write, so a finished request can still be resumed for a while and an abandoned one goes away
TOKEN_LOG_MAXLEN = 16_384
TOKEN_LOG_TTL_S = 300


@dataclass
class GatewayInfo(Message):
    """A gateway's heartbeat (Keys.gateway_heartbeat, stored with a TTL of `lease_ttl` seconds)."""

    KIND: ClassVar[str] = "gateway"
    gateway_id: str
    pid: int = 0
    started_at: float = 0.0
    lease_ttl: float = 5.0  # its client leases (Keys.client_lease) live this long unless refreshed
    resume_grace: float = 10.0  # how long a request without a client may wait for a resume


# --------------------------------------------------------------- a worker <-> its relay process
# The two pipes between a worker's model process and its relay (workers/relay.py has the protocol). Both
# ends are one install, so these carry no version; a list is a step's traffic, a map a notice.


class PipeMessage:
    def to_pipe(self) -> bytes:
        return msgpack.packb(self.to_list() if isinstance(self, Row) else self.to_dict())


@dataclass
class RelayConfig(Record, PipeMessage):
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


@dataclass
class StepWrites(Row, PipeMessage):
    """model -> relay, one a plan: what to write for it. No result (None): the plan is only acked."""

    entry_id: bytes  # the plan's entry in `steps:<worker>`, to XACK
    result: bytes | None = None  # StepResult
    batches: list[list] = field(default_factory=list)  # [[gateway id, TokenBatch bytes], ...]
    reset: bool = False  # the plan's `reset`: a new adoption (ends a hung model's void writes)


@dataclass
class PlanDelivery(Row, PipeMessage):
    """relay -> model: a plan read from `steps:<worker>`, or (no entry id) why the relay failed."""

    entry_id: bytes | None
    data: bytes | str  # StepPlan bytes; with no entry id, the failure's message


@dataclass
class RelayNotice(Record, PipeMessage):
    """A notice on either pipe."""

    draining: bool = sent_if_set(False)  # model -> relay: SIGTERM; announce WorkerInfo.draining now
    no_scheduler: bool = sent_if_set(False)  # relay -> model: draining, and no scheduler holds the lease


def model_to_relay(data: bytes) -> StepWrites | RelayNotice:
    message = msgpack.unpackb(data)
    return RelayNotice.from_dict(message) if isinstance(message, dict) else StepWrites.from_list(message)


def relay_to_model(data: bytes) -> PlanDelivery | RelayNotice:
    message = msgpack.unpackb(data)
    return RelayNotice.from_dict(message) if isinstance(message, dict) else PlanDelivery.from_list(message)
