"""Phase workers: prefill workers hand each sequence, after its first token, to a decode worker,
its KV moved by a transfer. Real workers, a real Redis, the scheduler service.

Greedy outputs must not depend on the topology: one mixed worker, two mixed, one prefill + one decode, one
prefill + two decode (over shared memory and over Redis), on the bundled model and on a random model with
GQA. A handoff whose transfer fails, and a prefill worker that dies mid-prompt, end in a recompute with the
same tokens."""

from __future__ import annotations

import threading
import time

import pytest

import runner_driver
from model_factory import make_model
from phaseserve.models.model_source import bundled_model_path
from phaseserve.params import SamplingParams
from phaseserve.wire import Keys
from phaseserve.scheduler.service import PolicyLimits
from service_harness import WorkerThread, start, stats, stop
from phaseserve.workers.runner import ModelRunner

# lengths around block edges (16) and past the chunk budget (64 tokens, long cap 40): a handoff's
# transfer then spans several chunks, many blocks, and a partial last block
PROMPT_LENS = [5, 16, 17, 40, 97, 150]
MAX_TOKENS = 10
TOPOLOGIES = {
    "one mixed": ("mixed",),
    "two mixed": ("mixed", "mixed"),
    "prefill + decode": ("prefill", "decode"),
    "prefill + two decode": ("prefill", "decode", "decode"),
}


def prompts(vocab_size: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab_size - 10) + 5 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module", params=["bundled", "gqa"])
def model(request, tmp_path_factory):
    if request.param == "bundled":
        path = bundled_model_path()
    else:
        path = make_model(tmp_path_factory.mktemp("gqa"), "llama_gqa_llama3")
    runner = ModelRunner(path, num_blocks=96)
    ps = prompts(runner.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = [s.outputs for s in runner_driver.run(runner, ps, params)]
    return path, ps, reference


async def run_topology(model_dir, ps, url, keys, roles, kv_transport="auto", worker_hook=None, speculative=None):
    workers = [WorkerThread(model_dir, url, keys, f"{role}{i}", num_blocks=96, role=role, speculative=speculative)
               for i, role in enumerate(roles)]
    if worker_hook:
        worker_hook(workers)
    limits = PolicyLimits(max_num_batched_tokens=64, long_prefill_threshold=40, kv_transport=kv_transport)
    client, sched, gw, tasks = await start(url, keys, limits=limits)
    try:
        await gw.wait(lambda: len(sched.workers) == len(roles), 10)
        for i, p in enumerate(ps):
            await gw.submit(f"r{i}", p, max_tokens=MAX_TOKENS)
        await gw.wait(lambda: len(gw.finish) == len(ps), 60)
        await gw.wait(lambda: sched.stats().num_running == 0, 10)
        sched.cluster.stats_dirty, sched.stats_writer.written_at = True, 0.0
        return [gw.tokens[f"r{i}"] for i in range(len(ps))], sched.stats(), gw, workers
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_greedy_outputs_do_not_depend_on_the_topology(model, topology, redis_server):
    model_dir, ps, reference = model
    roles = TOPOLOGIES[topology]
    # the second decode worker's layout goes over Redis: both transports carry real handoffs
    transport = "redis" if roles.count("decode") == 2 else "auto"
    outputs, st, gw, workers = await run_topology(model_dir, ps, redis_server, Keys("pw"), roles, transport)
    assert outputs == reference
    assert gw.conflicts == 0 and gw.duplicates == 0
    if "prefill" in roles:
        # every sequence prefilled on the prefill worker and decoded on a decode worker
        assert st.handoffs.sequences == len(ps) == st.handoffs.received
        assert st.handoffs.failed == 0 and st.handoffs.kept == 0
        bs = 16
        assert st.handoffs.blocks == sum(-(-n // bs) for n in PROMPT_LENS)
        kv = workers[0].service.runner.kv
        per_token = 2 * kv.num_layers * kv.block_shape[1] * kv.block_shape[2] * kv.dtype.itemsize
        assert st.handoffs.bytes == st.handoffs.blocks * bs * per_token
        decoded = [w.service.steps_run for w in workers if w.service.info.role == "decode"]
        assert all(n > 0 for n in decoded), decoded  # two decode workers: both take sequences
        assert workers[0].service.handoffs.num_sent == {"redis" if transport == "redis" else "shm": len(ps)}
    else:
        assert st.handoffs.sequences == 0


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_speculative_greedy_outputs_do_not_depend_on_the_topology(model, topology, redis_server):
    """Every worker speculates (the full k every step, two plans in flight); a decode worker verifies the
    drafts of the sequences handed to it. The streams equal the reference without speculation."""
    model_dir, ps, reference = model
    roles = TOPOLOGIES[topology]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    outputs, st, gw, workers = await run_topology(model_dir, ps, redis_server, Keys("ps"), roles, speculative=spec)
    assert outputs == reference
    assert gw.conflicts == 0 and gw.duplicates == 0
    assert st.spec_decoding.num_draft_tokens > 0  # with phase workers, every decode (so every draft) ran on a decode worker
    if "decode" in roles:
        assert st.handoffs.sequences == len(ps)


async def test_a_decode_worker_with_a_draft_model_gives_the_reference(model, redis_server):
    """The decode worker's draft model never saw the prompts (they were prefilled elsewhere): it catches up
    over each handed-in sequence's tokens before its first draft."""
    model_dir, ps, reference = model
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "adaptive": False}
    outputs, st, gw, _ = await run_topology(model_dir, ps, redis_server, Keys("pd"), ("prefill", "decode"),
                                            speculative=spec)
    assert outputs == reference
    assert gw.conflicts == 0 and gw.duplicates == 0
    assert st.spec_decoding.num_accepted_tokens >= 0.9 * st.spec_decoding.num_draft_tokens > 0


async def test_a_failed_transfer_is_recomputed_not_half_applied(model, redis_server):
    """The decode worker's receive of one sequence fails (as if its transfer vanished): nothing is written,
    the sequence is not started there, and the scheduler recomputes it; every output is still the reference."""
    model_dir, ps, reference = model
    failed = []

    def break_one_receive(workers):
        handoffs = workers[1].service.handoffs
        inner = handoffs._receive

        def receive(r):
            if not failed and r.num_tokens > 64:
                failed.append(r.seq_id)
                kv = handoffs.runner.kv
                before = [kv.k[0][b].clone() for b in r.block_ids]
                # the transfer's bytes are corrupted in flight: the checksum must refuse them
                if r.transport == "shm":
                    from phaseserve.workers.kv_transfer.shm_transport import transfer_path
                    with open(transfer_path(r.transfer_id, handoffs.shm_dir()), "r+b") as f:
                        f.seek(-1, 2)
                        last = f.read(1)
                        f.seek(-1, 2)
                        f.write(bytes([last[0] ^ 0xFF]))
                result = inner(r)
                assert not result.ok and "checksum" in result.error
                assert all(kv.k[0][b].equal(x) for b, x in zip(r.block_ids, before))  # nothing written
                return result
            return inner(r)
        handoffs._receive = receive

    outputs, st, gw, _ = await run_topology(model_dir, ps, redis_server, Keys("pf"), ("prefill", "decode"),
                                            worker_hook=break_one_receive)
    assert failed and outputs == reference
    assert st.handoffs.failed == 1 and st.handoffs.received == len(ps) - 1
    assert gw.conflicts == 0


async def test_a_prefill_worker_dying_mid_prompt_loses_nothing(model, redis_server):
    """The prefill worker stops answering in the middle of a long prompt's chunks (its relay killed):
    the scheduler retires it and the decode worker, now the only one, prefills and decodes everything."""
    model_dir, ps, reference = model
    keys = Keys("pk")
    workers = [WorkerThread(model_dir, redis_server, keys, "p0", num_blocks=96, role="prefill"),
               WorkerThread(model_dir, redis_server, keys, "d1", num_blocks=96, role="decode")]
    client, sched, gw, tasks = await start(redis_server, keys)
    dead = threading.Event()
    prefill = workers[0].service
    inner = prefill.runner.execute
    try:
        await gw.wait(lambda: len(sched.workers) == 2, 10)
        prefill.runner.execute = lambda plan: (time.sleep(0.02), inner(plan))[1]
        for i, p in enumerate(ps):
            await gw.submit(f"r{i}", p, max_tokens=MAX_TOKENS)
        # the longest prompt is partway through its chunks on the prefill worker
        await gw.wait(lambda: 0 < (sched.workers["p0"].policy.queues.seqs.get("r5") or type("x", (), {
            "num_computed_tokens": 0})).num_computed_tokens < PROMPT_LENS[5], 20)
        prefill.runner.execute = lambda plan: (dead.wait(), inner(plan))[1]
        prefill.link.process.kill()
        await gw.wait(lambda: len(gw.finish) == len(ps), 60)
        assert [gw.tokens[f"r{i}"] for i in range(len(ps))] == reference
        assert "p0" not in sched.workers and gw.conflicts == 0
        assert (await stats(client, keys)).get("handoff_failed", 0) == 0
    finally:
        await stop(client, sched, gw, tasks)
        prefill.request_stop()
        dead.set()
        workers[0].thread.join(10)
        workers[1].stop()


def test_the_policy_hands_off_after_the_first_token_and_recomputes_a_failed_receive():
    """The pure policy side: a prefill worker's sequence streams its KV, is never decoded there, and leaves
    with its blocks once its first token is confirmed; the decode worker starts it with its receive and
    first decode in one plan, and recomputes it if that plan samples nothing."""
    from phaseserve.wire import StepResult, SubmitRequest, TokenEvent
    from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy

    cfg = SchedulerConfig(num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4, long_prefill_threshold=0)
    src, dst = WorkerPolicy(cfg, "p", transfer_prefix="e1-1"), WorkerPolicy(cfg, "d", first_step_id=100)
    src.kv_transport = "shm"
    req = SubmitRequest("a", "gw", list(range(5, 45)), SamplingParams(max_tokens=5, temperature=0.0))
    src.add_request(req)
    plan = src.schedule()
    transfer_id = plan.starts[0].send_kv.transfer_id
    assert transfer_id.startswith("e1-1-") and plan.starts[0].send_kv.transport == "shm"
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(0, 40)]
    assert src.schedule() is None  # its prefill is planned whole: no decode on the prefill worker
    src.update(StepResult(plan.step_id, "p", [TokenEvent("a", 0, [7])]))
    assert src.ready_handoffs() == ["a"] and src.ready_handoffs() == []
    handoff = src.hand_off("a")
    assert (handoff.num_cached, handoff.output_ids) == (40, [7]) and src.num_used_blocks == 0
    assert src.schedule().releases == ["a"]

    assert dst.can_accept_handoff(handoff)
    dst.accept_handoff(handoff)
    plan = dst.schedule()
    (start,), (receive,), (chunk,) = plan.starts, plan.receives, plan.chunks
    assert (start.num_cached, start.output_ids, start.send_kv) == (40, [7], None)
    assert (receive.transfer_id, receive.num_tokens, receive.block_ids) == (transfer_id, 40, chunk.block_table[:3])
    assert (chunk.start_pos, chunk.num_tokens, len(chunk.block_table)) == (40, 1, 3)
    dst.update(StepResult(plan.step_id, "d", []))  # the receive failed: no token came
    assert dst.num_waiting == 1 and dst.num_used_blocks == 0
    plan = dst.schedule()  # the worker forgets it, then it is recomputed here: prompt + its output
    assert plan.releases == ["a"] and not plan.chunks
    plan = dst.schedule()
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(0, 41)] and not plan.receives

    # no decode worker has room: the prefill worker keeps it and decodes it (its transfer is dropped)
    src.add_request(SubmitRequest("b", "gw", list(range(5, 25)), SamplingParams(max_tokens=5, temperature=0.0)))
    plan = src.schedule()
    src.update(StepResult(plan.step_id, "p", [TokenEvent("b", 0, [9])]))
    assert src.ready_handoffs() == ["b"]
    src.keep("b")
    assert [(c.start_pos, c.num_tokens) for c in src.schedule().chunks] == [(20, 1)]


def test_a_prefill_worker_drops_only_the_transfers_nobody_will_take(tmp_path):
    """Worker side (workers/kv_handoff.py): a handed-off sequence's transfer stays for the decode worker to
    take at its release; a kept sequence's is removed at its first decode here, and so is that of a sequence
    whose first token was its last."""
    from phaseserve.wire import KVSend, ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.kv_handoff import KVHandoffs
    from phaseserve.workers.kv_transfer.shm_transport import transfer_path

    runner = ModelRunner(bundled_model_path(), num_blocks=16)
    handoffs = KVHandoffs(runner)
    ids = {name: f"keep-test-{name}-{time.monotonic_ns()}" for name in ("handed", "kept", "last")}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    starts = [SeqStart(name, "gw", list(range(5, 25)), SamplingParams(max_tokens=1, temperature=0.0)
                       if name == "last" else params, send_kv=KVSend(ids[name], "shm")) for name in ids]
    tables = {name: [2 * i, 2 * i + 1] for i, name in enumerate(ids)}
    step = 0

    def run(**kw):
        nonlocal step
        step += 1
        plan = StepPlan(step, "p", **kw)
        handoffs.before_step(plan)
        runner.execute(plan)
        handoffs.after_step(plan)

    try:
        run(starts=starts, chunks=[ScheduledChunk(n, 0, 20, tables[n]) for n in ids])
        d = handoffs.shm_dir()
        assert all(transfer_path(t, d).exists() for t in ids.values())  # all closed with the first token
        run(chunks=[ScheduledChunk("kept", 20, 1, tables["kept"])], releases=["handed", "last"])
        assert transfer_path(ids["handed"], d).exists()  # the decode worker's to take
        assert not transfer_path(ids["kept"], d).exists() and not transfer_path(ids["last"], d).exists()
    finally:
        for t in ids.values():
            transfer_path(t, handoffs.shm_dir()).unlink(missing_ok=True)
