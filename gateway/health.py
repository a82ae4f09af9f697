"""What the gateway's health routes say, decided from what Redis shows (pure: no I/O).

- `/health/live`: the gateway's event loop answers. Nothing a restart of the gateway would fix is
  checked (a Redis or scheduler outage is not the gateway's fault).
- `/health/ready`: the gateway can get a request served now: its token channel is subscribed, a scheduler
  is alive (its mark, `Keys.scheduler_alive`, is refreshed every worker refresh of the active one), and
  that scheduler plans on at least one live worker.
- `/health`: the whole picture for people and `phaseserve up`: `ok`, `degraded` (served, but not as laid
  out: no live scheduler, a worker not adopted yet, or a phase layout missing one of its pools, whose
  other pool then does both phases), or `unavailable` (503: no live worker, or no token channel).

A layout missing a pool is degraded, not unready: every gateway sees the same workers, so failing
readiness for it would take all of them out of their Service at once and turn a slower stack into a
down one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"


@dataclass
class Health:
    status: str
    problems: list[str] = field(default_factory=list)  # why not ok, in words
    ready: bool = False  # what /health/ready answers
    ready_problems: list[str] = field(default_factory=list)


def layout_problems(roles: Counter) -> list[str]:
    """A phase layout missing one of its pools (mixed workers do both phases)."""
    if roles["mixed"]:
        return []
    if roles["decode"] and not roles["prefill"]:
        return ["decode workers but no prefill worker is live: the decode workers prefill every prompt themselves"]
    if roles["prefill"] and not roles["decode"]:
        return ["prefill workers but no decode worker is live: the prefill workers decode what they prefill"]
    return []


def assess(roles: Counter, token_channel: bool, scheduler_alive: bool, scheduler_workers: int) -> Health:
    """The gateway's health from the live workers' roles, its token channel, the scheduler's mark, and the
    number of workers the scheduler plans on (its stats)."""
    unavailable = []
    if not sum(roles.values()):
        unavailable.append("no live worker")
    if not token_channel:
        unavailable.append("not subscribed to its token channel")
    not_ready = list(unavailable)
    if not scheduler_alive:
        not_ready.append("no live scheduler: requests wait in the queue until one takes the lease")
    elif not scheduler_workers:
        not_ready.append("the scheduler has adopted no worker yet")
    degraded = [p for p in not_ready if p not in unavailable]
    if scheduler_alive and 0 < scheduler_workers < sum(roles.values()):
        degraded.append("the scheduler has not adopted every live worker yet")
    degraded += layout_problems(roles)
    status = UNAVAILABLE if unavailable else DEGRADED if degraded else OK
    return Health(status, unavailable + degraded, ready=not not_ready, ready_problems=not_ready)
