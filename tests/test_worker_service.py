"""The worker service over a real Redis: heartbeat, one plan in -> one TokenBatch per gateway +
one StepResult out, acked; and the heartbeat goes away on stop."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import msgpack
import pytest
import redis

from phaseserve.kernels import native
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import FIELD, Keys, ScheduledChunk, SeqStart, StepPlan, StepResult, TokenBatch, WorkerInfo
from phaseserve.workers.runner import ModelRunner
from phaseserve.workers.service import WorkerService


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return ModelRunner(make_model(tmp_path_factory.mktemp("m"), "llama"), num_blocks=32)


def test_worker_runs_plans_and_routes_tokens_per_gateway(runner, redis_server):
    keys = Keys("t")
    client = redis.Redis.from_url(redis_server)
    service = WorkerService(runner, redis_server, keys, "w1", heartbeat_interval=0.1, heartbeat_ttl=1.0, block_ms=50)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while client.get(keys.worker_heartbeat("w1")) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        info = WorkerInfo.from_wire(client.get(keys.worker_heartbeat("w1")))
        assert (info.num_blocks, info.block_size) == (32, runner.block_size)
        assert client.sismember(keys.workers, "w1")
        ttl_ms = client.pttl(keys.worker_heartbeat("w1"))
        assert 0 < ttl_ms <= 1000

        pubsub = client.pubsub()
        pubsub.subscribe(keys.gateway_channel("gwA"), keys.gateway_channel("gwB"))
        while pubsub.get_message(timeout=1.0) is not None:  # drain the subscribe confirmations
            pass
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        starts = [SeqStart("a", "gwA", [5, 6, 7], params), SeqStart("b", "gwB", [8, 9], params)]
        plan = StepPlan(0, "w1", starts, [ScheduledChunk("a", 0, 3, [0]), ScheduledChunk("b", 0, 2, [1])])
        client.xadd(keys.steps("w1"), {FIELD: plan.to_wire()})

        got = {}
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=1.0)
            if msg and msg["type"] == "message":
                got[msg["channel"].decode()] = TokenBatch.from_wire(msg["data"])
        assert set(got) == {keys.gateway_channel("gwA"), keys.gateway_channel("gwB")}
        (ev_a,) = got[keys.gateway_channel("gwA")].events
        (ev_b,) = got[keys.gateway_channel("gwB")].events
        assert (ev_a.seq_id, ev_a.offset, len(ev_a.token_ids)) == ("a", 0, 1)
        assert (ev_b.seq_id, ev_b.offset, len(ev_b.token_ids)) == ("b", 0, 1)

        entries = client.xrange(keys.results)
        assert len(entries) == 1
        result = StepResult.from_wire(entries[0][1][FIELD.encode()])
        assert result.step_id == 0 and result.worker_id == "w1"
        assert {e.seq_id: e.token_ids for e in result.events} == {"a": ev_a.token_ids, "b": ev_b.token_ids}
        pending = client.xpending(keys.steps("w1"), keys.worker_group)
        assert pending["pending"] == 0
        pubsub.close()
    finally:
        service.request_stop()
        thread.join(10)
    assert not thread.is_alive()
    assert client.get(keys.worker_heartbeat("w1")) is None
    assert not client.sismember(keys.workers, "w1")


def test_worker_reads_plans_ahead_and_publishes_in_step_order(runner, redis_server):
    """Two plans queued at once (what two plans in flight look like): both run, and their results and
    token batches arrive in step order, every plan acked."""
    keys = Keys("ahead")
    client = redis.Redis.from_url(redis_server)
    service = WorkerService(runner, redis_server, keys, "w2", heartbeat_interval=0.1, heartbeat_ttl=1.0, block_ms=50)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while client.get(keys.worker_heartbeat("w2")) is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the heartbeat comes after the steps group is joined
    pubsub = client.pubsub()
    pubsub.subscribe(keys.gateway_channel("gw"))
    while pubsub.get_message(timeout=1.0) is not None:
        pass
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prefill = StepPlan(0, "w2", [SeqStart("s", "gw", [5, 6, 7], params)], [ScheduledChunk("s", 0, 3, [0])])
    decode = StepPlan(1, "w2", [], [ScheduledChunk("s", 3, 1, [0])])
    pipe = client.pipeline(transaction=False)
    for plan in (prefill, decode):
        pipe.xadd(keys.steps("w2"), {FIELD: plan.to_wire()})
    pipe.execute()
    try:
        batches = []
        deadline = time.monotonic() + 20
        while len(batches) < 2 and time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=1.0)
            if msg and msg["type"] == "message":
                batches.append(TokenBatch.from_wire(msg["data"]))
        assert [b.step_id for b in batches] == [0, 1]
        assert [(b.events[0].offset, len(b.events[0].token_ids)) for b in batches] == [(0, 1), (1, 1)]
        deadline = time.monotonic() + 5
        while client.xpending(keys.steps("w2"), keys.worker_group)["pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        results = [StepResult.from_wire(f[FIELD.encode()]) for _id, f in client.xrange(keys.results)]
        assert [r.step_id for r in results] == [0, 1]
        assert client.xpending(keys.steps("w2"), keys.worker_group)["pending"] == 0
        pubsub.close()
    finally:
        service.request_stop()
        thread.join(10)
    assert not thread.is_alive()


def test_keep_heap_memory_sets_glibc_malloc_options():
    from phaseserve.workers.cpu_memory import keep_heap_memory

    assert keep_heap_memory() is True  # glibc (Linux): every mallopt accepted


def test_the_fallback_by_size_leaves_a_core_only_for_small_models():
    from phaseserve.cpus import LARGE_MODEL_BYTES, auto_threads

    assert auto_threads(3, cores=2, weight_bytes=0) == 3  # an explicit setting wins
    assert auto_threads(0, cores=2, weight_bytes=11 << 20) == 1  # overhead-bound: leave a core
    assert auto_threads(0, cores=2, weight_bytes=LARGE_MODEL_BYTES) == 2  # compute-bound: every core
    assert auto_threads(0, cores=1, weight_bytes=0) == 1


def test_cpu_lists_parse_numbers_and_ranges_strictly():
    # the one parser of --relay-cpus and bench's --client-cpus; the launcher writes lists joined by ","
    from phaseserve.procs import parse_cpus

    assert parse_cpus(None) is None and parse_cpus("") is None
    assert parse_cpus("1") == [1] and parse_cpus("0,2") == [0, 2] and parse_cpus("2-3") == [2, 3]
    assert parse_cpus("3, 2,3") == [2, 3] and parse_cpus("0,4-5") == [0, 4, 5]
    for bad in ("a", "1;2", "3-1", "-1", "1-", ",", "1-2-3"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_core_placement_gives_a_small_model_worker_cores_of_its_own(monkeypatch, tmp_path):
    from phaseserve.stack import launcher

    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)  # a small model: auto threads = cores - 1
    values = {"bind_cores": True, "num_threads": 0, "model": str(tmp_path)}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1, 2, 3])
    assert launcher.core_placement(values) == {"worker": [0, 1, 2], "relay": [3], "gateway": [3],
                                               "scheduler": [3], "redis": [3]}
    assert launcher.core_placement({**values, "num_threads": 1})["worker"] == [0]
    assert launcher.core_placement({**values, "num_threads": 4}) is None  # the worker wants every core
    assert launcher.core_placement({**values, "bind_cores": False}) is None
    monkeypatch.setattr(launcher, "usable_cores", lambda: [5])
    assert launcher.core_placement(values) is None  # one core: nothing to split


def test_each_step_is_logged_at_debug_level_for_the_step_trace(runner, redis_server):
    """At debug level the worker logs one line per step (decodes, prefill tokens, context, model time),
    which bench.step_trace groups; at info level it computes none of it."""
    from structlog.testing import capture_logs

    from bench import step_trace

    service = WorkerService(runner, redis_server, Keys("trace"), "w9")
    assert not service.log_steps  # the tests' root logger is not at debug level
    service.log_steps = True
    relay_end, service.link.writes = Pipe(duplex=False)  # what the relay would read
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    starts = [SeqStart("p", "gw", list(range(3, 15)), params), SeqStart("q", "gw", [8, 9], params)]
    plans = [StepPlan(0, "w9", starts, [ScheduledChunk("p", 0, 12, [2]), ScheduledChunk("q", 0, 2, [3])]),
             StepPlan(1, "w9", [], [ScheduledChunk("p", 12, 1, [2]), ScheduledChunk("q", 2, 1, [3])])]
    with capture_logs() as logs:
        for i, plan in enumerate(plans):
            service.run_step(f"0-{i}".encode(), plan.to_wire())
    for i in range(2):  # each step's writes: the plan's entry id, its result, one token batch for "gw"
        entry_id, result, batches, reset = msgpack.unpackb(relay_end.recv_bytes())
        assert entry_id == f"0-{i}".encode() and StepResult.from_wire(result).step_id == i and reset is False
        assert [gw for gw, _ in batches] == ["gw"]
    steps = [e for e in logs if e["event"] == "step"]
    assert [(s["step_id"], s["decodes"], s["prefill_tokens"], s["context"]) for s in steps] == \
        [(0, 0, 14, 12), (1, 2, 0, 0)]
    assert all(s["step_ms"] > 0 and s["log_level"] == "debug" for s in steps)
    groups = {g.name: g for g in step_trace.summarize(steps, long_context=10)}
    assert set(groups) == {"decodes only", "prefill, context >= 10"}
    assert groups["decodes only"].decodes == [2] and groups["prefill, context >= 10"].prefill == [14]
    assert "| decodes only | 1 |" in step_trace.table(list(groups.values()))


def test_a_worker_whose_relay_dies_stops_with_an_error(runner, redis_server):
    """The relay is the worker's only way to Redis: if it dies, the model loop raises RelayError
    (main() exits 1, so the launcher sees it) instead of waiting for plans that cannot come."""
    from phaseserve.workers.relay_link import RelayError

    keys = Keys("relay-dies")
    client = redis.Redis.from_url(redis_server)
    service = WorkerService(runner, redis_server, keys, "w3", heartbeat_interval=0.1, heartbeat_ttl=1.0, block_ms=50)
    errors: list[Exception] = []

    def run():
        try:
            service.run()
        except RelayError as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while client.get(keys.worker_heartbeat("w3")) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.link.process is not None and service.link.process.poll() is None
    service.link.process.kill()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and "relay process exited" in str(errors[0])


def test_the_worker_drops_plans_of_an_older_epoch_and_forgets_everything_on_a_reset(runner, redis_server):
    """Epoch fencing: after a plan of epoch 5 one of epoch 3 (a deposed scheduler's) is acked only. A
    reset plan (the first of an adoption) makes the runner forget the sequences it held."""
    service = WorkerService(runner, redis_server, Keys("epochs"), "w8")
    relay_end, service.link.writes = Pipe(duplex=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plans = [StepPlan(0, "w8", [SeqStart("e", "gw", [5, 6, 7], params)], [ScheduledChunk("e", 0, 3, [4])], epoch=5),
             StepPlan(1, "w8", [], [ScheduledChunk("e", 3, 1, [4])], epoch=3),  # older: dropped
             StepPlan(2, "w8", [], [ScheduledChunk("e", 3, 1, [4])], epoch=5),
             StepPlan(-1, "w8", epoch=6, reset=True)]
    for i, plan in enumerate(plans):
        service.run_step(f"0-{i}".encode(), plan.to_wire())
    writes = [msgpack.unpackb(relay_end.recv_bytes()) for _ in plans]
    assert [w[1] is None for w in writes] == [False, True, False, False]  # the old-epoch plan: ack only
    results = [StepResult.from_wire(w[1]) for w in writes if w[1] is not None]
    assert [(r.step_id, r.epoch, len(r.events)) for r in results] == [(0, 5, 1), (2, 5, 1), (-1, 6, 0)]
    assert writes[3][3] is True and "e" not in runner.seqs and service.epoch == 6


def test_the_relay_judges_the_models_liveness_by_its_steps():
    """A plan is due when handed over or when the step before it is written back; past step_timeout the
    model is hung: its writes are void until a reset plan, and the incarnation counts the new life."""
    from phaseserve.workers.model_liveness import ModelLiveness

    live = ModelLiveness(step_timeout=1.0)
    assert not live.check(100.0)  # idle: nothing due, never hung
    live.plan_delivered(100.0)
    live.plan_delivered(100.2)  # read ahead: due only once the first is written back
    assert live.step_written(100.9, reset=False) == (True, False)
    assert not live.check(101.8)  # the second became due at 100.9
    assert live.check(102.0) and live.is_hung() and live.incarnation == 1
    assert live.step_written(105.0, reset=False) == (False, False)  # the late step: void, but moving again
    assert not live.is_hung()
    live.plan_delivered(105.1)  # a plan of the old life still queued: void too
    assert live.step_written(105.2, reset=False) == (False, False)
    live.plan_delivered(105.3)
    assert live.step_written(105.4, reset=True) == (True, False)  # the new life's first plan
    live.plan_delivered(106.0)
    assert live.step_written(107.5, reset=False) == (False, True)  # found overdue when it came back
    assert live.incarnation == 2
    live.plan_delivered(107.6)
    assert live.step_written(107.7, reset=True) == (True, False)
    live.plan_delivered(108.0, timeout=5.0)  # a long step: the scheduler gave it a longer deadline
    assert not live.check(112.0) and live.check(113.5)


def test_a_plan_carries_its_deadline_to_the_relay():
    from phaseserve.workers.model_liveness import plan_timeout

    assert plan_timeout(StepPlan(0, "w", timeout_s=42.0).to_wire()) == 42.0
    assert plan_timeout(b"\xc1 garbage") == 0.0  # the model acks an unreadable plan at once


def test_first_heartbeat_comes_after_every_kernel_is_loaded_and_says_which(tmp_path, redis_server, monkeypatch):
    """A worker compiles or loads its kernels before it announces itself (none compiles inside a step, where a
    compile overran the step deadline), and its heartbeat says the dtype, CPU level and implementations."""
    from phaseserve.kernels import cpu_isa
    from service_harness import WorkerProcess

    extensions = tmp_path / "torch_extensions"  # empty: every native op this worker runs is compiled anew
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    model = make_model(tmp_path / "m", "llama_linear_head_dim", dtype="bfloat16")  # head_dim 32: native attention
    keys = Keys("warm")
    client = redis.Redis.from_url(redis_server)
    worker = WorkerProcess(model, redis_server, keys, "w-warm", tmp_path / "worker.log")

    def built() -> set[str]:
        return {p.name.split("-")[0].removeprefix("phaseserve_") for p in (extensions / "phaseserve").glob("phaseserve_*")}

    try:
        deadline = time.monotonic() + 300  # compiling four ops on a busy machine
        while (raw := client.get(keys.worker_heartbeat("w-warm"))) is None:
            assert worker.proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.05)
        at_heartbeat = built()
        info = WorkerInfo.from_wire(raw)
        assert info.cpu_level == cpu_isa.level()
        if cpu_isa.supports("avx512-bf16"):
            assert info.dtype == "bfloat16"
            assert info.kernels == {f: "native avx512-bf16" for f in ("attention", "layer_ops", "linear")}
            # the ops it runs (quant_gemm too, compiled beside them while the model loaded: every bf16 op)
            assert {"bf16_gemm", "decode_attention", "extend_attention", "layer_ops"} <= at_heartbeat
        else:  # bf16 is emulated here: float32 activations, and only ops of this level or below
            assert info.dtype == "float32" and set(info.kernels) == {"attention", "layer_ops", "linear"}
            assert all(v in ("torch", f"native {cpu_isa.level()}") for v in info.kernels.values()), info.kernels
            assert all(cpu_isa.supports(native.REQUIRES[op]) for op in at_heartbeat)

        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        client.xadd(keys.steps("w-warm"), {FIELD: StepPlan(0, "w-warm", [SeqStart("a", "gw", [5, 6, 7], params)],
                                                           [ScheduledChunk("a", 0, 3, [0])]).to_wire()})
        client.xadd(keys.steps("w-warm"), {FIELD: StepPlan(1, "w-warm", [], [ScheduledChunk("a", 3, 1, [0])]).to_wire()})
        deadline = time.monotonic() + 60
        while len(client.xrange(keys.results)) < 2:
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.05)
        assert built() == at_heartbeat  # the steps compiled nothing
        log = (tmp_path / "worker.log").read_text()
        assert "native op compiled" not in log.split("worker ready", 1)[1]
    finally:
        worker.stop()


def test_the_kernels_reported_are_the_op_families_the_model_uses(tmp_path):
    from phaseserve.kernels import cpu_isa

    for op in native.runnable():  # every op this CPU runs loaded in this process, bf16 ones included
        native.load(op)
    model = make_model(tmp_path / "m", "llama")  # float32
    dense = ModelRunner(model, num_blocks=8).warm_up()
    quantized = ModelRunner(model, num_blocks=8, quantization="int8").warm_up()  # every linear int8
    assert set(dense) == {"attention", "layer_ops", "linear"}
    assert set(quantized) == {"attention", "layer_ops", "quant_linear"}
    # float32 activations run the float32 (AVX2) ops where this CPU runs them, never the bf16 ones
    allowed = {"torch"} | ({"native avx2"} if cpu_isa.supports("avx2") else set())
    if cpu_isa.level() == "avx2":  # there `auto` quantizes the activations to int8, and the report says so
        assert quantized.pop("quant_linear") == "native avx2, int8 activations"
    assert set(dense.values()) | set(quantized.values()) <= allowed


def test_a_sequence_the_model_cannot_embed_fails_alone_not_its_batch(runner):
    """A plan whose batch holds a sequence with a token id outside the vocabulary (a scheduler that did not
    check it): that sequence gets an error event, the others in the same forward pass their tokens."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    runner.reset()
    expected = runner.execute(StepPlan(0, "w", [SeqStart("ok", "g", [5, 6, 7], params)],
                                       [ScheduledChunk("ok", 0, 3, [0])])).events
    runner.reset()
    starts = [SeqStart("ok", "g", [5, 6, 7], params), SeqStart("bad", "g", [1, runner.vocab_size + 5], params)]
    result = runner.execute(StepPlan(1, "w", starts, [ScheduledChunk("ok", 0, 3, [0]),
                                                      ScheduledChunk("bad", 0, 2, [1])]))
    by_seq = {e.seq_id: e for e in result.events}
    assert by_seq["ok"].token_ids == expected[0].token_ids and by_seq["ok"].finish_reason is None
    assert by_seq["bad"].finish_reason == "error" and "outside the vocabulary" in by_seq["bad"].error
    # its later chunks are skipped; the good one goes on decoding
    later = runner.execute(StepPlan(2, "w", chunks=[ScheduledChunk("ok", 3, 1, [0]), ScheduledChunk("bad", 2, 1, [1])]))
    assert [e.seq_id for e in later.events] == ["ok"]
    runner.reset()


def test_a_plan_delivered_twice_runs_once(runner, redis_server):
    """A Redis failover can roll a steps stream back to before the relay's read (the promoted replica had
    not seen it), so a plan already run is read again: acked only, the sequence's tokens are not sampled
    twice. A new scheduler (epoch) or adoption (reset) starts its step ids over, and is run."""
    service = WorkerService(runner, redis_server, Keys("twice"), "w7")
    relay_end, service.link.writes = Pipe(duplex=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = StepPlan(0, "w7", [SeqStart("d", "gw", [5, 6, 7], params)], [ScheduledChunk("d", 0, 3, [4])], epoch=5)
    decode = StepPlan(1, "w7", [], [ScheduledChunk("d", 3, 1, [4])], epoch=5)
    plans = [first, decode, first, decode,  # read again after a rollback: dropped
             StepPlan(-1, "w7", epoch=6, reset=True),
             StepPlan(0, "w7", [SeqStart("d", "gw", [5, 6, 7], params)], [ScheduledChunk("d", 0, 3, [4])], epoch=6)]
    for i, plan in enumerate(plans):
        service.run_step(f"0-{i}".encode(), plan.to_wire())
    writes = [msgpack.unpackb(relay_end.recv_bytes()) for _ in plans]
    assert [w[1] is None for w in writes] == [False, False, True, True, False, False]
    results = [StepResult.from_wire(w[1]) for w in writes if w[1] is not None]
    assert [(r.step_id, r.epoch) for r in results] == [(0, 5), (1, 5), (-1, 6), (0, 6)]
    # the new scheduler's prefill sampled the same first token as the first one's
    assert results[3].events[0].token_ids == results[0].events[0].token_ids
