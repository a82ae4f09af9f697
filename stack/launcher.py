"""`phaseserve up`: the whole stack as one process tree.

Starts Redis (an embedded private server unless --redis-url is given), then
the scheduler, one worker (or --workers N mixed ones, plus --prefill-workers P
and --decode-workers D with those roles, each on its share of the cores) and
the gateway as child processes, waits until the
gateway's /health answers 200 with every worker asked for live and adopted by
the scheduler, and says where it serves. Ctrl-C or SIGTERM stops every child
(terminate, wait, kill) and exits 0. A worker that dies is started again (its
sequences are recomputed on the others, or on it once back), after a wait that
doubles while it keeps dying soon after its start (WorkerRestarts); if any other
child dies, the rest are stopped and `up` exits non-zero.

Children run in sessions of their own: a Ctrl-C or a signal to `up`'s process group reaches `up` only, which
stops them in order (the gateway first, Redis last), so nothing logs a Redis that went away first. They get
a parent-death signal, so even a SIGKILLed launcher leaves no orphans. Workers are stopped with SIGINT (also
their parent-death signal), which stops a worker at once: SIGTERM would make it drain (wait for the scheduler
to move its sequences away), pointless when the scheduler and the gateway stop with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import json
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import structlog

from phaseserve import logs, settings
from phaseserve.cpus import usable_cores, worker_threads
from phaseserve.procs import child_setup
from phaseserve.redis_client import redacted
from phaseserve.redis_server import EmbeddedRedis, free_port

log = structlog.get_logger("phaseserve.up")

# start order; stopped in reverse, so the gateway stops taking requests first
SERVICES = ("scheduler", "worker", "gateway")
MODULE = {"scheduler": "phaseserve.scheduler", "worker": "phaseserve.workers", "gateway": "phaseserve.gateway"}


class LaunchError(RuntimeError):
    pass


def child_argv(service: str, values: dict) -> list[str]:
    """The flags of `service` whose values `up` knows, spelled so the child's parser reads them back
    (secret ones go by environment: child_env)."""
    argv: list[str] = []
    for s in settings.settings_for(service):
        value = values.get(s.name)
        if value is None or s.secret:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        if isinstance(value, list):  # a repeatable setting: every value after one flag (none: no flag)
            argv += [s.flag, *map(str, value)] if value else []
            continue
        argv += [s.flag, str(value)]
    return argv


def child_env(service: str, values: dict) -> dict[str, str]:
    """The child's environment: ours, plus the secret settings `up` knows (an API key, the Redis URL)."""
    env = dict(os.environ)
    for s in settings.settings_for(service):
        if s.secret and values.get(s.name) is not None:
            env[s.env] = str(values[s.name])
    return env


def health_url(host: str, port: int) -> str:
    # a wildcard bind is reachable on loopback
    h = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in h:
        h = f"[{h}]"
    return f"http://{h}:{port}"


def port_taken(host: str, port: int) -> bool:
    """Whether the gateway's address is already bound (checked before anything starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT is not "taken"
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


ROLE_FLAGS = (("mixed", "workers", "worker"), ("prefill", "prefill_workers", "prefill"),
              ("decode", "decode_workers", "decode"))  # (role, setting, process name prefix)


def worker_roles(values: dict) -> dict[str, str]:
    """Process name -> role of each worker `up` starts (the names are core_placement's keys too): one mixed
    worker `worker` by default, else `worker-i` (mixed), `prefill-i`, `decode-i`. Raises LaunchError for
    counts that make no deployment."""
    counts = {role: values.get(name) or 0 for role, name, _ in ROLE_FLAGS}
    if values.get("workers") is None and not (counts["prefill"] or counts["decode"]):
        counts["mixed"] = 1  # the default; with roles asked for, mixed ones only if asked for too
    for role, name, _ in ROLE_FLAGS:
        if not isinstance(counts[role], int) or counts[role] < 0:
            raise LaunchError(f"--{name.replace('_', '-')} must be a whole number >= 0, got {counts[role]!r}")
    if not sum(counts.values()):
        raise LaunchError("no worker to start: give --workers (mixed), or --prefill-workers and --decode-workers, "
                          "at least 1")
    if counts["prefill"] and not (counts["decode"] or counts["mixed"]):
        raise LaunchError(f"--prefill-workers {counts['prefill']} with no worker to decode: add --decode-workers "
                          "(or --workers)")
    if counts["decode"] and not (counts["prefill"] or counts["mixed"]):
        raise LaunchError(f"--decode-workers {counts['decode']} with no worker to prefill: add --prefill-workers "
                          "(or --workers)")
    if counts == {"mixed": 1, "prefill": 0, "decode": 0}:
        return {"worker": "mixed"}
    return {f"{prefix}-{i}": role for role, _, prefix in ROLE_FLAGS for i in range(counts[role])}


def worker_names(values: dict) -> list[str]:
    """The worker processes' names in `up` (and their keys in core_placement)."""
    return list(worker_roles(values))


def core_placement(values: dict) -> dict[str, list[int] | None] | None:
    """Which CPUs each process runs on (keys: worker_names(), "relay", "gateway", "scheduler", "redis"),
    or None (all anywhere). With bind_cores, each worker (whatever its role) gets cores of its own (an equal
    share, cut to the threads it uses); the other services share what is left, or run anywhere (None) when
    nothing is. A single worker that would use every core is not pinned at all. Unpinned, a small model's
    worker loses steps to the gateway, scheduler and Redis waking up on its cores (docs/architecture.md)."""
    if not values.get("bind_cores") or not hasattr(os, "sched_setaffinity"):
        return None
    cores = usable_cores()
    names = worker_names(values)
    num_workers = len(names)
    share = len(cores) // num_workers
    if share < 1:  # more workers than cores: the kernel places them
        return None
    n = min(share, worker_threads(values.get("num_threads") or 0, values["model"], share))
    rest = cores[n * num_workers:]
    if num_workers == 1 and not rest:
        return None
    placement: dict[str, list[int] | None] = {
        name: cores[i * n:(i + 1) * n] for i, name in enumerate(names)}
    others = rest or None
    # a relay is mostly asleep: with no spare core it may run on any, not only on its worker's
    placement.update(relay=rest or cores, gateway=others, scheduler=others, redis=others)
    return placement


class WorkerRestarts:
    """When to start a dead worker again: at once the first time, then after a wait that doubles (up to
    `cap_s`) while it keeps dying within `stable_s` of its start, so one that crashes at start does not
    spin. Pure: the caller passes the clock."""

    def __init__(self, base_s: float = 1.0, cap_s: float = 30.0, stable_s: float = 60.0):
        self.base_s, self.cap_s, self.stable_s = base_s, cap_s, stable_s
        self.quick_deaths: dict[str, int] = {}  # name -> deaths in a row, each soon after its start

    def delay(self, name: str, started_at: float, died_at: float) -> float:
        """Seconds to wait before starting `name` again, given when this life of it started and died."""
        if died_at - started_at >= self.stable_s:
            self.quick_deaths[name] = 0
        n = self.quick_deaths.get(name, 0)
        self.quick_deaths[name] = n + 1
        return 0.0 if n == 0 else min(self.cap_s, self.base_s * 2 ** (n - 1))


def layout_ready(health: dict, roles: dict[str, str]) -> bool:
    """Whether a /health body shows the worker layout `up` was asked for in effect: a live worker of each
    role for every one asked for, and the scheduler planning on all of them (a worker it has not adopted
    yet gets no sequence: a prefill worker alone would prefill and decode everything)."""
    live = Counter(health.get("worker_roles") or {})
    if any(live[role] < n for role, n in Counter(roles.values()).items()):
        return False
    return (health.get("scheduler_workers") or 0) >= len(roles)


@dataclass
class Stack:
    """The running children of one `up`, plus the embedded Redis if it started one."""

    values: dict
    redis: EmbeddedRedis | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    output: object = None  # where the children write their logs (a file); None: the launcher's own stderr
    roles: dict[str, str] = field(default_factory=dict)  # worker process name -> its role (worker_roles)
    placement: dict | None = None
    started_at: dict[str, float] = field(default_factory=dict)  # process name -> when it was (re)started
    restarts: WorkerRestarts = field(default_factory=WorkerRestarts)
    restart_at: dict[str, float] = field(default_factory=dict)  # dead worker -> when to start it again

    def start(self) -> None:
        roles = self.roles = worker_roles(self.values)
        names, num_workers = list(roles), len(roles)
        placement = self.placement = core_placement(self.values)
        if placement:  # a pinned worker would count only its own cores when choosing threads
            self.values["num_threads"] = len(placement[names[0]])
            # its Redis relay runs beside the other services, off the model's cores
            self.values["relay_cpus"] = ",".join(map(str, placement["relay"]))
        elif num_workers > 1 and not self.values.get("num_threads"):
            # unpinned workers each choosing threads for the whole machine would oversubscribe it
            self.values["num_threads"] = max(1, len(usable_cores()) // num_workers)
        if not self.values.get("redis_url"):
            # not the gateway's port: it is free until the gateway starts, and may be what the kernel offers
            self.redis = EmbeddedRedis(port=free_port(avoid={self.values.get("port")}),
                                       cpus=placement["redis"] if placement else None).start()
            self.values["redis_url"] = self.redis.url
            log.info("embedded redis started", url=redacted(self.redis.url))
        for service in SERVICES:
            for name in names if service == "worker" else [service]:
                self.spawn(name, service)

    def spawn(self, name: str, service: str) -> None:
        cmd = [sys.executable, "-m", MODULE[service], *child_argv(service, self.values)]
        worker = service == "worker"
        if worker:
            cmd += ["--role", self.roles[name]]
        cpus = self.placement[name] if self.placement else None
        log.debug("starting", service=name, cmd=cmd, cpus=cpus)
        # worker ids stay distinct without flags: each defaults to hostname-pid
        self.procs[name] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self.output, stderr=self.output, start_new_session=True,
            preexec_fn=child_setup(cpus, signal.SIGINT if worker else signal.SIGTERM),
            env=child_env(service, self.values))
        self.started_at[name] = time.monotonic()

    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and name not in self.restart_at:
                return name, proc.returncode
        return None

    def tend(self, now: float | None = None) -> None:
        """Start again the workers that died (each after its WorkerRestarts wait). Raises LaunchError when
        another service died: the stack cannot serve without it."""
        now = time.monotonic() if now is None else now
        while (dead := self.dead_child()) is not None:
            name, code = dead
            if name not in self.roles:
                raise LaunchError(f"{name} exited with code {code}; stopping the stack")
            delay = self.restarts.delay(name, self.started_at[name], now)
            self.restart_at[name] = now + delay
            log.warning("worker exited; starting it again", service=name, exit_code=code,
                        restart_in_s=round(delay, 1))
        for name, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[name]
                self.spawn(name, "worker")

    def wait_healthy(self, url: str, timeout: float, stop: threading.Event) -> None:
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            dead = self.dead_child()
            if dead:
                raise LaunchError(f"{dead[0]} exited with code {dead[1]} during start-up")
            health = None
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        health = json.loads(r.read())
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if health is not None and layout_ready(health, self.roles):
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"the stack did not become healthy within {timeout:.0f}s ({url}/health"
                                  + (f": {health}" if health else "") + ")")
            stop.wait(0.25)

    def stop(self, timeout: float = 15.0) -> None:
        order = list(reversed(self.procs))  # started in SERVICES order: the gateway first, the scheduler last
        for name in order:  # ask all at once, then wait: their shutdowns overlap
            proc = self.procs[name]
            if proc.poll() is None:
                if name in self.roles:  # SIGTERM would drain it, waiting on a scheduler that stops too
                    proc.send_signal(signal.SIGINT)
                else:
                    proc.terminate()
        deadline = time.monotonic() + timeout
        for name in order:
            proc = self.procs[name]
            try:  # no second SIGTERM: a service in its graceful shutdown would take it as "die now"
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not stop in time; killing", service=name)
                proc.kill()
                proc.wait()
            log.info("stopped", service=name, exit_code=proc.returncode)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def parse_args(argv: list[str] | None):
    import argparse

    parser = argparse.ArgumentParser(prog="phaseserve up", description="Run the whole stack on this machine.")
    settings.add_arguments(parser, "up")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for /health before giving up [default: %(default)s]")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("up", args.log_level, args.log_json)
    try:
        worker_roles(vars(args))
    except LaunchError as e:
        print(f"phaseserve up: {e}", file=sys.stderr)
        return 1
    if args.drain_timeout < 0:
        print(f"phaseserve up: --drain-timeout must be >= 0 (0 = hand back at once), got {args.drain_timeout}",
              file=sys.stderr)
        return 1
    if port_taken(args.host, args.port):
        print(f"phaseserve up: port {args.port} on {args.host} is already in use; stop what holds it or "
              "choose another with --port", file=sys.stderr)
        return 1
    values = vars(args).copy()
    # resolve (fetch, convert) once, here, before starting anything; the children get the folder
    model = settings.resolve_model(args.model, "phaseserve up", args.cache_dir)
    values["model"] = model.path
    values["served_model_name"] = args.served_model_name or model.name
    stop = threading.Event()
    got_signal: list[int] = []

    def on_signal(signum, _frame):
        got_signal.append(signum)
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    stack = Stack(values)
    url = health_url(args.host, args.port)
    code = 0
    try:
        stack.start()
        stack.wait_healthy(url, args.startup_timeout, stop)
        if not stop.is_set():
            print(f"phaseserve: serving {values['served_model_name']} at {url}/v1 (OpenAI API; /health, /metrics)",
                  flush=True)
            print(f"phaseserve: model folder {values['model']}; redis {redacted(values['redis_url'])}; "
                  "Ctrl-C to stop", flush=True)
        while not stop.is_set():
            stack.tend()
            stop.wait(0.2)
        log.info("stopping", signal=signal.Signals(got_signal[0]).name if got_signal else None)
    except LaunchError as e:
        print(f"phaseserve up: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        # a second Ctrl-C while stopping must not leave children behind
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return code
