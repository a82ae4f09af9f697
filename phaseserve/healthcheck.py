"""`python -m phaseserve.healthcheck gateway|scheduler|worker`: exit 0 when this container's service is up.

For docker-compose healthchecks: each check asks the service itself (or the mark it keeps in Redis under
the configured key prefix), not only whether Redis answers. Settings come from the same environment
variables as the services' (REDIS_URL, PHASESERVE_KEY_PREFIX, PHASESERVE_PORT).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

from phaseserve import redis_url, settings
from phaseserve.wire import Keys


def _url() -> str:
    return settings.with_password_file(os.environ["REDIS_URL"],
                                       os.environ.get(settings.BY_NAME["redis_password_file"].env))


def _redis():
    from phaseserve.redis_client import connect

    return connect(_url(), key_prefix=_keys().prefix, socket_timeout=2)


def _keys() -> Keys:
    prefix = os.environ.get(settings.BY_NAME["key_prefix"].env, settings.BY_NAME["key_prefix"].default)
    return Keys(redis_url.key_prefix_for(os.environ.get("REDIS_URL"), prefix))


def gateway() -> bool:
    port = os.environ.get(settings.BY_NAME["port"].env, settings.BY_NAME["port"].default)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
        return r.status == 200


def scheduler() -> bool:
    return bool(_redis().exists(_keys().scheduler_alive()))


def worker() -> bool:
    # a worker's id defaults to <hostname>-<pid>; its heartbeat key expires when it stops beating
    pattern = _keys().worker_heartbeat(socket.gethostname() + "-*")
    return next(_redis().scan_iter(pattern), None) is not None


CHECKS = {"gateway": gateway, "scheduler": scheduler, "worker": worker}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: python -m phaseserve.healthcheck {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        return 2
    try:
        return 0 if CHECKS[argv[0]]() else 1
    except Exception as e:  # any failure to ask is "not healthy", said in one line
        print(f"{argv[0]} not healthy: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
