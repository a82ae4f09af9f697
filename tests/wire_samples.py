"""One sample of every wire message, built through the constructors (an API older code shares), for
tests/test_wire_bytes.py. `python tests/wire_samples.py > tests/data/wire_bytes.json`, run against the
code whose bytes are to be pinned, writes the expected bytes."""

from __future__ import annotations

import json

from phaseserve.params import SamplingParams
from phaseserve.wire import (CancelRequest, GatewayInfo, KVHandoffResult, KVReceive, KVSend, LoraRef,
                             ScheduledChunk, SeqStart, SequenceProgress, StepPlan, StepResult, SubmitRequest,
                             TokenBatch, TokenEvent, WorkerInfo)

PARAMS = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop_token_ids=[2, 3],
                        logprobs=2, min_tokens=1)


def samples() -> dict[str, bytes]:
    """name -> the message's bytes on the wire."""
    events = [TokenEvent("s0", 4, [11, 12]), TokenEvent("s1", 0, [9], "stop", [[-0.5, [[9, -0.5], [4, -1.5]]]]),
              TokenEvent("s2", 7, [], "error", None, "too long", "rejected")]
    starts = [SeqStart("s3", "gw0", [1, 2, 3], PARAMS),
              SeqStart("s4", "gw1", [5, 6], SamplingParams(), [7, 8], num_cached=32, send_kv=KVSend("t1", "shm"))]
    chunks = [ScheduledChunk(f"s{i}", 100 + i, 1, list(range(i, i + 7))) for i in range(3)] + \
        [ScheduledChunk("s3", 0, 3, [40])]
    return {
        "submit": SubmitRequest("r1", "gw0", [1, 2, 3], PARAMS, priority=2, arrival_time=12.5).to_wire(),
        "submit_defaults": SubmitRequest("r2", "gw0", [4], SamplingParams()).to_wire(),
        "submit_tenant": SubmitRequest("r3", "gw0", [5, 6], SamplingParams(), tenant="team-a", tenant_weight=2.0,
                                       cache_scope="shared", cache_salt="s1").to_wire(),
        "cancel": CancelRequest("r1", "stop_string").to_wire(),
        "plan": StepPlan(9, "w0", starts, chunks, ["s9"], epoch=3, timeout_s=1.5,
                         receives=[KVReceive("s4", "t0", "redis", [1, 2], 32, 3.0)]).to_wire(),
        "plan_bare": StepPlan(-1, "w1", epoch=2, reset=True).to_wire(),
        "plan_drained": StepPlan(-1, "w1", epoch=2, drained=True).to_wire(),
        "tokens": TokenBatch(9, "w0", events).to_wire(),
        "progress": SequenceProgress(["s5", "s6"]).to_wire(),
        "result": StepResult(9, "w0", events, 5, 0.0125, 3).to_wire(),
        "result_handoffs": StepResult(9, "w0", [], 0, 0.5, 3, [KVHandoffResult("s4", "t0", True, 2, 4096, 0.01),
                                                                  KVHandoffResult("s5", "t2", False, error="x")]).to_wire(),
        # a step that sat a sequence out (its grammar not ready), added after protocol 1 was pinned
        "result_deferred": StepResult(9, "w0", [TokenEvent("s0", 4, [11])], 1, 0.01, 3, deferred={"s6": 40}).to_wire(),
        "worker": WorkerInfo("w0", "mixed", "m", 64, 16, 2048, 77, 1.5, 900, "host-a", True, "bfloat16", "avx2",
                             {"attention": "native avx2"}, 32000).to_wire(),
        "worker_defaults": WorkerInfo("w1", "decode", "m", 8, 16, 256).to_wire(),
        # the LoRA fields (sent only when set): a request for an adapter, its start on a worker, a worker holding it
        "submit_lora": SubmitRequest("r3", "gw0", [4], SamplingParams(), lora=LoraRef("sql", "/a/sql")).to_wire(),
        "plan_lora": StepPlan(10, "w0", [SeqStart("s7", "gw0", [4], SamplingParams(),
                                                  lora=LoraRef("sql", "/a/sql"))]).to_wire(),
        "worker_lora": WorkerInfo("w2", "mixed", "m", 8, 16, 256, max_loras=4).to_wire(),
        "gateway": GatewayInfo("gw0", 55, 3.25, 4.0, 9.0).to_wire(),
    }


if __name__ == "__main__":
    print(json.dumps({k: v.hex() for k, v in samples().items()}, indent=1))
