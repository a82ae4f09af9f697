"""Which running sequences nobody serves any more: for the scheduler, to cancel what a dead gateway left.

A gateway serving a client of a sequence refreshes `Keys.client_lease(seq_id)` every third of its lease TTL
(GatewayInfo.lease_ttl; the gateway's own heartbeat is `Keys.gateway_heartbeat(id)`). A client that goes
away is given `resume_grace` seconds to come back (Last-Event-ID, on any gateway), and the gateway it left
cancels the sequence itself if it does not. A gateway that dies cannot: its leases expire, and whoever
watches them (the scheduler) cancels each sequence whose lease has been gone for longer than the grace.

The scheduler's part, about once a second:

    present = [v is not None for v in await redis.mget([keys.client_lease(s) for s in running])]
    for seq_id in tracker.update(running, present, time.monotonic()):
        ... cancel it as on a CancelRequest(seq_id, "abort"), and token_log.append_abort(...) so that a
        client resuming later reads the end instead of waiting
"""

from __future__ import annotations


class OrphanTracker:
    """Pure: feed it the running sequences and whether each has a client lease; it says which to cancel.

    Only a sequence whose lease has been seen counts: a gateway that keeps no leases (an older one, or a
    client of the streams that is not a gateway) never has its sequences cancelled for want of one."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.missing_since: dict[str, float] = {}
        self.leased: set[str] = set()

    def update(self, seq_ids: list[str], lease_present: list[bool], now: float) -> list[str]:
        """-> the sequences whose lease has been missing for longer than the grace (each returned once)."""
        orphans = []
        seen = set()
        for seq_id, present in zip(seq_ids, lease_present):
            seen.add(seq_id)
            if present:
                self.leased.add(seq_id)
                self.missing_since.pop(seq_id, None)
                continue
            if seq_id not in self.leased:
                continue
            since = self.missing_since.setdefault(seq_id, now)
            if now - since > self.grace_s:
                orphans.append(seq_id)
        for seq_id in orphans:
            del self.missing_since[seq_id]
            self.leased.discard(seq_id)
        for seq_id in [s for s in self.missing_since if s not in seen]:  # finished or cancelled meanwhile
            del self.missing_since[seq_id]
        self.leased &= seen
        return orphans
