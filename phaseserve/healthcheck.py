"""`python -m phaseserve.healthcheck gateway|scheduler|worker [live|ready]`: exit 0 when this container's
(or pod's) service is live, or ready (the default, what docker-compose's healthchecks run).

Each check asks the service itself, and proves progress rather than existence:
- gateway: its own `/health/live` or `/health/ready` (ready: a live scheduler plans on a live worker;
  gateway/health.py).
- scheduler: its own mark in Redis (`Keys.scheduler_seen`), refreshed by the active scheduler every worker
  refresh and by a standby every look at the lease: a scheduler whose loop stopped turning lets it expire.
  Live and ready are the same (nothing routes traffic to a scheduler).
- worker: its heartbeat, which its relay refreshes only while the model makes progress: a model step that
  overruns its deadline (a hung or frozen model) withdraws it at once, a dead relay lets it expire.
  Ready: also not draining.

Settings come from the services' environment variables (REDIS_URL, PHASESERVE_REDIS_PASSWORD_FILE,
PHASESERVE_KEY_PREFIX, PHASESERVE_PORT, PHASESERVE_WORKER_ID). Without a worker id the worker is found by
the default one, `<hostname>-<pid>`; a scheduler by its consumer name, `scheduler-<hostname>-<pid>`.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

from phaseserve import redis_url, settings
from phaseserve.wire import Keys, WireError, WorkerInfo

MODES = ("live", "ready")


def _url() -> str:
    return settings.with_password_file(os.environ["REDIS_URL"],
                                       os.environ.get(settings.BY_NAME["redis_password_file"].env))


def _redis():
    from phaseserve.redis_client import connect

    return connect(_url(), key_prefix=_keys().prefix, socket_timeout=2)


def _keys() -> Keys:
    prefix = os.environ.get(settings.BY_NAME["key_prefix"].env, settings.BY_NAME["key_prefix"].default)
    return Keys(redis_url.key_prefix_for(os.environ.get("REDIS_URL"), prefix))


def gateway(mode: str) -> bool:
    port = os.environ.get(settings.BY_NAME["port"].env, settings.BY_NAME["port"].default)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/{mode}", timeout=2) as r:
        return r.status == 200


def scheduler(_mode: str) -> bool:
    pattern = _keys().scheduler_seen(f"scheduler-{socket.gethostname()}-*")
    return next(_redis().scan_iter(pattern), None) is not None


def worker(mode: str) -> bool:
    client, keys = _redis(), _keys()
    worker_id = os.environ.get(settings.BY_NAME["worker_id"].env)
    if worker_id:
        beats = [client.get(keys.worker_heartbeat(worker_id))]
    else:  # the default id, <hostname>-<pid>: the heartbeat of this container's worker
        beats = [client.get(k) for k in client.scan_iter(keys.worker_heartbeat(socket.gethostname() + "-*"))]
    for beat in beats:
        if beat is None:
            continue
        try:
            info = WorkerInfo.from_wire(beat)
        except (WireError, TypeError):
            continue
        if mode == "live" or not info.draining:
            return True
    return False


CHECKS = {"gateway": gateway, "scheduler": scheduler, "worker": worker}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2 or argv[0] not in CHECKS or (len(argv) == 2 and argv[1] not in MODES):
        print(f"usage: python -m phaseserve.healthcheck {{{'|'.join(CHECKS)}}} [{'|'.join(MODES)}]",
              file=sys.stderr)
        return 2
    mode = argv[1] if len(argv) == 2 else "ready"
    try:
        if CHECKS[argv[0]](mode):
            return 0
        print(f"{argv[0]} not {mode}", file=sys.stderr)
        return 1
    except Exception as e:  # any failure to ask is "not healthy", said in one line
        print(f"{argv[0]} not {mode}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
