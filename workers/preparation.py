"""A sequence's preparation off the step thread: its grammar matcher, built (and its first mask computed) on
the runner's grammar threads while steps go on without it.

A step never waits for one: a sequence whose preparation is not ready sits out the step (the runner reports
it in StepResult.deferred), and one still unready `budget_s` after its build started fails alone. A build in
progress cannot be stopped (the engine offers no cancellation), so a failed one finishes on its thread and is
dropped; one not yet started is cancelled when its sequence goes (docs/architecture.md, "Poison requests").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class Preparation:
    """`build()` run on `pool`; when it started and whether it is done, without waiting for it."""

    def __init__(self, pool: Executor, build: Callable[[], Any], budget_s: float):
        self.budget_s = budget_s
        self.started_at: float | None = None  # time.monotonic() when a thread took it up
        self.future: Future = pool.submit(self._run, build)

    def _run(self, build: Callable[[], Any]) -> Any:
        self.started_at = time.monotonic()
        return build()

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Any:
        """The built object (raises what the build raised). Only once done(): a step never blocks on it."""
        if not self.future.done():
            raise RuntimeError("the preparation is not ready")
        return self.future.result()

    def overdue(self, now: float) -> bool:
        """Still building `budget_s` after it started (time spent queued behind other builds is not its own)."""
        return not self.future.done() and self.started_at is not None and now - self.started_at > self.budget_s

    def cancel(self) -> None:
        """Its sequence is gone: drop the build if it has not started."""
        self.future.cancel()
