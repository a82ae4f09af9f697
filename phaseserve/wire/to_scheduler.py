"""gateway -> scheduler, on the stream `requests`: sequences to generate, and cancels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phaseserve.params import SamplingParams
from phaseserve.wire.codec import Message, Record, sent_if_set

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
