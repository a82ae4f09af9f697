"""The cluster's stats, pure: the counters kept between workers, and the sum over every live worker's policy
that the service writes to the stats key (the gateway's /metrics reads it), as SchedulerStats
(phaseserve/scheduler_stats.py).

A policy's counters go with its worker; the ones the cluster's stats count since the scheduler took the
lease are kept here when a worker goes away (`retire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.scheduler_stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats
from phaseserve.scheduler.handoff_counters import HandoffCounters
from phaseserve.scheduler.policy import WorkerPolicy
from phaseserve.scheduler.policy_stats import PolicyCounters
from phaseserve.scheduler.quarantine import Quarantine


@dataclass
class ClusterCounters:
    """What the cluster counts itself, and what it kept of the policies of workers that went away."""

    num_steps_given_up: int = 0
    num_stale_results: int = 0  # results refused: of a plan given up, a retired life, an older epoch
    # counters of policies of workers that went away (the cluster's stats are since the scheduler started;
    # prefix caches went with them)
    retired: PolicyCounters = field(default_factory=PolicyCounters)
    retired_prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # StepResult.grammar_masks summed: the gateway's mask histogram
    grammar_masks: list[float] = field(default_factory=list)
    dirty: bool = True  # something changed since the stats were last written

    def retire(self, policy: WorkerPolicy) -> None:
        """Keep the counters of a policy whose worker went away."""
        pstats = policy.stats()
        self.retired.num_preemptions += pstats.counters.num_preemptions
        self.retired.num_sat_out += pstats.counters.num_sat_out
        self.retired_prefix_cache += pstats.prefix_cache.counters_only()

    def add_grammar_masks(self, counts: list[float]) -> None:
        if len(self.grammar_masks) != len(counts):  # the first, or a worker with other buckets: start over
            self.grammar_masks = [0.0] * len(counts)
        self.grammar_masks = [a + b for a, b in zip(self.grammar_masks, counts)]


def cluster_stats(slots: list, parked: list, counters: ClusterCounters, handoffs: HandoffCounters,
                  quarantine: Quarantine) -> SchedulerStats:
    """The stats key's contents: every live worker's policy summed, with the cluster's own counters.
    `slots`: the live WorkerSlots; `parked`: (request, outputs) waiting for a worker."""
    policies = [s.policy for s in slots]
    per = [p.stats() for p in policies]
    return SchedulerStats(
        num_waiting=sum(p.num_waiting for p in per) + len(parked),
        num_waiting_tokens=sum(p.queued_prefill_tokens for p in policies)
        + sum(len(r.prompt_ids) + len(o or ()) for r, o in parked),
        num_stale_results=counters.num_stale_results,
        num_running=sum(p.num_running for p in per),
        kv_blocks_used=sum(p.num_used_blocks for p in per),
        kv_blocks_total=sum(s.info.num_blocks for s in slots),
        num_preemptions=sum(p.counters.num_preemptions for p in per) + counters.retired.num_preemptions,
        num_fair_share_preemptions=sum(p.counters.num_fair_share_preemptions for p in per),  # live workers'
        num_workers=len(per),
        handoffs=handoffs.as_stats(),
        num_steps_held_by_itl_target=sum(p.counters.num_steps_held_by_itl_target for p in per),
        num_steps_past_itl_patience=sum(p.counters.num_steps_past_itl_patience for p in per),
        prefix_cache=sum((p.prefix_cache for p in per), counters.retired_prefix_cache),
        spec_decoding=sum((p.spec_decoding for p in per), SpecDecodingStats()),
        grammar_masks=list(counters.grammar_masks),
        num_sat_out=sum(p.counters.num_sat_out for p in per) + counters.retired.num_sat_out,
        num_quarantined=quarantine.num_quarantined)
