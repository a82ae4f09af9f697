"""The cluster's stats, pure: the counters kept between workers, and the sum over every live worker's policy
that the service writes to the stats key (the gateway's /metrics reads it).

A policy's counters go with its worker; the ones the cluster's stats count since the scheduler took the
lease are kept here when a worker goes away (`retire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.handoff_counters import HandoffCounters
from scheduler.policy import WorkerPolicy
from scheduler.quarantine import Quarantine
from scheduler.speculation import SpeculationStats

PREFIX_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions")
# a policy's counters kept when its worker goes away (the cluster's stats are since the scheduler started)
RETIRED_COUNTERS = (*PREFIX_COUNTERS, "num_sat_out")


@dataclass
class ClusterCounters:
    """What the cluster counts itself, and what it kept of the policies of workers that went away."""

    num_steps_given_up: int = 0
    num_stale_results: int = 0  # results refused: of a plan given up, a retired life, an older epoch
    retired_preemptions: int = 0  # preemptions counted by policies of workers that went away
    # counters of policies of workers that went away (prefix caches went with them)
    retired_counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in RETIRED_COUNTERS})
    # StepResult.grammar_masks summed: the gateway's mask histogram
    grammar_masks: list[float] = field(default_factory=list)
    dirty: bool = True  # something changed since the stats were last written

    def retire(self, policy: WorkerPolicy) -> None:
        """Keep the counters of a policy whose worker went away."""
        self.retired_preemptions += policy.num_preemptions
        pstats = policy.stats()
        for k in RETIRED_COUNTERS:
            self.retired_counts[k] += pstats[k]

    def add_grammar_masks(self, counts: list[float]) -> None:
        if len(self.grammar_masks) != len(counts):  # the first, or a worker with other buckets: start over
            self.grammar_masks = [0.0] * len(counts)
        self.grammar_masks = [a + b for a, b in zip(self.grammar_masks, counts)]


def cluster_stats(slots: list, parked: list, counters: ClusterCounters, handoffs: HandoffCounters,
                  quarantine: Quarantine) -> dict:
    """The stats key's contents: every live worker's policy summed, with the cluster's own counters.
    `slots`: the live WorkerSlots; `parked`: (request, outputs) waiting for a worker."""
    policies = [s.policy for s in slots]
    return {
        "num_waiting": sum(p.num_waiting for p in policies) + len(parked),
        # prompt tokens not prefilled yet (queued, parked, or mid-prompt): the unmet demand a deployment
        # scales its workers on
        "num_waiting_tokens": sum(p.queued_prefill_tokens for p in policies)
        + sum(len(r.prompt_ids) + len(o or ()) for r, o in parked),
        "num_stale_results": counters.num_stale_results,
        "num_running": sum(p.num_running for p in policies),
        "kv_blocks_used": sum(p.num_used_blocks for p in policies),
        "kv_blocks_total": sum(s.info.num_blocks for s in slots),
        "num_preemptions": sum(p.num_preemptions for p in policies) + counters.retired_preemptions,
        "num_fair_share_preemptions": sum(p.num_fair_share_preemptions for p in policies),  # live workers'
        "num_workers": len(policies),
        **handoffs.as_stats(),
        "num_steps_held_by_itl_target": sum(p.num_steps_held_by_itl_target for p in policies),
        "num_steps_past_itl_patience": sum(p.num_steps_past_itl_patience for p in policies),
        **prefix_cache_stats(policies, counters),
        **SpeculationStats.total([p.spec_stats for p in policies]).as_stats(),
        "grammar_masks": counters.grammar_masks,
        "num_sat_out": sum(p.num_sat_out for p in policies) + counters.retired_counts["num_sat_out"],
        "num_quarantined": quarantine.num_quarantined,
    }


def prefix_cache_stats(policies: list[WorkerPolicy], counters: ClusterCounters) -> dict:
    """Prefix cache counters (tokens queried and found, blocks evicted) since this scheduler took the
    lease, and the blocks cached now."""
    per_policy = [p.stats() for p in policies]
    out = {k: sum(p[k] for p in per_policy) + counters.retired_counts[k] for k in PREFIX_COUNTERS}
    out["kv_blocks_cached"] = sum(p["num_cached_blocks"] for p in per_policy)
    return out
