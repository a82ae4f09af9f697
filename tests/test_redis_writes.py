"""The scheduler's typed writes (scheduler/redis_writes.py) on a real Redis: what the cluster decides about a
request's record, its client and its workers lands as the commands a takeover, a gateway and a worker read
back (scheduler/leadership.py, phaseserve/token_log.py, the steps stream)."""

from __future__ import annotations

import redis.asyncio as aioredis

from phaseserve import token_log
from phaseserve.params import SamplingParams
from phaseserve.wire import FIELD_BYTES, ERROR_QUARANTINED, Keys, StepPlan, SubmitRequest, TokenBatch, WorkerInfo
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.scheduler.leadership import confirmed_outputs
from phaseserve.scheduler.quarantine import STRIKES_FIELD
from phaseserve.scheduler.redis_writes import DeadLetter, LogAbort, SaveSubmit, SendPlan, queue_writes
from phaseserve.scheduler.request_book import OUTPUTS_PER_WRITE

KEYS = Keys("writes")


def submit(rid: str) -> SubmitRequest:
    return SubmitRequest(rid, "gw1", [1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0))


async def send(client: aioredis.Redis, ops: list) -> list:
    pipe = client.pipeline(transaction=False)
    queue_writes(pipe, KEYS, ops)
    assert ops == []  # queued once: a retried turn does not send them twice
    return await pipe.execute()


async def test_a_requests_record_as_the_cluster_writes_it_is_what_a_takeover_reads(redis_server):
    client = aioredis.Redis.from_url(redis_server)
    c = Cluster(KEYS, PolicyLimits())
    c.add_worker(WorkerInfo("w1", "mixed", "m", 64, 16, 2048, 1, 1.0), epoch=1)
    req = submit("r1")
    try:
        c.ops.append(SaveSubmit(KEYS.request_record("r1"), req.to_wire()))
        assert c.admit(req)
        book = c.book
        tokens = list(range(100, 100 + OUTPUTS_PER_WRITE + 3))
        book.confirmed("r1", tokens[:OUTPUTS_PER_WRITE - 1])  # under a run: not written yet
        book.confirmed("r1", tokens[:OUTPUTS_PER_WRITE])
        book.confirmed("r1", tokens)  # three more: under the next run
        c.quarantine.strike("r1")
        book.strike_recorded("r1")
        await send(client, c.ops)
        record = await client.hgetall(KEYS.request_record("r1"))
        assert SubmitRequest.from_wire(record[b"submit"]) == req
        assert record[b"worker"] == b"w1"
        assert confirmed_outputs(record) == tokens[:OUTPUTS_PER_WRITE]
        assert record[STRIKES_FIELD.encode()] == b"1"
        book.finished("r1")
        await send(client, c.ops)
        assert not await client.exists(KEYS.request_record("r1"))
    finally:
        await client.aclose()


async def test_an_error_and_an_abort_reach_the_token_log_and_the_error_the_gateway_channel(redis_server):
    client = aioredis.Redis.from_url(redis_server)
    pubsub = client.pubsub()
    c = Cluster(KEYS, PolicyLimits())
    try:
        await pubsub.subscribe(KEYS.gateway_channel("gw1"))
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        c.book.fail_request(submit("bad"), "it took two workers down", ERROR_QUARANTINED)
        c.ops.append(LogAbort("orphan"))
        await send(client, c.ops)
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        [event] = TokenBatch.from_wire(message["data"]).events
        assert (event.seq_id, event.error, event.error_kind) == ("bad", "it took two workers down", ERROR_QUARANTINED)
        for rid in ("bad", "orphan"):  # a client resuming later reads the end, not silence
            tokens, ended = token_log.replay(await client.xrange(KEYS.token_log(rid)))
            assert tokens == [] and ended, rid
    finally:
        await pubsub.aclose()
        await client.aclose()


async def test_a_drained_plan_and_a_dead_letter_land_in_their_streams(redis_server):
    client = aioredis.Redis.from_url(redis_server)
    try:
        plan = StepPlan(-1, "w1", epoch=7, drained=True)
        await send(client, [SendPlan(KEYS.steps("w1"), plan.to_wire()),
                            DeadLetter(KEYS.requests, b"\xc1", "5-0", "WireError: unreadable")])
        [(_id, fields)] = await client.xrange(KEYS.steps("w1"))
        sent = StepPlan.from_wire(fields[FIELD_BYTES])
        assert sent.drained and sent.epoch == 7 and sent.step_id == -1
        [(_id, dead)] = await client.xrange(KEYS.dead_letters)
        assert dead == {FIELD_BYTES: b"\xc1", b"stream": KEYS.requests.encode(), b"entry_id": b"5-0",
                        b"reason": b"WireError: unreadable"}
    finally:
        await client.aclose()
