"""`phaseserve up` as a user runs it: one command, a reply streamed over HTTP, SIGTERM, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil

from phaseserve.launcher import core_placement
from phaseserve.redis_server import free_port


def test_up_serves_and_stops_cleanly_on_sigterm(e2e_model, tmp_path):
    port = free_port()
    env = {**os.environ, "PHASESERVE_LOG_LEVEL": "warning"}
    env.pop("REDIS_URL", None)
    exe = os.path.join(os.path.dirname(sys.executable), "phaseserve")
    proc = subprocess.Popen([exe, "up", "--model", str(e2e_model), "--port", str(port),
                             "--kv-cache-memory", "32MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(180), "phaseserve up did not report it is serving:\n" + "".join(lines[-50:])
        banner = next(line for line in lines if "serving" in line)
        assert f"http://127.0.0.1:{port}/v1" in banner and e2e_model.name in banner

        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for part in ("redis-server", "-m scheduler", "-m workers", "-m workers.relay", "-m gateway"):
            assert part in names, f"{part} not running under up: {names}"
        placement = core_placement({"bind_cores": True, "num_threads": 0, "model": str(e2e_model)})
        if placement:  # a small model on a machine of 2+ cores: the worker has its cores, the rest the others
            for c in children:
                cmd = " ".join(c.cmdline())
                service = "relay" if "-m workers.relay" in cmd else next(
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

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines[-50:])
        assert time.monotonic() - t0 < 30
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running after up exited: {[c.pid for c in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
