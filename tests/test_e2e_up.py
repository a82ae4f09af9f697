"""`phaseserve up` as a user runs it: one command, a reply streamed over HTTP, SIGTERM, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from urllib.parse import unquote, urlsplit

import openai
import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from phaseserve.stack.launcher import core_placement
from phaseserve.redis_server import free_port


def start_up(e2e_model, *flags: str):
    """`phaseserve up` in a process group of its own (as a shell runs it), its output collected in lines;
    returns (proc, port, lines, ready, reader)."""
    port = free_port()
    env = {**os.environ, "PHASESERVE_LOG_LEVEL": "warning"}
    env.pop("REDIS_URL", None)
    exe = os.path.join(os.path.dirname(sys.executable), "phaseserve")
    proc = subprocess.Popen([exe, "up", "--model", str(e2e_model), "--port", str(port),
                             "--kv-cache-memory", "32MiB", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, port, lines, ready, reader


def stop_up(proc, lines: list[str], reader, children, sig: int) -> str:
    """`sig` to up's process group, as a terminal or a supervisor sends it: up exits 0 within 30 s and leaves
    none of its children running. Returns what it logged from then on."""
    shown = len(lines)
    os.killpg(proc.pid, sig)
    assert proc.wait(30) == 0, "".join(lines[-50:])
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after up exited: {[c.pid for c in alive]}"
    reader.join(5)
    return "".join(lines[shown:])


def test_up_serves_and_stops_cleanly_on_sigterm(e2e_model, tmp_path):
    """SIGTERM to up's whole process group (what a service manager or `kill -- -PGID` sends): every child
    stops, quietly (no error, no warning about a service gone first), and up exits 0."""
    proc, port, lines, ready, reader = start_up(e2e_model)
    try:
        assert ready.wait(180), "phaseserve up did not report it is serving:\n" + "".join(lines[-50:])
        banner = next(line for line in lines if "serving" in line)
        assert f"http://127.0.0.1:{port}/v1" in banner and e2e_model.name in banner

        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for part in ("redis-server", "-m phaseserve.scheduler", "-m phaseserve.workers", "-m phaseserve.workers.relay", "-m phaseserve.gateway"):
            assert part in names, f"{part} not running under up: {names}"
        placement = core_placement({"bind_cores": True, "num_threads": 0, "model": str(e2e_model)})
        if placement:  # a small model on a machine of 2+ cores: the worker has its cores, the rest the others
            for c in children:
                cmd = " ".join(c.cmdline())
                service = "relay" if "-m phaseserve.workers.relay" in cmd else next(
                    (s for s in ("worker", "gateway", "scheduler") if f"-m {s}" in cmd),
                    "redis" if "redis-server" in cmd else None)
                if service:
                    assert sorted(c.cpu_affinity()) == placement[service], (service, c.cpu_affinity())

        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            stream = client.chat.completions.create(model=e2e_model.name, max_tokens=6, stream=True,
                                                    messages=[{"role": "user", "content": "Hello!"}],
                                                    extra_body={"ignore_eos": True})
            chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1

        # its Redis is private: another local client without the password is refused, and the password (in the
        # children's environment) is on no command line nor in the banner
        server = next(c for c in children if "redis-server" in " ".join(c.cmdline()))
        redis_port = next(c.laddr.port for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port, retry=Retry(NoBackoff(), 0)).ping()
        gateway = next(c for c in children if "-m phaseserve.gateway" in " ".join(c.cmdline()))
        password = unquote(urlsplit(gateway.environ()["REDIS_URL"]).password or "")
        assert len(password) >= 32
        assert all(password not in " ".join(c.cmdline()) for c in children) and password not in "".join(lines)
        with redis.Redis(port=redis_port, password=password) as client, pytest.raises(redis.ResponseError):
            client.execute_command("CONFIG", "SET", "dir", "/tmp")

        said = stop_up(proc, lines, reader, children, signal.SIGTERM)
        assert "error" not in said and "warning" not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)


def test_core_placement_splits_the_cores_among_workers(monkeypatch, tmp_path):
    from phaseserve.stack import launcher

    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)  # a small model: auto threads = cores - 1
    values = {"bind_cores": True, "num_threads": 0, "model": str(tmp_path), "workers": 2}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1, 2, 3, 4, 5])
    # two workers of two threads (their 3-core share minus one), the rest share the two cores left
    assert launcher.core_placement(values) == {"worker-0": [0, 1], "worker-1": [2, 3], "relay": [4, 5],
                                               "gateway": [4, 5], "scheduler": [4, 5], "redis": [4, 5]}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1])
    # one core each and none left: the workers are pinned apart, the others (and relays) run anywhere
    assert launcher.core_placement(values) == {"worker-0": [0], "worker-1": [1], "relay": [0, 1],
                                               "gateway": None, "scheduler": None, "redis": None}
    assert launcher.core_placement({**values, "workers": 3}) is None  # more workers than cores


def test_up_with_two_workers_serves_requests_on_both(e2e_model, tmp_path):
    import concurrent.futures

    import redis

    from e2e_stack import running_stack, wait_for
    from phaseserve.wire import Keys, TokenBatch, channel_message

    with running_stack(e2e_model, tmp_path, workers=2) as stack:
        procs = stack.stack.procs
        assert {"worker-0", "worker-1"} <= set(procs) and "worker" not in procs
        keys = Keys(stack.key_prefix)
        client = redis.Redis.from_url(stack.redis_url)
        # both workers announced themselves, under distinct ids, and are alive
        ids = wait_for(lambda: [m.decode() for m in client.smembers(keys.workers)
                                if client.exists(keys.worker_heartbeat(m.decode()))]
                       if client.scard(keys.workers) >= 2 else None, 60)
        assert ids and len(set(ids)) == 2, ids
        placement = core_placement({"bind_cores": True, "num_threads": 0, "model": str(e2e_model), "workers": 2})
        if placement:
            for name in ("worker-0", "worker-1"):
                assert sorted(psutil.Process(procs[name].pid).cpu_affinity()) == placement[name]

        # who served: every worker publishes its tokens to the gateways as TokenBatches naming it
        # (results and plans are deleted once acknowledged, so listen rather than look back)
        senders: set[str] = set()

        listening = threading.Event()
        listening.set()

        def listen() -> None:
            pubsub = client.pubsub()
            pubsub.psubscribe(keys.gateway_channel("*"))
            while listening.is_set():
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if message and message["type"] == "pmessage":
                    batch = channel_message(message["data"])
                    if isinstance(batch, TokenBatch) and any(e.token_ids for e in batch.events):
                        senders.add(batch.worker_id)
            pubsub.close()

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        time.sleep(0.2)  # subscribed before the first request

        def served_by() -> set[str]:
            return set(senders)

        def ask(i: int) -> str | None:
            with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120) as c:
                reply = c.completions.create(model=stack.model, prompt=f"Number {i}:", max_tokens=8,
                                             extra_body={"ignore_eos": True})
            return reply.choices[0].finish_reason

        deadline = time.monotonic() + 60
        rounds = 0
        while served_by() != set(ids) and time.monotonic() < deadline:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent: routed to the least loaded
                assert list(pool.map(ask, range(4))) == ["length"] * 4
            rounds += 1
        listening.clear()
        listener.join(5)
        assert served_by() == set(ids), f"after {rounds} rounds of 4 requests only {served_by()} served"
        assert rounds <= 5, f"{rounds} rounds of 4 concurrent requests before both workers served one"
        client.close()


def test_up_plans_prefill_and_decode_workers_with_their_roles_and_core_shares(monkeypatch, tmp_path):
    from phaseserve.stack import launcher

    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)
    base = {"bind_cores": True, "num_threads": 2, "model": str(tmp_path), "workers": None,
            "prefill_workers": 0, "decode_workers": 0}
    roles = launcher.worker_roles
    assert roles(base) == {"worker": "mixed"}  # the default: one mixed worker
    assert roles({**base, "workers": 2}) == {"worker-0": "mixed", "worker-1": "mixed"}
    # roles asked for: no mixed worker unless asked for too
    assert roles({**base, "prefill_workers": 1, "decode_workers": 2}) == {
        "prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert roles({**base, "workers": 1, "prefill_workers": 1, "decode_workers": 1}) == {
        "worker-0": "mixed", "prefill-0": "prefill", "decode-0": "decode"}
    assert roles({**base, "workers": 1, "prefill_workers": 1}) == {"worker-0": "mixed", "prefill-0": "prefill"}

    # each worker, whatever its role, an equal share of the cores (cut to its threads); the rest to the others
    monkeypatch.setattr(launcher, "usable_cores", lambda: list(range(8)))
    assert launcher.core_placement({**base, "prefill_workers": 1, "decode_workers": 2}) == {
        "prefill-0": [0, 1], "decode-0": [2, 3], "decode-1": [4, 5], "relay": [6, 7], "gateway": [6, 7],
        "scheduler": [6, 7], "redis": [6, 7]}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1])
    assert launcher.core_placement({**base, "num_threads": 0, "prefill_workers": 1, "decode_workers": 1}) == {
        "prefill-0": [0], "decode-0": [1], "relay": [0, 1], "gateway": None, "scheduler": None, "redis": None}


def test_up_refuses_worker_counts_that_make_no_deployment_in_one_line(monkeypatch, capsys):
    from phaseserve import logs
    from phaseserve.stack import launcher

    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # leave the tests' logging as it is
    cases = {
        ("--prefill-workers", "1"): "--prefill-workers 1 with no worker to decode: add --decode-workers",
        ("--decode-workers", "2"): "--decode-workers 2 with no worker to prefill: add --prefill-workers",
        ("--workers", "0"): "no worker to start",
        ("--workers", "-1"): "--workers must be a whole number >= 0, got -1",
        ("--prefill-workers", "-2", "--workers", "1"): "--prefill-workers must be a whole number >= 0, got -2",
        ("--drain-timeout", "-1"): "--drain-timeout must be >= 0",
    }
    for argv, message in cases.items():
        assert launcher.main(list(argv)) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("phaseserve up: ") and message in err and err.count("\n") == 1, (argv, err)


def test_up_starts_prefill_and_decode_workers_with_their_roles(e2e_model, tmp_path):
    """`up --prefill-workers 1 --decode-workers 1`: two workers announce those roles, each on its own cores
    (when there are enough), the stack serves, and it stops quickly (workers get SIGINT, no drain)."""
    import redis

    from e2e_stack import running_stack, wait_for
    from phaseserve.wire import Keys, WorkerInfo

    with running_stack(e2e_model, tmp_path, prefill_workers=1, decode_workers=1) as stack:
        # healthy means the layout asked for: both workers live and planned on by the scheduler, so the
        # very first request is handed from one to the other
        import json
        import urllib.request
        with urllib.request.urlopen(stack.base_url + "/health", timeout=5) as r:
            health = json.loads(r.read())
        assert health["worker_roles"] == {"prefill": 1, "decode": 1} and health["scheduler_workers"] == 2, health
        procs = stack.stack.procs
        assert {"prefill-0", "decode-0"} <= set(procs) and not any(n.startswith("worker") for n in procs)
        keys = Keys(stack.key_prefix)
        client = redis.Redis.from_url(stack.redis_url)

        def heartbeats():
            beats = [client.get(keys.worker_heartbeat(m.decode())) for m in client.smembers(keys.workers)]
            infos = [WorkerInfo.from_wire(b) for b in beats if b]
            return infos if len(infos) == 2 else None

        infos = wait_for(heartbeats, 60)
        assert infos, "two workers did not announce themselves"
        assert {i.pid: i.role for i in infos} == {procs["prefill-0"].pid: "prefill", procs["decode-0"].pid: "decode"}
        for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert ["--role", role] == psutil.Process(procs[name].pid).cmdline()[-2:]
        placement = core_placement({"bind_cores": True, "num_threads": 0, "model": str(e2e_model),
                                    "prefill_workers": 1, "decode_workers": 1})
        if placement:
            for name in ("prefill-0", "decode-0"):
                assert sorted(psutil.Process(procs[name].pid).cpu_affinity()) == placement[name]

        with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120) as c:
            reply = c.completions.create(model=stack.model, prompt="Once", max_tokens=8,
                                         extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8

        children = [psutil.Process(p.pid) for p in procs.values()]
        t0 = time.monotonic()
        stack.stack.stop()
        stopped_in = time.monotonic() - t0
        client.close()
    assert stopped_in < 10, f"stopping took {stopped_in:.1f} s (a worker drained instead of stopping?)"
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    _gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_up_restarts_a_killed_worker_and_ctrl_c_stops_it_quietly(e2e_model, tmp_path):
    """kill -9 of the worker: up starts it again (the stack keeps serving, no "stopping the stack"); then a
    Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops everything quietly, exit 0."""
    proc, port, lines, ready, reader = start_up(e2e_model)
    try:
        assert ready.wait(180), "phaseserve up did not report it is serving:\n" + "".join(lines[-50:])

        def workers():
            found = []
            for c in psutil.Process(proc.pid).children():
                try:  # the killed one is a zombie until up reaps it
                    if "-m phaseserve.workers" in " ".join(c.cmdline()):
                        found.append(c)
                except psutil.Error:
                    pass
            return found

        (first,) = workers()
        first.kill()
        deadline = time.monotonic() + 30
        while not (w := [c for c in workers() if c.pid != first.pid]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert w, "the killed worker was not started again:\n" + "".join(lines[-50:])
        assert proc.poll() is None, "".join(lines[-50:])
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            deadline = time.monotonic() + 120
            while True:  # 503 until the new worker has loaded and announced itself
                try:
                    reply = client.completions.create(model=e2e_model.name, prompt="Once", max_tokens=4,
                                                      extra_body={"ignore_eos": True})
                    break
                except openai.APIStatusError as e:
                    assert e.status_code == 503 and time.monotonic() < deadline, e
                    time.sleep(0.5)
        assert reply.choices[0].finish_reason == "length"

        said = stop_up(proc, lines, reader, psutil.Process(proc.pid).children(recursive=True), signal.SIGINT)
        assert "unreachable" not in said and "error" not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_children_of_a_killed_up_stop_at_once(e2e_model, tmp_path):
    """kill -9 of up itself: its worker (and the worker's relay), scheduler, gateway and Redis stop within a
    few seconds (parent-death signals), not after a worker's drain."""
    proc, port, lines, ready, reader = start_up(e2e_model)
    children: list[psutil.Process] = []
    try:
        assert ready.wait(180), "phaseserve up did not report it is serving:\n" + "".join(lines[-50:])
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("-m phaseserve.workers.relay" in " ".join(c.cmdline()) for c in children)
        proc.kill()
        proc.wait()
        _gone, alive = psutil.wait_procs(children, timeout=8)
        assert not alive, f"left running after up was killed: {[' '.join(c.cmdline()) for c in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in children:  # what a failed run left; never this session's other processes (its shared stack)
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()


def test_worker_restarts_back_off_while_a_worker_keeps_dying_at_start():
    from phaseserve.stack.launcher import WorkerRestarts

    r = WorkerRestarts(base_s=1.0, cap_s=8.0, stable_s=60.0)
    assert [r.delay("w", 0.0, 2.0) for _ in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert r.delay("other", 0.0, 1.0) == 0.0  # each worker its own count
    assert r.delay("w", 0.0, 120.0) == 0.0  # it had run a while: a fresh start
    assert r.delay("w", 0.0, 1.0) == 1.0


def test_up_is_ready_only_with_every_worker_it_asked_for_live_and_adopted():
    from phaseserve.stack.launcher import layout_ready

    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    assert not layout_ready({"worker_roles": {"prefill": 1}, "scheduler_workers": 1}, roles)
    assert not layout_ready({"worker_roles": {"prefill": 1, "decode": 1}, "scheduler_workers": 1}, roles)
    assert not layout_ready({"workers": ["a"]}, roles)  # a gateway that does not say
    assert layout_ready({"worker_roles": {"prefill": 1, "decode": 1}, "scheduler_workers": 2}, roles)
