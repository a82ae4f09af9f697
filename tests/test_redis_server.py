"""The embedded Redis that `phaseserve up` starts is private: no other local user can use it."""

from __future__ import annotations

import os
import stat

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from phaseserve import redis_server
from phaseserve.redis_server import EmbeddedRedis, free_port

ONCE = Retry(NoBackoff(), 0)  # a refusal is the answer: no retries


def test_the_embedded_redis_wants_a_password_it_never_shows_and_refuses_dangerous_commands():
    with EmbeddedRedis() as server:
        assert server.requirepass and len(server.requirepass) >= 32  # generated: nobody chose it
        # another local client without the password (any user can reach a loopback port) is refused
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, retry=ONCE).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, password="guess", retry=ONCE).ping()
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        # with it, still nothing that writes files or reconfigures the server (CONFIG SET dir + SAVE)
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("BGSAVE",), ("DEBUG", "SLEEP", "0"),
                        ("MODULE", "LIST"), ("REPLICAOF", "127.0.0.1", "1"), ("BGREWRITEAOF",)):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        # the password is in no process's argv (which every local user can read in /proc/<pid>/cmdline)
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
            assert server.requirepass.encode() not in f.read()
        # its directory (config, log) is the server's user's alone
        directory = os.path.dirname(server.config_path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.config_path).st_mode) == 0o600
        client.close()


def test_a_given_password_with_any_characters_works_and_survives_a_restart():
    server = EmbeddedRedis(requirepass='p@ss "word" \\ x').start()
    try:
        assert redis.Redis.from_url(server.url).ping()
        server.stop()
        server.start()  # the same port and password: clients reconnect as they were
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()


def test_free_port_skips_a_port_promised_to_another_server(monkeypatch):
    """`phaseserve up --port P` picks its Redis's port before the gateway listens on P, and the kernel may offer
    P again (a bench probed it free and closed it): the Redis then took the gateway's port."""
    offered = iter([41001, 41001, 41002])

    class Probe:
        def __init__(self, *args):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(redis_server.socket, "socket", Probe)
    assert free_port(avoid={41001}) == 41002
