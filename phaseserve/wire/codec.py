"""The wire's codec: one generic encoding of every message from its dataclass fields.

msgpack everywhere. Each message is a dataclass with `to_wire()` (bytes) and `from_wire(bytes)`; the payload
carries the protocol version and the message kind, so a receiver rejects what it does not understand instead
of guessing. No message has a hand-written codec: `_Codec` (below) reads its dataclass fields in declaration
order. A top-level `Message` is a map of field names; a `Record` nested in one is a map too; a `Row` (many of
them a message: chunks, token events) is a list, positional. Receiving, a field that is missing takes its
default (an older sender), unknown keys and trailing list items are ignored (a newer one). Adding a field: give
it a default, at the end of a Row, and `sent_if_set()` if older receivers must keep getting exactly the bytes
they know unless it is used.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Self

import msgpack

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """A payload that is not a message of this protocol version."""


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
    if origin is list and args and _is_named_tuple(args[0]):  # msgpack packs a tuple as it is, reads a list
        make = args[0]._make
        return None, (lambda xs: [make(x) for x in xs])
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


def _is_named_tuple(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")


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
