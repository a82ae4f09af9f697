"""The wire's bytes are pinned: every message encodes to exactly what the hand-written codecs that came
before the generic one produced (tests/data/wire_bytes.json, written by tests/wire_samples.py from that
code), so a stack mixing old and new processes keeps understanding itself."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from phaseserve import wire
from tests.wire_samples import samples

EXPECTED = json.loads((Path(__file__).parent / "data" / "wire_bytes.json").read_text())
MESSAGES = {"submit": wire.SubmitRequest, "cancel": wire.CancelRequest, "plan": wire.StepPlan,
            "tokens": wire.TokenBatch, "progress": wire.SequenceProgress, "result": wire.StepResult,
            "worker": wire.WorkerInfo, "gateway": wire.GatewayInfo}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_message_bytes_match_the_pinned_ones(name):
    data = samples()[name]
    assert data.hex() == EXPECTED[name]
    decoded = MESSAGES[name.split("_")[0]].from_wire(data)
    assert decoded.to_wire() == data  # and they read back to the same message


def test_every_top_level_message_is_pinned():
    kinds = {cls.KIND for cls in vars(wire).values() if isinstance(cls, type) and hasattr(cls, "KIND")}
    assert kinds == {cls.KIND for cls in MESSAGES.values()}


def test_older_senders_fields_take_their_defaults():
    # an older sender's StepPlan: no epoch, reset, timeout, receives or drained
    old = msgpack.packb({"step_id": 1, "worker_id": "w", "starts": [], "chunks": [["s", 0, 1, [3]]],
                         "releases": [], "v": wire.PROTOCOL_VERSION, "k": "plan"})
    plan = wire.StepPlan.from_wire(old)
    assert (plan.epoch, plan.reset, plan.timeout_s, plan.receives, plan.drained) == (0, False, 0.0, [], False)
    assert plan.chunks == [wire.ScheduledChunk("s", 0, 1, [3])]
    # a newer sender's extra trailing list item and extra key are ignored
    newer = msgpack.packb({"step_id": 1, "worker_id": "w", "events": [["s", 0, [1], None, None, None, "k", 0, "x"]],
                           "future": 1, "v": wire.PROTOCOL_VERSION, "k": "tokens"})
    assert wire.TokenBatch.from_wire(newer).events == [wire.TokenEvent("s", 0, [1], error_kind="k")]


def test_a_missing_required_field_is_a_wire_error():
    broken = msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": "submit", "request_id": "r", "gateway_id": "gw"})
    with pytest.raises(wire.WireError, match="prompt_ids"):
        wire.SubmitRequest.from_wire(broken)
    with pytest.raises(wire.WireError, match="ScheduledChunk.*block_table"):
        wire.StepPlan.from_wire(msgpack.packb({"step_id": 1, "worker_id": "w", "starts": [], "chunks": [["s", 0]],
                                               "releases": [], "v": wire.PROTOCOL_VERSION, "k": "plan"}))


# ---- the pipe between a worker and its relay process (the same install on both ends)


def test_relay_pipe_messages_keep_their_bytes():
    entry, result, batch = b"1-0", b"result bytes", b"batch bytes"
    assert wire.StepWrites(entry, result, [["gw0", batch]], True).to_pipe() == \
        msgpack.packb([entry, result, [["gw0", batch]], True])
    assert wire.StepWrites(entry).to_pipe() == msgpack.packb([entry, None, [], False])
    assert wire.RelayNotice(draining=True).to_pipe() == msgpack.packb({"draining": True})
    assert wire.RelayNotice(no_scheduler=True).to_pipe() == msgpack.packb({"no_scheduler": True})
    assert wire.PlanDelivery(entry, b"plan").to_pipe() == msgpack.packb([entry, b"plan"])
    assert wire.PlanDelivery(None, "reading plans failed").to_pipe() == msgpack.packb([None, "reading plans failed"])
    config = wire.RelayConfig("redis://x", "ps", b"info", cpus=[0, 1])
    assert config.to_pipe() == msgpack.packb({"redis_url": "redis://x", "key_prefix": "ps", "info": b"info",
                                              "heartbeat_interval": 1.0, "heartbeat_ttl": 5.0, "block_ms": 500,
                                              "log_level": "info", "log_json": False, "cpus": [0, 1],
                                              "step_timeout": 30.0})
    assert wire.RelayConfig.from_pipe(config.to_pipe()) == config


def test_relay_pipe_messages_read_back():
    # an ack written the older way, without the reset flag
    assert wire.model_to_relay(msgpack.packb([b"1-0", None, []])) == wire.StepWrites(b"1-0")
    assert wire.model_to_relay(wire.RelayNotice(draining=True).to_pipe()) == wire.RelayNotice(draining=True)
    assert wire.relay_to_model(wire.PlanDelivery(b"2-0", b"p").to_pipe()) == wire.PlanDelivery(b"2-0", b"p")
    assert wire.relay_to_model(wire.RelayNotice(no_scheduler=True).to_pipe()) == wire.RelayNotice(no_scheduler=True)


def test_a_logit_bias_travels_in_the_params_and_is_left_off_while_empty():
    from phaseserve.params import SamplingParams

    params = SamplingParams(logit_bias={17: 100.0, 3: -100.0})
    for msg in (wire.SubmitRequest("r", "gw", [1], params), wire.SeqStart("s", "gw", [1], params)):
        back = type(msg).from_wire(msg.to_wire()) if isinstance(msg, wire.Message) else \
            wire.SeqStart.from_dict(msgpack.unpackb(msgpack.packb(msg.to_dict()), strict_map_key=False))
        assert back.params.logit_bias == {17: 100.0, 3: -100.0}
    assert "logit_bias" not in wire.SubmitRequest("r", "gw", [1], SamplingParams()).to_dict()["params"]


def test_cached_tokens_travel_in_seq_start_and_token_event_and_are_left_off_while_zero():
    from phaseserve.params import SamplingParams

    start = wire.SeqStart("s", "gw", [1, 2], SamplingParams(), num_cached=16, cached_tokens=16)
    assert wire.SeqStart.from_dict(msgpack.unpackb(msgpack.packb(start.to_dict()))).cached_tokens == 16
    assert "cached_tokens" not in wire.SeqStart("s", "gw", [1], SamplingParams()).to_dict()
    batch = wire.TokenBatch(1, "w", [wire.TokenEvent("s", 0, [5], cached_tokens=32), wire.TokenEvent("t", 3, [6])])
    back = wire.TokenBatch.from_wire(batch.to_wire())
    assert [e.cached_tokens for e in back.events] == [32, 0]
    assert batch.to_dict()["events"][1] == ["t", 3, [6], None, None, None]  # the tail stays off
