"""The pipe between a worker's model process and its relay carries typed records: a step's writes name each
gateway's token batch (GatewayBatch), in the bytes the pair `[gateway id, bytes]` always had."""

from __future__ import annotations

import msgpack

from phaseserve.wire import GatewayBatch, StepWrites, model_to_relay


def test_a_step_s_gateway_batches_are_typed_both_ways_in_the_pair_s_bytes():
    writes = StepWrites(b"7-0", b"result", [GatewayBatch("gw-a", b"tokens a"), GatewayBatch("gw-b", b"tokens b")])
    data = writes.to_pipe()
    assert data == msgpack.packb([b"7-0", b"result", [["gw-a", b"tokens a"], ["gw-b", b"tokens b"]], False])
    back = model_to_relay(data)
    assert back == writes
    assert [type(b) for b in back.batches] == [GatewayBatch, GatewayBatch]
    assert [(b.gateway_id, b.token_batch) for b in back.batches] == [("gw-a", b"tokens a"), ("gw-b", b"tokens b")]


def test_an_ack_has_no_batches():
    back = model_to_relay(StepWrites(b"8-0").to_pipe())
    assert (back.entry_id, back.result, back.batches, back.reset) == (b"8-0", None, [], False)
