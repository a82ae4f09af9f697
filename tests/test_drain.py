"""Workers joining and leaving a running server: a worker added mid-run takes new
sequences within a second of its first heartbeat; a worker given SIGTERM drains (its waiting sequences move
at once, its running ones finish there or, past --drain-timeout, are recomputed elsewhere) and loses no
request, even when it is the only worker. Real Redis, real worker processes on the bundled model in
float32 (greedy outputs then equal the unfaulted run token for token), the scheduler in this event loop."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

import runner_driver
from phaseserve.params import SamplingParams
from phaseserve.wire import Keys, WorkerInfo
from phaseserve.scheduler.service import PolicyLimits
from service_harness import Gateway, WorkerProcess, start, stop
from service_harness import stats as stats_of
from phaseserve.workers.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21], [30, 31, 32, 33, 34], [40, 41],
           [50, 51, 52], [60, 61, 62, 63]]
LONG = 300  # tokens: a stream runs for seconds, well past a SIGTERM
WORKER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "16MiB")
# two running sequences a worker at most: a worker with more sequences than that holds waiting ones
TWO_SEQS = PolicyLimits(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_threshold=40)


@pytest.fixture(scope="module")
def reference(e2e_model):
    runner = ModelRunner(e2e_model, dtype="float32", num_blocks=512)
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    return {f"r{i}": s.outputs for i, s in enumerate(runner_driver.run(runner, PROMPTS, params))}


def worker(e2e_model, url: str, keys: Keys, wid: str, tmp_path, *args: str) -> WorkerProcess:
    return WorkerProcess(e2e_model, url, keys, wid, tmp_path / f"{wid}.log", *WORKER_ARGS, *args)


async def exited(w: WorkerProcess, gw: Gateway, timeout: float) -> int:
    """Wait (without blocking the scheduler in this loop) for the worker process to exit; its exit code."""
    await gw.wait(lambda: w.proc.poll() is not None, timeout)
    return w.proc.returncode


def owned_by(sched, wid: str) -> set[str]:
    return {rid for rid, owner in sched.owner.items() if owner == wid}


def assert_greedy(gw: Gateway, reference: dict, rids) -> None:
    for rid in rids:
        assert gw.finish[rid] == "length", (rid, gw.finish.get(rid), gw.errors.get(rid))
        assert gw.tokens[rid] == reference[rid][:len(gw.tokens[rid])] and len(gw.tokens[rid]) == LONG, rid
    assert gw.conflicts == 0


async def test_a_worker_added_during_a_run_takes_new_sequences_within_a_second(e2e_model, reference,
                                                                              redis_server, tmp_path):
    keys = Keys("scaleout")
    workers = [worker(e2e_model, redis_server, keys, "w1", tmp_path)]
    client, sched, gw, tasks = await start(redis_server, keys)
    admitted_at: dict[str, tuple[float, str]] = {}  # request id -> (when, worker) of its first admission
    admit = sched.admit

    def timed_admit(req, output_ids=None):
        ok = admit(req, output_ids)
        if req.request_id in sched.owner:
            admitted_at.setdefault(req.request_id, (time.monotonic(), sched.owner[req.request_id]))
        return ok

    sched.admit = timed_admit
    submitting = True

    async def submit_steadily():  # a run in progress: a new request every 50 ms
        i = 0
        while submitting:
            await gw.submit(f"a{i}", PROMPTS[i % len(PROMPTS)], 16)
            i += 1
            await asyncio.sleep(0.05)
        return i

    try:
        await gw.wait(lambda: "w1" in sched.workers, 60)
        submitter = asyncio.create_task(submit_steadily())
        await gw.wait(lambda: len(gw.finish) >= 5, 60)
        workers.append(worker(e2e_model, redis_server, keys, "w2", tmp_path))
        deadline = time.monotonic() + 60
        while not await client.exists(keys.worker_heartbeat("w2")):  # its first heartbeat, to within ~5 ms
            assert time.monotonic() < deadline, "w2 never announced itself"
            await asyncio.sleep(0.005)
        first_beat = time.monotonic()
        await gw.wait(lambda: any(w == "w2" for _t, w in admitted_at.values()), 10)
        first_on_w2 = min(t for t, w in admitted_at.values() if w == "w2")
        await asyncio.sleep(0.5)  # a few more requests, spread over both
        submitting = False
        submitted = await submitter
        await gw.wait(lambda: len(gw.finish) == submitted, 60)

        took = first_on_w2 - first_beat
        assert took < 1.0, f"w2 took its first sequence {took:.3f} s after its first heartbeat"
        on_w2 = {rid for rid, (_t, w) in admitted_at.items() if w == "w2"}
        assert on_w2 and all(gw.finished_by[rid] == "w2" for rid in on_w2)
        for i in range(submitted):  # every request served, greedy as the unfaulted run
            rid = f"a{i}"
            assert gw.finish[rid] == "length" and gw.tokens[rid] == reference[f"r{i % len(PROMPTS)}"][:16], rid
        assert gw.conflicts == 0
    finally:
        submitting = False
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_a_worker_stopped_with_sigterm_mid_run_loses_no_request(e2e_model, reference, redis_server, tmp_path):
    """Two workers, each running two streams with two more waiting: SIGTERM one. Its waiting sequences move
    to the other worker at once, its running streams finish on it, then it exits (code 0) long before the
    drain timeout; every stream equals the run without the stop."""
    keys = Keys("drain")
    workers = [worker(e2e_model, redis_server, keys, w, tmp_path, "--drain-timeout", "30") for w in ("w1", "w2")]
    client, sched, gw, tasks = await start(redis_server, keys, limits=TWO_SEQS, drain_timeout=30.0)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    try:
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 60)
        for i, p in enumerate(PROMPTS):
            await gw.submit(f"r{i}", p, LONG)
        await gw.wait(lambda: len(sched.owner) == len(PROMPTS))
        on_w1 = owned_by(sched, "w1")
        assert len(on_w1) == 4, sched.owner  # the least loaded worker takes each: four each
        await gw.wait(lambda: sum(len(gw.tokens.get(r, ())) >= 3 for r in on_w1) == 2, 60)
        running = {r for r in on_w1 if gw.tokens.get(r)}
        waiting = on_w1 - running
        assert len(running) == 2 and len(waiting) == 2, (running, waiting)

        workers[0].signal(signal.SIGTERM)
        signalled = time.monotonic()
        await gw.wait(lambda: all(sched.owner.get(r) == "w2" for r in waiting), 5)
        moved_after = time.monotonic() - signalled
        assert not any(r in gw.finish for r in running), "the running streams must still be running"
        assert sched.workers["w1"].draining
        assert await exited(workers[0], gw, 60) == 0
        exited_after = time.monotonic() - signalled
        await gw.wait(lambda: len(gw.finish) == len(PROMPTS), 120)

        assert moved_after < 1.0, moved_after  # a heartbeat and a refresh (0.1 s each here), not the drain
        assert exited_after < 25, exited_after  # after its streams, not after the 30 s drain timeout
        assert_greedy(gw, reference, rids)
        assert all(gw.finished_by[r] == "w1" for r in running)  # finished where they ran
        assert all(gw.finished_by[r] == "w2" for r in waiting)
        log_text = (tmp_path / "w1.log").read_text()
        assert "drained; stopping" in log_text and "no scheduler answered" not in log_text
        await gw.wait(lambda: "w1" not in sched.workers, 5)  # gone with its heartbeat
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_a_draining_worker_past_its_deadline_hands_its_streams_back(e2e_model, reference, redis_server,
                                                                        tmp_path):
    """--drain-timeout 0.5: streams still running on the draining worker half a second after the SIGTERM
    are recomputed on the other worker from every token the client has, token for token."""
    keys = Keys("handback")
    workers = [worker(e2e_model, redis_server, keys, w, tmp_path, "--drain-timeout", "0.5") for w in ("w1", "w2")]
    client, sched, gw, tasks = await start(redis_server, keys, drain_timeout=0.5)
    rids = [f"r{i}" for i in range(4)]
    try:
        await gw.wait(lambda: {"w1", "w2"} <= set(sched.workers), 60)
        for rid in rids:
            await gw.submit(rid, PROMPTS[int(rid[1:])], LONG)
        await gw.wait(lambda: len(sched.owner) == len(rids))
        on_w1 = owned_by(sched, "w1")
        assert len(on_w1) == 2, sched.owner
        await gw.wait(lambda: all(len(gw.tokens.get(r, ())) >= 3 for r in rids), 60)
        workers[0].signal(signal.SIGTERM)
        signalled = time.monotonic()
        await gw.wait(lambda: all(sched.owner.get(r) == "w2" for r in on_w1), 10)
        handed_back_after = time.monotonic() - signalled
        unfinished = {r for r in on_w1 if r not in gw.finish}
        assert await exited(workers[0], gw, 30) == 0
        await gw.wait(lambda: len(gw.finish) == len(rids), 120)

        assert unfinished == on_w1, "the streams must outlast the drain timeout"
        assert 0.5 <= handed_back_after < 2.5, handed_back_after
        assert_greedy(gw, reference, rids)
        assert all(gw.finished_by[r] == "w2" for r in on_w1)
        assert "drained; stopping" in (tmp_path / "w1.log").read_text()
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_the_only_worker_draining_finishes_its_streams_and_the_waiting_ones_wait_for_the_next(
        e2e_model, reference, redis_server, tmp_path):
    """One worker, two streams running and two waiting: SIGTERM. The running ones finish on it, the waiting
    ones are parked (not lost) while no worker is there, and a worker that joins later serves them."""
    keys = Keys("lone")
    workers = [worker(e2e_model, redis_server, keys, "w1", tmp_path, "--drain-timeout", "30")]
    client, sched, gw, tasks = await start(redis_server, keys, limits=TWO_SEQS, drain_timeout=30.0)
    rids = [f"r{i}" for i in range(4)]
    try:
        await gw.wait(lambda: "w1" in sched.workers, 60)
        for rid in rids:
            await gw.submit(rid, PROMPTS[int(rid[1:])], LONG)
        await gw.wait(lambda: sum(len(gw.tokens.get(r, ())) >= 3 for r in rids) == 2, 60)
        running = {r for r in rids if gw.tokens.get(r)}
        waiting = set(rids) - running
        workers[0].signal(signal.SIGTERM)
        await gw.wait(lambda: waiting <= {req.request_id for req, _ in sched.parked}, 5)
        assert not any(r in gw.finish for r in running)
        assert await exited(workers[0], gw, 60) == 0
        await gw.wait(lambda: "w1" not in sched.workers, 5)
        assert set(gw.finish) == running  # the running ones finished on the draining worker
        assert all(gw.finished_by[r] == "w1" for r in running)
        assert {req.request_id for req, _ in sched.parked} == waiting  # still there, with no worker
        assert not any(gw.tokens.get(r) for r in waiting)

        workers.append(worker(e2e_model, redis_server, keys, "w2", tmp_path))
        await gw.wait(lambda: len(gw.finish) == len(rids), 120)
        assert_greedy(gw, reference, rids)
        assert all(gw.finished_by[r] == "w2" for r in waiting)
    finally:
        await stop(client, sched, gw, tasks)
        for w in workers:
            w.stop()


async def test_a_draining_worker_nobody_answers_leaves_on_its_own(e2e_model, redis_server, tmp_path):
    """Without a scheduler's answer: a worker whose drain no scheduler can answer (no lease held) leaves at
    once; one whose scheduler holds the lease but never answers leaves drain timeout + margin later (its
    heartbeat says it drains meanwhile); a second SIGTERM stops one at once."""
    import redis.asyncio as aioredis

    from phaseserve.workers.service import DRAIN_MARGIN_S

    held, unheld = Keys("held"), Keys("unheld")
    client = aioredis.Redis.from_url(redis_server)
    await client.set(held.scheduler_lease(), "a scheduler that never answers")
    procs = {
        "waits": worker(e2e_model, redis_server, held, "waits", tmp_path, "--drain-timeout", "0"),
        "twice": worker(e2e_model, redis_server, held, "twice", tmp_path, "--drain-timeout", "30"),
        "alone": worker(e2e_model, redis_server, unheld, "alone", tmp_path, "--drain-timeout", "30"),
    }
    keys_of = {"waits": held, "twice": held, "alone": unheld}
    gw = Gateway(client, held)  # only its wait()
    try:
        await gw.wait(lambda: all(w.proc.poll() is None for w in procs.values()), 1)
        for wid, w in procs.items():
            deadline = time.monotonic() + 60
            while not await client.exists(keys_of[wid].worker_heartbeat(wid)):
                assert time.monotonic() < deadline and w.proc.poll() is None, wid
                await asyncio.sleep(0.05)
        signalled = time.monotonic()
        for w in procs.values():
            w.signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        info = WorkerInfo.from_wire(await client.get(held.worker_heartbeat("twice")))
        assert info.draining  # announced at once, not at the next beat only
        procs["twice"].signal(signal.SIGTERM)
        # (a worker takes a second or more to exit on this busy machine: its relay's last writes, torch)
        assert await exited(procs["twice"], gw, 15) == 0  # not after the 35 s it would wait otherwise
        assert await exited(procs["alone"], gw, 15) == 0
        alone_after = time.monotonic() - signalled
        assert procs["waits"].proc.poll() is None  # a scheduler might still answer
        assert await exited(procs["waits"], gw, DRAIN_MARGIN_S + 15) == 0
        waited = time.monotonic() - signalled
        assert alone_after < 15, alone_after  # at once, not after its 30 s drain timeout + margin
        assert DRAIN_MARGIN_S <= waited < DRAIN_MARGIN_S + 10, waited
        assert "no scheduler to answer" in (tmp_path / "alone.log").read_text()
        assert "no scheduler answered the drain in time" in (tmp_path / "waits.log").read_text()
        for wid in procs:  # each took its heartbeat with it
            assert not await client.exists(keys_of[wid].worker_heartbeat(wid))
    finally:
        for w in procs.values():
            w.stop()
        await client.aclose()


async def test_a_worker_already_draining_when_adopted_gets_nothing_and_is_let_go(redis_server):
    """A scheduler that takes over finds a worker draining (its heartbeat says so; no model behind it, the
    plans are read from its stream): nothing is placed on it, a request waits parked, and holding nothing
    the worker is told at once that it may go (`drained`, after the adoption's reset)."""
    import redis.asyncio as aioredis

    from phaseserve.wire import FIELD, StepPlan

    keys = Keys("adopted")
    r = aioredis.Redis.from_url(redis_server)
    await r.sadd(keys.workers, "w")
    info = WorkerInfo("w", "mixed", "m", 64, 16, 2048, 1, 1.0, draining=True)
    await r.set(keys.worker_heartbeat("w"), info.to_wire(), px=60_000)
    client, sched, gw, tasks = await start(redis_server, keys)
    try:
        await gw.submit("r0", PROMPTS[0], 8)
        await gw.wait(lambda: [req.request_id for req, _ in sched.parked] == ["r0"], 10)
        await gw.wait(lambda: "w" in sched.workers and sched.workers["w"].drained, 10)
        plans = [StepPlan.from_wire(f[FIELD.encode()]) for _id, f in await r.xrange(keys.steps("w"))]
        assert [(p.reset, p.drained) for p in plans] == [(True, False), (False, True)]
        assert plans[1].epoch == sched.epoch and not sched.owner
        deadline = time.monotonic() + 5  # the stats key is written a little after a change
        while (await stats_of(client, keys)).get("num_waiting") != 1:  # parked, counted, not lost
            assert time.monotonic() < deadline, await stats_of(client, keys)
            await asyncio.sleep(0.05)
    finally:
        await stop(client, sched, gw, tasks)
        await r.aclose()


def test_a_negative_drain_timeout_is_refused_in_one_line(monkeypatch):
    from phaseserve import logs
    from phaseserve.scheduler.service import main as scheduler_main
    from phaseserve.workers.service import main as worker_main

    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # leave the tests' logging as it is
    for main in (scheduler_main, worker_main):
        with pytest.raises(SystemExit, match=r"--drain-timeout must be >= 0 \(0 = hand back at once\), got -1.0"):
            main(["--redis-url", "redis://127.0.0.1:1", "--drain-timeout", "-1"])
