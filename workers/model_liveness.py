"""Is the worker's model process making progress? The relay's measure of it (workers/relay.py), read by the
heartbeat (workers/heartbeat.py) and the step writer. No I/O.

A heartbeat thread keeps `worker:<id>` alive (with a TTL) while the model makes progress: a model step
may take up to `step_timeout` seconds from when its plan is due (handed over, or the previous step
written, whichever is later). Past that the model counts as hung (SIGSTOPped, stuck in a kernel): the
relay deletes the heartbeat and stops beating, so the scheduler retires the worker and recomputes its
sequences elsewhere at its next look, and every write of a plan handed over before then is void (only
acked). When the model makes progress again the relay beats with a new `started_at` (a new life); the
scheduler adopts it as a new worker and its first plan (`reset`) ends the void. See `ModelLiveness`.
"""

from __future__ import annotations

import threading
from collections import deque

import msgpack


def plan_timeout(data: bytes) -> float:
    """The deadline a plan carries (StepPlan.timeout_s), 0 if none or unreadable (the model reports that)."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return float(body.get("timeout_s", 0.0)) if isinstance(body, dict) else 0.0
    except Exception:  # noqa: BLE001 -- a plan the model cannot read either; it acks it at once
        return 0.0


class ModelLiveness:
    """Is the model process making progress? Counts plans handed to it and steps it wrote back.

    A plan is due when it is handed over, or when the step before it is written back, whichever is later;
    the model is hung when its oldest unfinished plan has been due for longer than `step_timeout`. Once
    hung, the worker's current life is over: every write until the model reports a `reset` plan (the
    scheduler's first to the next life) is void, and the heartbeat announces the next life (a new
    WorkerInfo.started_at) once the model moves again. Thread-safe: the reader, writer and heartbeat threads share it.
    """

    def __init__(self, step_timeout: float):
        self.step_timeout = step_timeout
        self.lock = threading.Lock()
        self.timeouts: deque[float] = deque()  # per plan handed over and not yet written back, oldest first
        self.due_at = 0.0  # when the oldest outstanding plan became due (time.monotonic())
        self.void = False  # the model overran: this life's writes are dropped until a reset plan
        self.hung = False  # overran, and no step written back since
        self.incarnation = 0
        self.overrun_deadline = 0.0  # the deadline the last overrun plan carried (for the log)

    @property
    def outstanding(self) -> int:
        return len(self.timeouts)

    def plan_delivered(self, now: float, timeout: float = 0.0) -> None:
        """A plan handed to the model; `timeout` > 0: the scheduler's deadline for it (a long step's is longer)."""
        with self.lock:
            if not self.timeouts:
                self.due_at = now
            self.timeouts.append(timeout if timeout > 0 else self.step_timeout)

    def _check(self, now: float) -> bool:
        """Enter the void if the oldest plan is overdue; True if this call did (caller holds the lock)."""
        if self.void or not self.timeouts or now - self.due_at <= self.timeouts[0]:
            return False
        self.overrun_deadline = self.timeouts[0]
        self.void = self.hung = True
        self.incarnation += 1
        return True

    def check(self, now: float) -> bool:
        with self.lock:
            return self._check(now)

    def step_written(self, now: float, reset: bool) -> tuple[bool, bool]:
        """A step came back: (keep its writes?, did the model just turn out hung?)."""
        with self.lock:
            hung = self._check(now)
            if self.timeouts:
                self.timeouts.popleft()
            self.due_at = now
            self.hung = False
            if reset and self.void:
                self.void = False  # a plan of the new life: everything before it was dropped
                return True, hung
            return not self.void, hung

    def is_hung(self) -> bool:
        with self.lock:
            return self.hung
