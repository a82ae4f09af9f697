"""The scheduler's stats as types (phaseserve/scheduler_stats.py): summed by type, published as the flat map
operators and gateways have always read, read back by the gateway into /metrics under the same names."""

from __future__ import annotations

import msgpack

from phaseserve.gateway.metrics import GatewayMetrics
from phaseserve.scheduler_stats import HandoffStats, PrefixCacheStats, SchedulerStats, SpecDecodingStats

# the published map's keys, in the order a scheduler before the typed stats wrote them
PUBLISHED_KEYS = [
    "num_waiting", "num_waiting_tokens", "num_stale_results", "num_running", "kv_blocks_used", "kv_blocks_total",
    "num_preemptions", "num_fair_share_preemptions", "num_workers", "handoff_sequences", "handoff_kept",
    "handoff_received", "handoff_failed", "handoff_blocks", "handoff_bytes", "handoff_seconds",
    "handoff_bytes_by_transport", "num_steps_held_by_itl_target", "num_steps_past_itl_patience",
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions", "kv_blocks_cached", "num_draft_slots",
    "num_draft_tokens", "num_accepted_tokens", "num_verifications", "drafted_at", "accepted_at", "grammar_masks",
    "num_sat_out", "num_quarantined",
]


def sample() -> SchedulerStats:
    return SchedulerStats(
        num_waiting=3, num_waiting_tokens=700, num_stale_results=1, num_running=2, kv_blocks_used=25,
        kv_blocks_total=100, num_preemptions=4, num_fair_share_preemptions=1, num_workers=2,
        handoffs=HandoffStats(5, 1, 4, 1, 40, 4096, 0.1234567, {"redis": 4096, "shm": 0}),
        num_steps_held_by_itl_target=6, num_steps_past_itl_patience=2,
        prefix_cache=PrefixCacheStats(queries=1000, hits=640, evictions=3, cached_blocks=12),
        spec_decoding=SpecDecodingStats(9, 6, 3, 2, [2, 2, 2], [2, 1, 0]),
        grammar_masks=[1.0, 0.0, 0.0], num_sat_out=7, num_quarantined=2)


def test_the_published_map_keeps_its_keys_their_order_and_values():
    wire = sample().to_wire()
    assert list(wire) == PUBLISHED_KEYS  # msgpack writes a map in this order: the bytes of old and new agree
    assert wire["handoff_seconds"] == 0.123457 and wire["kv_blocks_cached"] == 12
    assert wire["drafted_at"] == [2, 2, 2] and wire["handoff_bytes_by_transport"] == {"redis": 4096, "shm": 0}
    stamped = SchedulerStats(updated_at=5.0).to_wire()
    assert list(stamped) == [*PUBLISHED_KEYS, "updated_at"] and stamped["updated_at"] == 5.0


def test_the_published_map_reads_back_as_the_same_stats():
    stats = sample()
    stats.updated_at = 12.5
    back = SchedulerStats.from_wire(msgpack.unpackb(msgpack.packb(stats.to_wire()), raw=False))
    stats.handoffs.seconds = round(stats.handoffs.seconds, 6)
    assert back == stats


def test_a_map_from_an_older_scheduler_or_a_bad_one_reads_as_zeros():
    back = SchedulerStats.from_wire({"num_running": 2, "num_waiting": "three", "drafted_at": "x",
                                     "handoff_bytes_by_transport": None, "num_workers": True})
    assert back.num_running == 2 and back.num_waiting == 0 and back.num_workers == 0
    assert back.spec_decoding.drafted_at == [] and back.handoffs.bytes_by_transport == {}
    assert SchedulerStats.from_wire({}) == SchedulerStats()


def test_stats_sum_by_type():
    a = PrefixCacheStats(10, 4, 1, 3)
    assert a + PrefixCacheStats(5, 5, 0, 2) == PrefixCacheStats(15, 9, 1, 5)
    assert sum([a, a], PrefixCacheStats()) == PrefixCacheStats(20, 8, 2, 6)
    assert a.counters_only() == PrefixCacheStats(10, 4, 1, 0)  # a worker gone leaves its counts, not its cache
    s1 = SpecDecodingStats(3, 3, 1, 1, [1, 1, 1], [1, 0, 0])
    s2 = SpecDecodingStats(1, 1, 1, 1, [1], [1])
    assert s1 + s2 == SpecDecodingStats(4, 4, 2, 2, [2, 1, 1], [2, 0, 0])
    snapshot = s1.copy()  # what a policy's stats() hands out: later verifications do not change it
    s1.observe(2, 2)
    assert snapshot == SpecDecodingStats(3, 3, 1, 1, [1, 1, 1], [1, 0, 0]) and s1.accepted_at == [2, 1, 0]


def test_metrics_show_the_published_stats_under_their_names():
    metrics = GatewayMetrics("m")
    metrics.set_cluster_state(sample().to_wire(), [])
    text = metrics.render().decode()
    for line in (
        "phaseserve_num_requests_waiting 3.0", "phaseserve_num_requests_running 2.0",
        "phaseserve_kv_cache_usage_ratio 0.25", "phaseserve_num_prefill_tokens_waiting 700.0",
        "phaseserve_num_stale_step_results 1.0", "phaseserve_num_preemptions 4.0",
        "phaseserve_num_fair_share_preemptions 1.0",
        "phaseserve_kv_handoff_sequences 5.0", "phaseserve_kv_handoff_kept 1.0", "phaseserve_kv_handoff_received 4.0",
        "phaseserve_kv_handoff_failed 1.0", "phaseserve_kv_handoff_blocks 40.0", "phaseserve_kv_handoff_bytes 4096.0",
        'phaseserve_kv_handoff_transport_bytes{transport="redis"} 4096.0',
        "phaseserve_prefix_cache_queries 1000.0", "phaseserve_prefix_cache_hits 640.0",
        "phaseserve_prefix_cache_evictions 3.0", "phaseserve_kv_blocks_cached 12.0",
        "phaseserve_num_steps_held_by_itl_target 6.0", "phaseserve_num_steps_past_itl_patience 2.0",
        "phaseserve_spec_decode_num_draft_slots 9.0", "phaseserve_spec_decode_num_draft_tokens 6.0",
        "phaseserve_spec_decode_num_accepted_tokens 3.0", "phaseserve_spec_decode_acceptance_rate 0.5",
        'phaseserve_spec_decode_acceptance_rate_per_position{position="2"} 0.5',
        "phaseserve_requests_quarantined 2.0", "phaseserve_num_steps_sat_out 7.0",
    ):
        assert line in text, line
    metrics.set_cluster_state(None, [])  # no stats yet: zeros, no error
    assert "phaseserve_prefix_cache_hits 0.0" in metrics.render().decode()
