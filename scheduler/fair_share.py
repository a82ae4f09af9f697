"""Fair shares between tenants on one worker: weighted fair queueing on tokens. Pure; no I/O.

Every tenant has a virtual time: the tokens planned for it (prefill and decode) divided by its weight. The
tenant behind in virtual time goes next, so over any stretch where two tenants both have work, each gets
tokens in proportion to its weight whatever the other sends; a tenant with nothing to do does not bank
credit (it comes back at the least virtual time of the busy ones, start-time fair queueing's rule). What
a tenant holds of the worker (KV blocks, sequence slots) is measured against its weighted part of them, so
preemption takes from the tenant furthest over its share first. docs/tenants.md says how this meets
priorities and the gateway's limits.

With one tenant (every request without one is tenant "") none of this changes an order: `WorkerPolicy`
asks `TenantShares.is_shared` before it uses any of it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


@dataclass
class TenantShares:
    """The virtual time and weight of every tenant with sequences on one worker."""

    vtime: dict[str, float] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    active: Counter = field(default_factory=Counter)  # tenant -> its unfinished sequences here

    @property
    def is_shared(self) -> bool:
        """More than one tenant has work here: the fair-share rules apply."""
        return len(self.active) > 1

    def join(self, tenant: str, weight: float) -> None:
        """A sequence of `tenant` arrives. A tenant that had none starts at the least virtual time of the busy
        ones, so an idle spell is not credit to spend later (nor a debt)."""
        self.weight[tenant] = weight if weight > 0 else 1.0
        if not self.active[tenant]:
            busy = [self.vtime[t] for t in self.active if self.active[t]]
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), min(busy, default=0.0))
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A sequence of `tenant` finished, was cancelled or moved away."""
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            if not self.active:  # nobody busy: virtual time starts over (it only orders tenants against each other)
                self.vtime.clear()

    def charge(self, tenant: str, tokens: int) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + tokens / self.weight.get(tenant, 1.0)

    def usage(self, held: dict[str, float], total: float) -> dict[str, float]:
        """Each busy tenant's part of `total` (blocks, slots) held, over its weighted share of it: > 1 is over."""
        return usage_over_share(held, {t: self.weight.get(t, 1.0) for t in self.active}, total)


def usage_over_share(held: dict[str, float], weights: dict[str, float], total: float) -> dict[str, float]:
    """held[t] / (total * w_t / sum(w)) for every tenant in `weights` (those with work); 0 for none held."""
    wsum = sum(weights.values())
    if total <= 0 or wsum <= 0:
        return {t: 0.0 for t in weights}
    return {t: held.get(t, 0.0) / (total * w / wsum) for t, w in weights.items()}


def most_over_share(usage: dict[str, float], among: Iterable[str]) -> str | None:
    """The tenant among `among` furthest over its share (ties: the first by name, so the choice is stable)."""
    candidates = sorted(set(among))
    if not candidates:
        return None
    return max(candidates, key=lambda t: (usage.get(t, 0.0), -candidates.index(t)))


def fair_order(items: list[T], tenant_of: Callable[[T], str], vtime: dict[str, float],
               weight: dict[str, float], tokens_of: Callable[[T], int],
               tiebreak: dict[str, float] | None = None) -> list[T]:
    """`items` interleaved by weighted fair queueing: repeatedly the next item (in the given order) of the
    tenant least advanced in virtual time, counting what the items already taken would charge it; on a tie,
    the tenant with the least `tiebreak` (what it holds over its share: a tenant just arrived, whose virtual
    time starts level with the busy ones', goes before one that holds the worker). Within a tenant the given
    order (priority, arrival) is kept; with one tenant the order is unchanged."""
    tiebreak = tiebreak or {}
    queues: dict[str, list[T]] = {}
    for item in items:
        queues.setdefault(tenant_of(item), []).append(item)
    if len(queues) <= 1:
        return list(items)
    projected = {t: vtime.get(t, 0.0) for t in queues}
    heads = {t: 0 for t in queues}
    out: list[T] = []
    while len(out) < len(items):
        t = min((t for t in queues if heads[t] < len(queues[t])),
                key=lambda t: (projected[t], tiebreak.get(t, 0.0), t))
        item = queues[t][heads[t]]
        heads[t] += 1
        out.append(item)
        projected[t] += max(1, tokens_of(item)) / weight.get(t, 1.0)
    return out


def weighted_split(budget: float, demands: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of `budget` by weight (water-filling): a tenant that wants less than its weighted
    part gets what it wants, and what it leaves is split among the others by weight. So nothing is held back
    from a tenant with work while the budget has room (work-conserving), and a tenant with more work than its
    part gets no more than it."""
    caps: dict[str, float] = {}
    active = {t for t, d in demands.items() if d > 0}
    left = budget
    while active:
        wsum = sum(weights.get(t, 1.0) for t in active)
        part = {t: left * weights.get(t, 1.0) / wsum for t in active}
        content = [t for t in active if demands[t] <= part[t]]
        if not content:
            caps.update(part)
            break
        for t in content:
            caps[t] = demands[t]
            left -= demands[t]
            active.discard(t)
    return caps
