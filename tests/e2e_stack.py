"""A whole phaseserve stack for end-to-end tests: embedded Redis + scheduler + worker + gateway
as real subprocesses on free ports, started with the launcher's own code (stack/launcher.py).

`running_stack(model_dir, log_dir, **settings)` is a context manager yielding a `RunningStack`
(base_url, model name, redis url). Children's logs go to a file whose tail is shown when a
stack fails to start, and which tests can read.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis

from phaseserve import settings
from phaseserve.stack.launcher import LaunchError, Stack, health_url
from phaseserve.redis_server import free_port
from phaseserve.wire import Keys

ROOT = Path(__file__).resolve().parent.parent


def e2e_model_dir(tmp_factory) -> Path:
    """The bundled model when it has been built, else a tiny random-weight test model."""
    override = os.environ.get("PHASESERVE_E2E_MODEL")
    if override:
        return Path(override)
    bundled = Path(settings.bundled_model_path())
    if (bundled / "config.json").is_file() and any(bundled.glob("*.safetensors")):
        return bundled
    from model_factory import make_model

    return make_model(tmp_factory.mktemp("e2e-model"), "llama", max_position_embeddings=512)


@dataclass
class RunningStack:
    base_url: str
    model: str  # the id the API serves
    model_dir: Path
    redis_url: str
    key_prefix: str
    log_path: Path
    stack: Stack

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def scheduler_stats(self) -> dict:
        """What the scheduler last wrote for /metrics (straight from Redis)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            data = client.get(Keys(self.key_prefix).scheduler_stats())
        finally:
            client.close()
        return msgpack.unpackb(data) if data else {}

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.stack.dead_child() is None


@contextlib.contextmanager
def running_stack(model_dir: Path, log_dir: Path, startup_timeout: float = 180.0, **overrides):
    values = vars(settings.parse("up", []))
    values.update(model=str(model_dir), port=free_port(), host="127.0.0.1", log_level="info",
                  kv_cache_memory=64 << 20, heartbeat_interval=0.5, heartbeat_ttl=3.0,
                  # a client that goes away is cancelled half a second later, unless it resumed by then
                  resume_grace=0.5)
    values["redis_url"] = None  # a private embedded Redis per stack, whatever REDIS_URL says
    values.update(overrides)
    log_path = Path(log_dir) / f"stack-{values['port']}.log"
    out = open(log_path, "ab", buffering=0)
    stack = Stack(values, output=out)
    url = health_url(values["host"], values["port"])
    try:
        stack.start()
        try:
            stack.wait_healthy(url, startup_timeout, threading.Event())
        except LaunchError as e:
            raise RuntimeError(f"{e}\n--- stack log tail ---\n{log_path.read_text(errors='replace')[-6000:]}")
        served = values.get("served_model_name") or settings.resolve_model(str(model_dir)).name
        yield RunningStack(url, served, Path(model_dir), values["redis_url"], values["key_prefix"], log_path, stack)
    finally:
        stack.stop()
        out.close()


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Poll until predicate() is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value

