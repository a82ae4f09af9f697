"""The scheduler's stats as types: what a worker's policy counts, summed over the cluster, published under the
stats key, and read back by the gateway for /metrics. One definition for both sides.

The published form is a flat msgpack map (`SchedulerStats.to_wire`); its keys are the ones the gateway and
operators have always read, so readers of an older scheduler's map get zeros for what it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


@dataclass
class PrefixCacheStats:
    """Prefix cache counters: prefill tokens looked up at (re)starts and found cached, blocks evicted, and the
    blocks named in the cache now (a gauge)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    cached_blocks: int = 0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries + other.queries, self.hits + other.hits,
                                self.evictions + other.evictions, self.cached_blocks + other.cached_blocks)

    def counters_only(self) -> PrefixCacheStats:
        """The cumulative counters without the gauge: what a worker that went away leaves to the totals."""
        return PrefixCacheStats(self.queries, self.hits, self.evictions)


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters: drafts allowed, verified and kept, in total and by position in the run
    (index 0 = the first draft after the decoded token)."""

    num_draft_slots: int = 0  # drafts plans allowed (budget and blocks reserved), proposed or not
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts that kept the first `accepted`."""
        self.num_verifications += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted

    def copy(self) -> SpecDecodingStats:
        return replace(self, drafted_at=list(self.drafted_at), accepted_at=list(self.accepted_at))

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        n = max(len(self.drafted_at), len(other.drafted_at))
        return SpecDecodingStats(
            self.num_draft_slots + other.num_draft_slots, self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens, self.num_verifications + other.num_verifications,
            _add_lists(self.drafted_at, other.drafted_at, n), _add_lists(self.accepted_at, other.accepted_at, n))


def _add_lists(a: list[int], b: list[int], n: int) -> list[int]:
    return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(n)]


@dataclass
class HandoffStats:
    """Prefill -> decode handoffs across the cluster: sequences handed over, kept on their prefill worker for
    want of a decode worker's room, KV received or failed, and what was moved."""

    sequences: int = 0
    kept: int = 0
    received: int = 0
    failed: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """What the scheduler publishes about the whole cluster (counters since it took the lease)."""

    num_waiting: int = 0
    # prompt tokens not prefilled yet (queued, parked, or mid-prompt): the unmet demand a deployment scales on
    num_waiting_tokens: int = 0
    num_stale_results: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    num_fair_share_preemptions: int = 0  # live workers'
    num_workers: int = 0
    handoffs: HandoffStats = field(default_factory=HandoffStats)
    num_steps_held_by_itl_target: int = 0
    num_steps_past_itl_patience: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    grammar_masks: list[float] = field(default_factory=list)  # per mask-time bucket, then the seconds summed
    num_sat_out: int = 0
    num_quarantined: int = 0
    updated_at: float = 0.0  # unix time the service wrote it

    def to_wire(self) -> dict:
        """The flat map under the stats key (its keys and their order are the published form)."""
        h, pc, sd = self.handoffs, self.prefix_cache, self.spec_decoding
        out = {f.name: getattr(self, f.name) for f in fields(self)[:9]}
        out.update({
            "handoff_sequences": h.sequences, "handoff_kept": h.kept, "handoff_received": h.received,
            "handoff_failed": h.failed, "handoff_blocks": h.blocks, "handoff_bytes": h.bytes,
            "handoff_seconds": round(h.seconds, 6), "handoff_bytes_by_transport": dict(h.bytes_by_transport),
            "num_steps_held_by_itl_target": self.num_steps_held_by_itl_target,
            "num_steps_past_itl_patience": self.num_steps_past_itl_patience,
            "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
            "prefix_cache_evictions": pc.evictions, "kv_blocks_cached": pc.cached_blocks,
            "num_draft_slots": sd.num_draft_slots, "num_draft_tokens": sd.num_draft_tokens,
            "num_accepted_tokens": sd.num_accepted_tokens, "num_verifications": sd.num_verifications,
            "drafted_at": list(sd.drafted_at), "accepted_at": list(sd.accepted_at),
            "grammar_masks": self.grammar_masks, "num_sat_out": self.num_sat_out,
            "num_quarantined": self.num_quarantined,
        })
        if self.updated_at:
            out["updated_at"] = self.updated_at
        return out

    @classmethod
    def from_wire(cls, d: dict) -> SchedulerStats:
        """Read the published map; a key missing (an older scheduler) or of the wrong type reads as zero."""
        def num(key: str, kind=int):
            v = d.get(key, 0)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else kind(0)

        def ints(key: str) -> list[int]:
            v = d.get(key)
            return [x for x in v if isinstance(x, int)] if isinstance(v, list) else []

        by_transport = d.get("handoff_bytes_by_transport")
        masks = d.get("grammar_masks")
        return cls(
            **{f.name: num(f.name) for f in fields(cls)[:9]},
            handoffs=HandoffStats(num("handoff_sequences"), num("handoff_kept"), num("handoff_received"),
                                  num("handoff_failed"), num("handoff_blocks"), num("handoff_bytes"),
                                  num("handoff_seconds", float),
                                  dict(by_transport) if isinstance(by_transport, dict) else {}),
            num_steps_held_by_itl_target=num("num_steps_held_by_itl_target"),
            num_steps_past_itl_patience=num("num_steps_past_itl_patience"),
            prefix_cache=PrefixCacheStats(num("prefix_cache_queries"), num("prefix_cache_hits"),
                                          num("prefix_cache_evictions"), num("kv_blocks_cached")),
            spec_decoding=SpecDecodingStats(num("num_draft_slots"), num("num_draft_tokens"),
                                            num("num_accepted_tokens"), num("num_verifications"),
                                            ints("drafted_at"), ints("accepted_at")),
            grammar_masks=masks if isinstance(masks, list) else [],
            num_sat_out=num("num_sat_out"), num_quarantined=num("num_quarantined"),
            updated_at=num("updated_at", float))
