"""The wire contract: every message that crosses Redis, and every key name.

One module a job: `codec` (the generic msgpack codec and the protocol version), `keys` (Redis names),
the messages by direction (`to_scheduler`, `to_worker`, `from_worker`), `heartbeats`, and `relay_pipe`
(a worker's model process <-> its relay). Import from here: `from phaseserve.wire import StepPlan`.

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

from phaseserve.params import SamplingParams
from phaseserve.wire.codec import PROTOCOL_VERSION, Message, Record, Row, WireError, peek_kind, sent_if_set
from phaseserve.wire.from_worker import (ERROR_GRAMMAR, ERROR_QUARANTINED, ERROR_REJECTED, KVHandoffResult,
                                         SequenceProgress, StepResult, TokenBatch, TokenEvent, channel_message)
from phaseserve.wire.heartbeats import GatewayInfo, WorkerInfo
from phaseserve.wire.keys import (FIELD, FIELD_BYTES, OUTPUT_FIELD_PREFIX, STREAM_MAXLEN, TOKEN_LOG_MAXLEN,
                                  TOKEN_LOG_TTL_S, Keys)
from phaseserve.wire.relay_pipe import (GatewayBatch, PlanDelivery, RelayConfig, RelayNotice, StepWrites,
                                        model_to_relay, relay_to_model)
from phaseserve.wire.to_scheduler import GRAMMAR_KINDS, CancelRequest, GrammarSpec, LoraRef, SubmitRequest
from phaseserve.wire.to_worker import KV_TRANSPORTS, KVReceive, KVSend, ScheduledChunk, SeqStart, StepPlan

__all__ = [
    "PROTOCOL_VERSION", "Message", "Record", "Row", "WireError", "peek_kind", "sent_if_set", "SamplingParams",
    "FIELD", "FIELD_BYTES", "OUTPUT_FIELD_PREFIX", "STREAM_MAXLEN", "TOKEN_LOG_MAXLEN", "TOKEN_LOG_TTL_S", "Keys",
    "GRAMMAR_KINDS", "GrammarSpec", "LoraRef", "SubmitRequest", "CancelRequest",
    "KV_TRANSPORTS", "KVSend", "KVReceive", "ScheduledChunk", "SeqStart", "StepPlan",
    "ERROR_REJECTED", "ERROR_GRAMMAR", "ERROR_QUARANTINED", "KVHandoffResult", "TokenEvent", "TokenBatch",
    "SequenceProgress", "channel_message", "StepResult",
    "WorkerInfo", "GatewayInfo",
    "GatewayBatch", "RelayConfig", "StepWrites", "PlanDelivery", "RelayNotice", "model_to_relay", "relay_to_model",
]
