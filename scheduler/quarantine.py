"""Dead-lettering poison requests, pure: a sequence present at too many worker failures is failed, not moved.

A worker that dies, or whose model step overruns its deadline (its relay then withdraws the heartbeat), is
retired and its sequences are recomputed on another worker. If one of them is what brought the worker down
(an input that crashes or hangs the model), moving it takes the next worker down too, and the next. So, as a
message queue dead-letters a message delivered too often, every sequence that was running on a failed
worker gets a strike, and one at `max_failures` strikes is failed with an error instead of being moved
again (docs/architecture.md, "Poison requests").

Failures that say nothing about the sequences give no strike: a worker leaving on purpose (draining), and
workers lost while the scheduler itself could not reach Redis (their heartbeats lapsed with the outage).
The strikes live in the request's record, so a scheduler that takes over keeps counting.
"""

from __future__ import annotations

STRIKES_FIELD = "strikes"  # in a request's record (Keys.request_record)


class Quarantine:
    def __init__(self, max_failures: int = 2):
        self.max_failures = max_failures  # 0: never quarantine
        self.strikes: dict[str, int] = {}  # request id -> failed workers it was running on
        self.num_quarantined = 0

    def strike(self, request_id: str) -> bool:
        """The request was running on a worker that failed; True: it is quarantined now (fail it)."""
        n = self.strikes[request_id] = self.strikes.get(request_id, 0) + 1
        if self.max_failures and n >= self.max_failures:
            del self.strikes[request_id]
            self.num_quarantined += 1
            return True
        return False

    def count(self, request_id: str) -> int:
        return self.strikes.get(request_id, 0)

    def restore(self, request_id: str, strikes: int) -> None:
        """A strike count read back from the request's record (a scheduler taking over)."""
        if strikes > 0:
            self.strikes[request_id] = strikes

    def forget(self, request_id: str) -> None:
        """The request finished, failed or was cancelled."""
        self.strikes.pop(request_id, None)

    def message(self) -> str:
        return (f"request quarantined: it was running on {self.max_failures} workers that failed (died, or a "
                f"step overran its deadline); it is not retried, so it takes no more workers down")
