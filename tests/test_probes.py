"""Probes that prove progress (phaseserve/healthcheck.py, gateway/health.py): on a real prefill + decode
stack, a frozen worker (SIGSTOP mid-request) turns its liveness probe, a layout left with one pool is
reported degraded, and a dead scheduler turns its own probe and the gateways' readiness; the gauges an
inference gateway reads are in /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter

import openai

from e2e_reference import metric
from e2e_stack import ROOT, running_stack, wait_for
from phaseserve.gateway.health import DEGRADED, OK, UNAVAILABLE, assess


def test_assess_says_why_a_gateway_is_degraded_or_not_ready():
    ok = assess(Counter(prefill=1, decode=1), True, True, 2)
    assert (ok.status, ok.ready, ok.problems) == (OK, True, [])
    decode_only = assess(Counter(decode=1), True, True, 1)
    assert decode_only.status == DEGRADED and decode_only.ready  # served: the decode worker prefills too
    assert "no prefill worker" in decode_only.problems[0]
    no_scheduler = assess(Counter(mixed=1), True, False, 1)
    assert no_scheduler.status == DEGRADED and not no_scheduler.ready
    assert "no live scheduler" in no_scheduler.ready_problems[0]
    nothing = assess(Counter(), True, True, 0)
    assert nothing.status == UNAVAILABLE and not nothing.ready
    assert not assess(Counter(mixed=1), False, True, 1).ready  # no token channel
    assert not assess(Counter(mixed=1), True, True, 0).ready  # a scheduler that plans on nobody yet


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_frozen_worker_and_a_dead_scheduler_turn_their_probes(e2e_model, tmp_path):
    # a worker with no learned step costs yet gets --step-timeout for a step: the frozen one is found in that
    with running_stack(e2e_model, tmp_path, prefill_workers=1, decode_workers=1, step_timeout=8.0) as stack:
        procs = stack.stack.procs
        by_role = {role: procs[name] for name, role in stack.stack.roles.items()}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": stack.redis_url,
               "PHASESERVE_KEY_PREFIX": stack.key_prefix, "PHASESERVE_PORT": stack.base_url.rsplit(":", 1)[1]}

        def probe(service: str, mode: str, pid: int | None = None) -> int:
            extra = {"PHASESERVE_WORKER_ID": f"{socket.gethostname()}-{pid}"} if pid else {}
            return subprocess.run([sys.executable, "-m", "phaseserve.healthcheck", service, mode],
                                  env={**env, **extra}, capture_output=True, timeout=30).returncode

        decode, prefill = by_role["decode"], by_role["prefill"]
        assert wait_for(lambda: stack.scheduler_stats().get("num_workers") == 2, 60)
        for service, pid in (("gateway", None), ("scheduler", None), ("worker", decode.pid),
                             ("worker", prefill.pid)):
            for mode in ("live", "ready"):
                assert probe(service, mode, pid) == 0, (service, mode)
        assert _get(stack.base_url + "/health")[1]["status"] == OK

        # the decode worker's model process freezes (its relay still reads plans and beats), then a request
        # comes: handed over after its prefill, its decode plans reach a model that never answers
        result: dict = {}

        def generate():
            with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=300) as client:
                result["text"] = client.completions.create(
                    model=stack.model, prompt="A long story about paged attention", max_tokens=400,
                    temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        request = threading.Thread(target=generate)
        os.kill(decode.pid, signal.SIGSTOP)
        try:
            assert probe("worker", "live", decode.pid) == 0  # frozen but idle: nothing is late yet
            request.start()
            assert wait_for(lambda: metric(stack.base_url, "kv_handoff_sequences") >= 1, 60)
            # its relay withdraws the heartbeat once a step overruns its deadline: not live
            assert wait_for(lambda: probe("worker", "live", decode.pid) == 1, 45, 0.5)
            assert probe("worker", "live", prefill.pid) == 0
            status, body = _get(stack.base_url + "/health")
            assert status == 200 and body["status"] == DEGRADED, body
            assert any("no decode worker" in p for p in body["problems"]), body
            request.join(120)  # recomputed on the prefill worker: the request still completes
            assert result.get("text"), "the request did not complete"
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        # moving again: a new life, live again
        assert wait_for(lambda: probe("worker", "live", decode.pid) == 0, 30, 0.5)

        # a prefill + decode layout left with only its decode worker: degraded, not ok
        prefill.kill()
        prefill.wait(10)
        # wait for this very state: the decode worker's own recovery can read DEGRADED a moment before the
        # prefill worker's heartbeat has expired
        def prefill_gone() -> bool:
            body = _get(stack.base_url + "/health")[1]
            return body["status"] == DEGRADED and any("no prefill worker" in p for p in body["problems"])

        assert wait_for(prefill_gone, 15, 0.5), _get(stack.base_url + "/health")[1]
        assert _get(stack.base_url + "/health/ready")[0] == 200  # served all the same

        # the gauges an inference gateway reads
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                     "num_prefill_tokens_waiting"):
            assert metric(stack.base_url, "phaseserve_" + name) >= 0

        # a dead scheduler: its own probe, and every gateway's readiness, turn; the gateway stays live
        procs["scheduler"].kill()
        procs["scheduler"].wait(10)
        assert wait_for(lambda: probe("scheduler", "live") == 1, 15, 0.5)
        assert wait_for(lambda: _get(stack.base_url + "/health/ready")[0] == 503, 15, 0.5)
        assert "no live scheduler" in _get(stack.base_url + "/health/ready")[1]["problems"][0]
        assert probe("gateway", "ready") == 1 and probe("gateway", "live") == 0
