"""The model process's end of the relay (workers/relay.py): starting the child process, its two pipes, and
stopping it. The messages are defined in phaseserve/wire/relay_pipe.py."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import structlog

from phaseserve.procs import stop_process
from phaseserve.wire import PlanDelivery, RelayConfig, RelayNotice, relay_to_model

log = structlog.get_logger("phaseserve.workers.service")


class RelayError(RuntimeError):
    """The relay process failed (Redis unreachable, or it died): the worker cannot go on."""


class RelayLink:
    def __init__(self, config: RelayConfig):
        self.config = config
        self.process: subprocess.Popen | None = None
        self.plans: Connection | None = None  # relay -> model: PlanDelivery and RelayNotice
        self.writes: Connection | None = None  # model -> relay: the config, then StepWrites and RelayNotice

    def start(self) -> None:
        plans_read, plans_write = Pipe(duplex=False)
        writes_read, writes_write = Pipe(duplex=False)
        fds = (plans_write.fileno(), writes_read.fileno())
        # No preexec_fn (the relay sets its own CPUs and parent-death signal), so Python spawns it with
        # vfork, not fork: a fork marks every page of this process copy-on-write, and each KV-cache and
        # heap page then faults once on its next write, for as long as the run keeps reaching new cache
        # blocks (docs/architecture.md).
        self.process = subprocess.Popen([sys.executable, "-m", "phaseserve.workers.relay", *map(str, fds)], pass_fds=fds,
                                        stdin=subprocess.DEVNULL)
        plans_write.close()  # the relay's ends: ours would keep the pipes open after it exits
        writes_read.close()
        self.plans, self.writes = plans_read, writes_write
        self.writes.send_bytes(self.config.to_pipe())

    def stop(self, timeout: float = 5.0) -> None:
        """Close `writes`: the relay sends what is queued, removes the heartbeat and exits."""
        if self.process is None:
            return
        self.writes.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("relay did not stop in time; stopping it")
            stop_process(self.process)
        self.plans.close()

    def receive(self, timeout: float) -> PlanDelivery | RelayNotice | None:
        """The relay's next message, or None if none came within `timeout`. Raises RelayError if the relay
        exited, or forwarded a Redis failure (a delivery without an entry id)."""
        try:
            if not self.plans.poll(timeout):
                return None
            message = relay_to_model(self.plans.recv_bytes())
        except (EOFError, OSError):
            raise RelayError(f"the relay process exited (code {self.process.poll()})") from None
        if isinstance(message, PlanDelivery) and message.entry_id is None:
            raise RelayError(message.data)
        return message

    def send(self, message: bytes) -> None:
        try:
            self.writes.send_bytes(message)
        except OSError:  # the relay is gone: its exit code says why
            code = self.process.poll() if self.process else None
            raise RelayError(f"the relay process exited (code {code})") from None
