"""What one worker's policy counts, as types: the counters it bumps while planning and applying results, and
the snapshot `WorkerPolicy.stats()` returns (those counters, its queues and blocks now, and its parts' stats).
The cluster sums the snapshots into the published `SchedulerStats` (phaseserve/scheduler_stats.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.scheduler_stats import PrefixCacheStats, SpecDecodingStats


@dataclass
class PolicyCounters:
    """Counts since the policy was made."""

    num_preemptions: int = 0
    num_fair_share_preemptions: int = 0  # of those, made for a tenant under its share (docs/tenants.md)
    num_resyncs: int = 0  # planned samples never reported: their sequences recomputed
    num_sat_out: int = 0  # steps a sequence sat out, its preparation on the worker not ready
    num_finished: int = 0
    num_cancelled: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_ignored_results: int = 0  # results of unknown or already applied steps
    num_ignored_events: int = 0  # token events at an unexpected offset
    num_steps_held_by_itl_target: int = 0
    num_steps_past_itl_patience: int = 0


@dataclass
class PolicyStats:
    """A snapshot of one worker's policy."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    num_steps: int  # the next step id (ids start at the policy's first one)
    num_steps_in_flight: int
    num_handoffs_in_flight: int
    num_handed_off: int
    num_handed_in: int
    counters: PolicyCounters = field(default_factory=PolicyCounters)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)

