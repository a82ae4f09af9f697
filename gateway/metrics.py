"""Prometheus metrics of one gateway (its own registry, so tests and several apps never collide).

Latencies are what the gateway sees: request arrival (body parsed) to tokens
received from the token channel. The gateway cannot see when the scheduler
first schedules a sequence, so `queue_time` is measured as arrival -> first
token of each sequence: an upper bound on the queueing delay that also
includes the prefill. Scheduler-side gauges are copied from the scheduler's
stats key on each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from phaseserve.grammar import MASK_BUCKETS_S
from phaseserve.scheduler_stats import SchedulerStats
from phaseserve.wire import KV_TRANSPORTS, WorkerInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0)

_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _MaskHistogram:
    """Token mask time of constrained sequences on the workers, cumulative as the scheduler sums it
    (StepResult.grammar_masks): a histogram whose counts come from the scheduler's stats."""

    def __init__(self):
        self.counts: list[float] = []  # per MASK_BUCKETS_S bucket, one more for slower, then the sum of seconds

    def collect(self):
        family = HistogramMetricFamily("phaseserve_grammar_mask_seconds",
                                       "Computing one constrained token's mask on a worker (scheduler)")
        counts = self.counts if len(self.counts) == len(MASK_BUCKETS_S) + 2 else [0.0] * (len(MASK_BUCKETS_S) + 2)
        buckets, total = [], 0.0
        for bound, n in zip((*map(str, MASK_BUCKETS_S), "+Inf"), counts[:-1]):
            total += n
            buckets.append((bound, total))
        family.add_metric([], buckets, counts[-1])
        yield family


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self.ttft = Histogram("phaseserve_time_to_first_token_seconds",
                              "Request arrival to its first output token", buckets=_LATENCY_BUCKETS,
                              registry=r, labelnames=["model_name"]).labels(**labels)
        self.itl = Histogram("phaseserve_inter_token_latency_seconds",
                             "Time between output tokens of a sequence (a batch of k tokens counts k gaps of "
                             "1/k of the wait)", buckets=_ITL_BUCKETS, registry=r,
                             labelnames=["model_name"]).labels(**labels)
        self.e2e = Histogram("phaseserve_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r, labelnames=["model_name"]).labels(**labels)
        self.queue_time = Histogram("phaseserve_request_queue_time_seconds",
                                    "Arrival to the first token of each sequence (upper bound of queueing: "
                                    "includes prefill)", buckets=_LATENCY_BUCKETS, registry=r,
                                    labelnames=["model_name"]).labels(**labels)
        self.prompt_tokens = Counter("phaseserve_prompt_tokens", "Prompt tokens submitted (per sequence)",
                                     registry=r, labelnames=["model_name"]).labels(**labels)
        self.generation_tokens = Counter("phaseserve_generation_tokens", "Output tokens received",
                                         registry=r, labelnames=["model_name"]).labels(**labels)
        self._finished = Counter("phaseserve_request_success", "Finished sequences by finish reason",
                                 registry=r, labelnames=["model_name", "finished_reason"])
        self._model = model_name
        self.in_flight = Gauge("phaseserve_gateway_requests_in_flight", "Requests this gateway is serving",
                               registry=r)
        self.running = Gauge("phaseserve_num_requests_running", "Sequences in the decode set (scheduler)",
                             registry=r)
        self.waiting = Gauge("phaseserve_num_requests_waiting", "Sequences waiting for prefill (scheduler)",
                             registry=r)
        self.kv_used = Gauge("phaseserve_kv_blocks_used", "KV-cache blocks allocated (scheduler)", registry=r)
        self.kv_total = Gauge("phaseserve_kv_blocks_total", "KV-cache blocks in all (scheduler)", registry=r)
        self.kv_usage = Gauge("phaseserve_kv_cache_usage_ratio", "kv_blocks_used / kv_blocks_total", registry=r)
        # the name an inference gateway reads (vLLM's kv_cache_usage_perc: a fraction, 1 = full, despite its name)
        self.kv_usage_perc = Gauge("phaseserve_kv_cache_usage_perc", "KV-cache usage as a fraction of all "
                                   "blocks, 1 = full (vLLM's name; the same as kv_cache_usage_ratio)", registry=r)
        self.waiting_tokens = Gauge("phaseserve_num_prefill_tokens_waiting", "Prompt tokens not prefilled yet: "
                                    "queued, parked with no worker, or the rest of a prompt mid-prefill "
                                    "(scheduler; the unmet demand to scale workers on)", registry=r)
        self.stale_results = Gauge("phaseserve_num_stale_step_results", "Step results the scheduler refused: "
                                   "of a plan it gave up, a worker life it retired (a host cut off that came "
                                   "back), or an older scheduler's epoch (cumulative, scheduler)", registry=r)
        self.fair_share_preemptions = Gauge("phaseserve_num_fair_share_preemptions", "Of those, made for a "
                                            "tenant under its share (live workers', scheduler)", registry=r)
        self.preemptions = Gauge("phaseserve_num_preemptions", "Preemptions since the scheduler started "
                                 "(cumulative, as reported by the scheduler)", registry=r)
        # prefill -> decode handoffs (phase workers), cumulative as the scheduler reports them
        # keyed by the HandoffStats field each shows
        self.handoffs = {key: Gauge(f"phaseserve_kv_handoff_{key}", help_text, registry=r) for key, help_text in (
            ("sequences", "Sequences handed from a prefill worker to a decode worker (scheduler)"),
            ("blocks", "KV blocks decode workers received from prefill workers (scheduler)"),
            ("bytes", "KV bytes decode workers received from prefill workers (scheduler)"),
            ("received", "KV transfers decode workers applied (scheduler)"),
            ("failed", "Handoffs whose KV transfer failed; the sequence was recomputed (scheduler)"),
            ("kept", "Sequences a prefill worker decoded itself: no decode worker had room (scheduler)"),
        )}
        self.handoff_transport_bytes = Gauge("phaseserve_kv_handoff_transport_bytes", "KV bytes decode workers "
                                             "received, by transport: shm (one host) or redis (over the "
                                             "network) (scheduler)", ["transport"], registry=r)
        # prefix caching, cumulative (tokens) as the scheduler reports them, and the blocks cached now
        # keyed by the PrefixCacheStats field each shows
        self.prefix_cache = {key: Gauge(name, help_text, registry=r) for key, name, help_text in (
            ("queries", "phaseserve_prefix_cache_queries", "Prompt tokens (prompt + outputs of a recompute) "
                                                           "looked up in the prefix cache at each sequence start "
                                                           "(scheduler)"),
            ("hits", "phaseserve_prefix_cache_hits", "Of those, tokens found cached: not computed again (scheduler)"),
            ("evictions", "phaseserve_prefix_cache_evictions", "Cached KV blocks evicted to make room (scheduler)"),
            ("cached_blocks", "phaseserve_kv_blocks_cached", "KV blocks holding a cached prefix now, in use or not "
                                                             "(scheduler)"),
        )}
        self.held_by_itl_target = Gauge("phaseserve_num_steps_held_by_itl_target", "Steps whose prefill the "
                                        "ITL target held back while prompts waited (cumulative, scheduler)",
                                        registry=r)
        self.past_itl_patience = Gauge("phaseserve_num_steps_past_itl_patience", "Steps in which a long prompt the "
                                       "ITL target had held back for its patience prefilled beside decodes "
                                       "unbounded by it (cumulative, scheduler)", registry=r)
        # speculative decoding, cumulative as the scheduler reports it (its live workers')
        self.spec_slots = Gauge("phaseserve_spec_decode_num_draft_slots", "Draft tokens plans allowed, with "
                                "their budget and blocks, whether the worker found a draft or not (scheduler)",
                                registry=r)
        self.spec_drafted = Gauge("phaseserve_spec_decode_num_draft_tokens", "Draft tokens verified "
                                  "(speculative decoding; scheduler)", registry=r)
        self.spec_accepted = Gauge("phaseserve_spec_decode_num_accepted_tokens", "Draft tokens kept "
                                   "(speculative decoding; scheduler)", registry=r)
        self.spec_rate = Gauge("phaseserve_spec_decode_acceptance_rate", "Kept / verified draft tokens", registry=r)
        self.spec_rate_at = Gauge("phaseserve_spec_decode_acceptance_rate_per_position", "Kept / verified "
                                  "draft tokens at each position of a run (1 = the first draft)", ["position"],
                                  registry=r)
        # poison requests (docs/architecture.md, "Poison requests"), cumulative as the scheduler reports them
        self.quarantined = Gauge("phaseserve_requests_quarantined", "Requests failed because they were running "
                                 "on --quarantine-after workers that died or overran a step: dead-lettered, not "
                                 "moved again (cumulative, scheduler)", registry=r)
        self.sat_out = Gauge("phaseserve_num_steps_sat_out", "Steps a sequence sat out because the worker was still "
                             "preparing it (building its grammar matcher; cumulative, scheduler)", registry=r)
        # per tenant (its name from the keys file; "" for requests of no tenant), as requests end
        self.tenant_requests = Counter("phaseserve_tenant_requests", "Requests served, by tenant", ["tenant"],
                                       registry=r)
        self.tenant_prompt_tokens = Counter("phaseserve_tenant_prompt_tokens", "Prompt tokens of finished "
                                            "requests, by tenant", ["tenant"], registry=r)
        self.tenant_cached_tokens = Counter("phaseserve_tenant_cached_tokens", "Of those, tokens found in the "
                                            "tenant's prefix cache", ["tenant"], registry=r)
        self.tenant_completion_tokens = Counter("phaseserve_tenant_completion_tokens", "Tokens generated, by "
                                                "tenant", ["tenant"], registry=r)
        self.tenant_queue_time = Histogram("phaseserve_tenant_queue_time_seconds", "Arrival to the first token "
                                           "of each sequence, by tenant", ["tenant"], buckets=_LATENCY_BUCKETS,
                                           registry=r)
        self.tenant_rejected = Counter("phaseserve_tenant_rate_limited", "Requests answered 429 by a tenant's or "
                                       "key's limit", ["tenant", "limit"], registry=r)
        self.workers_alive = Gauge("phaseserve_workers_alive", "Workers with a live heartbeat", registry=r)
        # info gauges (always 1), one series per live worker: what it computes with, from its heartbeat
        self.worker_info = Gauge("phaseserve_worker_info", "A live worker: its role, host, activations' dtype "
                                 "and CPU level (empty on CUDA)", ["worker_id", "role", "host", "dtype", "cpu_level"],
                                 registry=r)
        self.worker_kernels = Gauge("phaseserve_worker_kernel_info", "Which implementation runs each op family "
                                    "on a live worker", ["worker_id", "family", "implementation"], registry=r)
        self.grammar_compile = Histogram("phaseserve_grammar_compile_seconds", "Compiling a request's grammar "
                                         "(JSON schema, regex, choice, forced tool call) before it is enqueued",
                                         buckets=_COMPILE_BUCKETS, registry=r)
        self.grammar_masks = _MaskHistogram()
        r.register(self.grammar_masks)
        self.stats_age = Gauge("phaseserve_scheduler_stats_updated_at", "updated_at of the scheduler's stats "
                               "(unix time; 0 when none)", registry=r)

    def tenant_request(self, tenant: str, prompt: int, cached: int, completion: int) -> None:
        self.tenant_requests.labels(tenant).inc()
        self.tenant_prompt_tokens.labels(tenant).inc(prompt)
        self.tenant_cached_tokens.labels(tenant).inc(cached)
        self.tenant_completion_tokens.labels(tenant).inc(completion)

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model, finished_reason=reason).inc()

    def set_cluster_state(self, stats: dict | None, workers: list[WorkerInfo]) -> None:
        """Copy the scheduler's published stats (its wire map, None when there is none yet) and the live
        workers into the gauges."""
        self.workers_alive.set(len(workers))
        self.worker_info.clear()  # a worker gone since the last scrape leaves no series behind
        self.worker_kernels.clear()
        for w in workers:
            self.worker_info.labels(w.worker_id, w.role, w.host, w.dtype, w.cpu_level).set(1)
            for family, implementation in w.kernels.items():
                self.worker_kernels.labels(w.worker_id, family, implementation).set(1)
        st = SchedulerStats.from_wire(stats or {})
        used, total = float(st.kv_blocks_used), float(st.kv_blocks_total)
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_used.set(used)
        self.kv_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)
        self.kv_usage_perc.set(used / total if total else 0.0)
        self.waiting_tokens.set(st.num_waiting_tokens)
        self.stale_results.set(st.num_stale_results)
        for transport in KV_TRANSPORTS:
            self.handoff_transport_bytes.labels(transport).set(st.handoffs.bytes_by_transport.get(transport, 0))
        self.preemptions.set(st.num_preemptions)
        self.fair_share_preemptions.set(st.num_fair_share_preemptions)
        for key, gauge in self.handoffs.items():
            gauge.set(getattr(st.handoffs, key))
        for key, gauge in self.prefix_cache.items():
            gauge.set(getattr(st.prefix_cache, key))
        self.held_by_itl_target.set(st.num_steps_held_by_itl_target)
        self.past_itl_patience.set(st.num_steps_past_itl_patience)
        spec = st.spec_decoding
        self.spec_slots.set(spec.num_draft_slots)
        self.spec_drafted.set(spec.num_draft_tokens)
        self.spec_accepted.set(spec.num_accepted_tokens)
        self.spec_rate.set(spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0)
        self.spec_rate_at.clear()
        for j, (d, a) in enumerate(zip(spec.drafted_at, spec.accepted_at)):
            self.spec_rate_at.labels(str(j + 1)).set(a / d if d else 0.0)
        self.quarantined.set(st.num_quarantined)
        self.sat_out.set(st.num_sat_out)
        self.stats_age.set(st.updated_at)
        self.grammar_masks.counts = st.grammar_masks

    def render(self) -> bytes:
        return generate_latest(self.registry)
