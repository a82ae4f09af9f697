"""The cluster's decisions, pure: which worker a request goes to, what a draining worker gives back, where a
finished prefill decodes, which steps are given up. No Redis and no asyncio: plain data in, and out the
writes it decided as plain tuples in `ops`, which the service sends with its next turn.

One `WorkerPolicy` per live worker (in its `WorkerSlot`) holds that worker's KV block accounting; the
cluster only chooses between them.

Draining (a worker given SIGTERM announces WorkerInfo.draining; docs/architecture.md, "Workers joining and
leaving"): nothing new is placed on it, its waiting sequences go to other workers at once (or are parked
while no other worker lives), its running ones finish there for up to `drain_timeout`; then it gets no more
plans, and once those in flight have answered the rest is recomputed elsewhere. Holding nothing, it gets a
`drained` plan: it may exit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from phaseserve.wire import (
    ERROR_QUARANTINED, ERROR_REJECTED, KV_TRANSPORTS, Keys, SequenceProgress, StepPlan, StepResult, SubmitRequest,
    TokenBatch, TokenEvent, WireError, WorkerInfo,
)
from phaseserve.scheduler_stats import HandoffStats, PrefixCacheStats, SchedulerStats, SpecDecodingStats
from phaseserve.stack_view import (
    STEPS_SHOWN, WAITING_SHOWN, StackView, StepSample, TenantShare, WaitingSequence, WorkerView,
)
from scheduler.lora_routing import AdapterRecency
from scheduler.policy import AdmissionError, SchedulerConfig, WorkerPolicy
from scheduler.policy_stats import PolicyCounters
from scheduler.prefix_index import request_seed
from scheduler.quarantine import STRIKES_FIELD, Quarantine
from scheduler.recent_prompts import RecentPrompts
from scheduler.step_cost import ItlTarget, StepCostModel, plan_features

log = structlog.get_logger("scheduler.cluster")

STEP_COST_LOG_EVERY = 512  # steps between log lines of a worker's learned step costs
# step ids of one adoption of a worker start at (adoption number) * this: a late result of an earlier
# adoption (or of a scheduler before us, whose epoch differs anyway) matches no open step
STEP_IDS_PER_ADOPTION = 1_000_000_000
# confirmed tokens go into a request's record in runs of this many: one Redis command per run, not per token
# (a command per token was most of the scheduler's CPU). A takeover resumes from the record, up to this far
# behind the client, and regenerates the rest: the same tokens (greedy, or sampled with the request's seed,
# exactly in float32), or it reads them from the relay's token log when there is one.
OUTPUTS_PER_WRITE = 16
MAX_PENDING_HANDOFFS = 4096  # handoffs whose transport is remembered until their receive is reported


def share_of(shares: dict[str, TenantShare], req: SubmitRequest) -> TenantShare:
    share = shares.get(req.tenant)
    if share is None:
        share = shares[req.tenant] = TenantShare(req.tenant, req.tenant_weight)
    return share


def live_workers(members: list[str], heartbeats: list[bytes | None]) -> dict[str, WorkerInfo]:
    """The workers whose heartbeat is there and readable, by id."""
    live: dict[str, WorkerInfo] = {}
    for wid, data in zip(members, heartbeats):
        if data is None:
            continue
        try:
            live[wid] = WorkerInfo.from_wire(data)
        except (WireError, TypeError) as e:
            log.warning("unreadable heartbeat", worker_id=wid, error=str(e))
    return live


@dataclass
class WorkerSlot:
    info: WorkerInfo
    policy: WorkerPolicy
    # (step id, sent at, seconds it may take once due) of plans sent with no result yet, oldest first
    in_flight: deque = field(default_factory=deque)
    needs_plan: bool = False  # something (a cancel) the worker must hear about even with no work left
    head_since: float = 0.0  # when the oldest in-flight plan became the one the worker runs (a result came)
    last_admission: int = 0  # when (Cluster.admissions) it was last given a new sequence; 0: never
    drain_deadline: float | None = None  # draining: when its running sequences are handed back (monotonic)
    handing_back: bool = False  # the deadline passed: no more plans; the rest moves once none is in flight
    drained: bool = False  # told it holds nothing and may exit
    loras: AdapterRecency = field(default_factory=AdapterRecency)  # the LoRA adapters it holds (lora_routing.py)

    @property
    def draining(self) -> bool:
        """The worker is leaving (SIGTERM): no new sequence goes to it."""
        return self.info.draining

    @property
    def takes_plans(self) -> bool:
        """False once a draining worker is past its deadline (what it runs moves elsewhere) or drained."""
        return not (self.handing_back or self.drained)

    @property
    def role(self) -> str:
        return self.info.role
    # the worker's step time learned from its results, and (tokens, keys, prefill chunks) of each plan in flight
    step_costs: StepCostModel = field(default_factory=StepCostModel)
    plan_features: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # the live view (phaseserve/stack_view.py): each plan in flight as a StepSample without its time, and
    # the last steps that answered
    plan_samples: dict[int, StepSample] = field(default_factory=dict)
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=STEPS_SHOWN))
    last_step_at: float = 0.0  # when the newest of them answered (monotonic)

    def head_deadline(self) -> float | None:
        """When the oldest in-flight step is given up if no result came; None with nothing in flight."""
        if not self.in_flight:
            return None
        _step_id, sent_at, timeout = self.in_flight[0]
        return max(sent_at, self.head_since) + timeout


@dataclass
class PolicyLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    attention_horizon: int | None = None  # None: each worker's own (WorkerInfo); 0: cost model off
    long_prefill_threshold: int = 256  # see SchedulerConfig; 0: no cap
    # how prefill workers hand KV to decode workers: "auto" (shared memory between workers on one host,
    # else Redis), "shm" or "redis"
    kv_transport: str = "auto"
    itl_target: ItlTarget = field(default_factory=ItlTarget)  # see SchedulerConfig; off: no bound
    itl_patience_s: float = 15.0  # see SchedulerConfig
    enable_prefix_caching: bool = True  # see SchedulerConfig


# Cache-aware routing: a request goes to the worker holding the longest cached prefix of it among the workers
# whose load (unfinished sequences) is within this slack of the least loaded one's: max(PREFIX_SLACK_SEQS,
# the least load), i.e. up to twice the least load (a few more at light load). A history prefilled again
# costs more than a few more sequences in a decode batch; past the slack, load wins, so a hot prefix does not
# pile every request on one worker (and once a second worker has it too, load decides between them).
PREFIX_SLACK_SEQS = 4
# a prompt agreeing with a recent one on at least this many positions, of which the cache matched under half,
# gets a debug line saying where the two first differ
SHARED_PREFIX_LOG_TOKENS = 64


@dataclass
class HandoffCounters:
    """Prefill -> decode handoffs since this scheduler took the lease (the gateway's /metrics shows them)."""

    sequences: int = 0  # handed to a decode worker
    kept: int = 0  # first token done on a prefill worker, but no decode worker had room: decoded there
    received: int = 0  # transfers a decode worker applied
    failed: int = 0  # transfers a decode worker could not apply (the sequence was recomputed there)
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # receive time, summed
    # bytes received per transport (KV_TRANSPORTS): whether KV between hosts went over the network
    bytes_by_transport: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_TRANSPORTS, 0))
    # transfer id -> transport of handoffs whose receive is not reported yet (oldest first, bounded: a
    # decode worker that died never reports its own)
    pending: dict[str, str] = field(default_factory=dict)

    def handed(self, transfer_id: str, transport: str) -> None:
        self.sequences += 1
        self.pending[transfer_id] = transport
        while len(self.pending) > MAX_PENDING_HANDOFFS:
            del self.pending[next(iter(self.pending))]

    def received_kv(self, transfer_id: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.received += 1
        self.blocks += num_blocks
        self.bytes += num_bytes
        self.seconds += seconds
        transport = self.pending.pop(transfer_id, None)
        if transport is not None:
            self.bytes_by_transport[transport] = self.bytes_by_transport.get(transport, 0) + num_bytes

    def as_stats(self) -> HandoffStats:
        return HandoffStats(self.sequences, self.kept, self.received, self.failed, self.blocks, self.bytes,
                            self.seconds, dict(self.bytes_by_transport))


class Cluster:
    """The live workers and the requests they own; every decision the scheduler makes between them."""

    def __init__(self, keys: Keys, limits: PolicyLimits, drain_timeout: float = 30.0, quarantine_after: int = 2):
        self.keys = keys
        self.limits = limits
        self.drain_timeout = drain_timeout  # how long a draining worker's running sequences may finish there
        self.workers: dict[str, WorkerSlot] = {}
        self.owner: dict[str, str] = {}  # request id -> worker id
        self.parked: list[tuple[SubmitRequest, list[int] | None]] = []  # no live worker to run them yet
        # counters of policies of workers that went away (the cluster's stats are since the scheduler started;
        # prefix caches went with them)
        self.retired = PolicyCounters()
        self.retired_prefix_cache = PrefixCacheStats()
        self.quarantine = Quarantine(quarantine_after)  # strikes of sequences present at worker failures
        self.recent_prompts = RecentPrompts()
        self.ops: list[tuple] = []  # Redis writes decided, sent with the service's next turn
        self.outputs_written: dict[str, int] = {}  # request id -> confirmed outputs its record holds
        self.adoptions = 0
        self.admissions = 0
        self.num_steps_given_up = 0
        self.num_stale_results = 0  # results refused: of a plan given up, a retired life, an older epoch
        self.handoffs = HandoffCounters()
        self.grammar_masks: list[float] = []  # StepResult.grammar_masks summed: the gateway's mask histogram
        self.watched = False  # a live view is open (the service says): steps are sampled for it
        self.stats_dirty = True

    # ------------------------------------------------------------------ workers

    def gone_workers(self, live: dict[str, WorkerInfo], blameless: bool = False) -> None:
        """Retire every worker whose heartbeat lapsed, or that started a new life. `blameless`: the scheduler
        could not reach Redis just before (heartbeats lapsed with the outage): no strike for anyone."""
        for wid in list(self.workers):
            info = live.get(wid)
            if info is None or info.started_at != self.workers[wid].info.started_at:
                # a new started_at: a new process, or a model that moved again after stalling past the step
                # deadline (its relay starts a new life); the old life's plans are void either way
                self.retire_worker(wid, "heartbeat expired" if info is None else "new life (restarted or stalled)",
                                   blameless)

    def add_worker(self, info: WorkerInfo, epoch: int) -> WorkerSlot:
        """A worker joined (its stream already fenced by the service): a policy of its own for its blocks."""
        cfg = SchedulerConfig(
            num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            max_num_seqs=self.limits.max_num_seqs, max_num_batched_tokens=self.limits.max_num_batched_tokens,
            enable_chunked_prefill=self.limits.enable_chunked_prefill,
            attention_horizon=info.attention_horizon if self.limits.attention_horizon is None
            else self.limits.attention_horizon,
            long_prefill_threshold=self.limits.long_prefill_threshold,
            itl_target=self.limits.itl_target, itl_patience_s=self.limits.itl_patience_s,
            vocab_size=info.vocab_size,
            enable_prefix_caching=self.limits.enable_prefix_caching,
            speculative_tokens=info.speculative_tokens, speculative_adaptive=not info.speculative_fixed,
        )
        self.adoptions += 1
        policy = WorkerPolicy(cfg, info.worker_id, first_step_id=self.adoptions * STEP_IDS_PER_ADOPTION,
                              transfer_prefix=f"{epoch}-{self.adoptions}")
        slot = self.workers[info.worker_id] = WorkerSlot(info, policy, loras=AdapterRecency(info.max_loras))
        self.stats_dirty = True
        log.info("worker joined", worker_id=info.worker_id, model=info.model, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len,
                 attention_horizon=cfg.attention_horizon)
        return slot

    def worker_seen(self, info: WorkerInfo, now: float) -> None:
        """A live worker's heartbeat: its drain starts when it announces one (adopted draining, too)."""
        slot = self.workers[info.worker_id]
        if info.draining and slot.drain_deadline is None:
            self.start_drain(slot, info, now)

    def workers_refreshed(self) -> None:
        """After a refresh: choose KV transports, place what was parked."""
        self.set_kv_transports()
        if self.parked and self.workers:
            self.place_parked()

    def retire_worker(self, wid: str, why: str, blameless: bool = False) -> None:
        """The worker is gone: its sequences are recomputed elsewhere, but one that was running on it gets a
        strike (unless the worker left on purpose, or `blameless`), and is failed at the quarantine's limit
        (scheduler/quarantine.py)."""
        slot = self.workers.pop(wid)
        pstats = slot.policy.stats()
        self.retired.num_preemptions += pstats.counters.num_preemptions
        self.retired.num_sat_out += pstats.counters.num_sat_out
        self.retired_prefix_cache += pstats.prefix_cache.counters_only()
        suspects = set() if blameless or slot.draining else slot.policy.running_ids()
        moved = slot.policy.take_all()
        if slot.drained and not moved:
            log.info("worker left after draining", worker_id=wid)
        else:
            log.warning("worker lost", worker_id=wid, reason=why, sequences_moved=len(moved),
                        sequences_struck=len(suspects))
        for req, output_ids in moved:
            rid = req.request_id
            self.owner.pop(rid, None)
            if rid in suspects:
                if self.quarantine.strike(rid):
                    log.error("request quarantined", request_id=rid, worker_id=wid,
                              failures=self.quarantine.max_failures)
                    self.fail_request(req, self.quarantine.message(), ERROR_QUARANTINED)
                    continue
                self.ops.append(("hset", self.keys.request_record(rid), STRIKES_FIELD, self.quarantine.count(rid)))
            self.parked.append((req, output_ids))
        self.stats_dirty = True
        if self.workers:
            self.place_parked()

    def set_kv_transports(self) -> None:
        """A prefill worker streams its prefills out while a decode worker exists (else it decodes them
        itself, as a mixed one): over shared memory when every decode worker shares its host, else Redis."""
        decode_hosts = {s.info.host for s in self.workers.values() if s.role == "decode" and not s.draining}
        for slot in self.workers.values():
            if slot.role != "prefill" or not decode_hosts:
                transport = None
            elif self.limits.kv_transport != "auto":
                transport = self.limits.kv_transport
            else:
                transport = "shm" if decode_hosts == {slot.info.host} and slot.info.host else "redis"
            slot.policy.kv_transport = transport

    def vouch_for_quiet_sequences(self) -> None:
        """Tell each gateway which of its sequences are waiting at a live worker or prefilling
        (SequenceProgress): no token shows it, yet they are not stalled, and its no-progress deadline must
        not fail them. Parked ones (no worker to run them) are not vouched for: that deadline bounds their
        wait."""
        by_gateway: dict[str, list[str]] = {}
        for req in (r for s in self.workers.values() for r in s.policy.quiet_progress()):
            by_gateway.setdefault(req.gateway_id, []).append(req.request_id)
        for gateway_id, seq_ids in by_gateway.items():
            self.ops.append(("publish", self.keys.gateway_channel(gateway_id), SequenceProgress(seq_ids).to_wire()))

    def sequence_ids(self) -> list[str]:
        """Every sequence the cluster holds, placed or parked."""
        return list(self.owner) + [r.request_id for r, _ in self.parked]

    # ------------------------------------------------------------------ routing

    def pick_worker(self, req: SubmitRequest, output_ids: list[int] | None = None) -> WorkerSlot | None:
        """Least loaded (least queued prefill on a prefill worker; fewest unfinished sequences, then most free
        blocks) of the workers that can hold it.
        If none can, the largest, whose policy then rejects it with the nearest miss in its message.
        New sequences start on prefill and mixed workers; decode workers take them only when there are
        no others (then they prefill too). None (park it) when no worker but draining ones lives."""
        staying = [s for s in self.workers.values() if not s.draining]
        if not staying:
            return None
        candidates = [s for s in staying if s.role != "decode"] or staying
        fits = [s for s in candidates if s.policy.capacity.rejection(
            len(req.prompt_ids), req.params.max_tokens, len(output_ids or ())) is None]
        if not fits:
            return max(candidates, key=lambda s: (s.info.max_model_len, s.info.num_blocks))
        # a prefill worker's load is the prefill work queued on it; a mixed worker's, its sequences
        # ties (idle workers, at light load) go to the one given a sequence least recently: a worker that
        # just joined takes the next sequence, instead of the lowest id taking them all
        def by_load(s: WorkerSlot) -> tuple:
            return (s.policy.queued_prefill_tokens if s.role == "prefill" else 0,
                    s.policy.num_waiting + s.policy.num_running, -s.policy.num_free_blocks,
                    s.last_admission, s.info.worker_id)
        tokens = list(req.prompt_ids) + list(output_ids or ())
        seed = request_seed(req)
        cached = {s.info.worker_id: s.policy.num_cached_tokens(tokens, seed) for s in fits}
        adapter = req.lora.key if req.lora is not None else None
        holds = {s.info.worker_id: s.loras.holds(adapter) for s in fits}
        if not any(cached.values()) and not any(holds.values()):
            return min(fits, key=by_load)
        # the longest cached prefix, then the request's LoRA adapter loaded, among the workers loaded within a
        # slack of the least loaded one
        loads = {s.info.worker_id: s.policy.num_waiting + s.policy.num_running for s in fits}
        least = min(loads.values())
        slack = max(PREFIX_SLACK_SEQS, least)
        near = [s for s in fits if loads[s.info.worker_id] <= least + slack]
        return min(near, key=lambda s: (-cached[s.info.worker_id], not holds[s.info.worker_id], *by_load(s)))

    def place_parked(self) -> None:
        parked, self.parked = self.parked, []
        for req, output_ids in parked:
            self.admit(req, output_ids)

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        slot = self.pick_worker(req, output_ids)
        if slot is None:
            self.parked.append((req, output_ids))
            self.stats_dirty = True  # counted in num_waiting
            return True
        try:
            slot.policy.add_request(req, output_ids=output_ids or None)
        except ValueError as e:  # e.g. a prompt no worker can hold: fail this request, not the scheduler
            # a new request too big for every worker is the client's error; a resumed one whose surviving
            # workers are smaller than the one it started on is the cluster's
            rejected = isinstance(e, AdmissionError) and not output_ids
            log.warning("request rejected", request_id=req.request_id, error=str(e), bad_input=rejected)
            self.fail_request(req, str(e), ERROR_REJECTED if rejected else None)
            return False
        self.owner[req.request_id] = slot.info.worker_id
        slot.loras.use(req.lora.key if req.lora is not None else None)
        self.admissions += 1
        slot.last_admission = self.admissions
        if self.limits.enable_prefix_caching and not output_ids:
            self.note_prefix_miss(req, slot)
        self.ops.append(("hset", self.keys.request_record(req.request_id), "worker", slot.info.worker_id))
        log.info("request admitted", request_id=req.request_id, worker_id=slot.info.worker_id,
                 prompt_tokens=len(req.prompt_ids), max_tokens=req.params.max_tokens,
                 resumed_from=len(output_ids or ()))
        self.stats_dirty = True
        return True

    def note_prefix_miss(self, req: SubmitRequest, slot: WorkerSlot) -> None:
        """A debug line when a prompt agrees with a recent one on many positions but the worker it goes to
        has little of it cached: where the two first differ (a chat template writing an early token
        differently, a timestamp in a system prompt) is what a user cannot see from the hit rate."""
        prompt = req.prompt_ids
        seed = request_seed(req)
        other, first, agreed = self.recent_prompts.most_similar(prompt, seed)
        self.recent_prompts.add(req.request_id, prompt, seed)
        if agreed < SHARED_PREFIX_LOG_TOKENS:
            return
        hit = slot.policy.num_cached_tokens(prompt, seed)
        if 2 * hit < agreed:
            log.debug("prefix cache matched little of a similar prompt", request_id=req.request_id,
                      similar_request_id=other, first_difference=first, tokens_in_common=agreed,
                      cached_tokens=hit, prompt_tokens=len(prompt), worker_id=slot.info.worker_id)

    def fail_request(self, req: SubmitRequest, message: str, error_kind: str | None = None) -> None:
        self.tell_error(req.request_id, req.gateway_id, message, error_kind)
        self.ops.append(("delete", self.keys.request_record(req.request_id)))
        self.outputs_written.pop(req.request_id, None)
        self.quarantine.forget(req.request_id)

    def tell_error(self, rid: str, gateway_id: str, message: str, error_kind: str | None = None) -> None:
        """An error event for a request's client: published, and in its token log, so a gateway that missed
        the message (or a client resuming later) still reads it instead of waiting for a deadline."""
        event = TokenEvent(rid, 0, [], "error", None, message, error_kind)
        self.ops.append(("error", self.keys.gateway_channel(gateway_id),
                         TokenBatch(-1, "scheduler", [event]).to_wire(), event.to_list()))

    def request_of(self, request_id: str) -> SubmitRequest | None:
        """A known request as admitted (placed or parked), or None."""
        wid = self.owner.get(request_id)
        if wid is not None and wid in self.workers:
            return self.workers[wid].policy.request_of(request_id)
        return next((r for r, _ in self.parked if r.request_id == request_id), None)

    def is_known(self, request_id: str) -> bool:
        return request_id in self.owner or any(r.request_id == request_id for r, _ in self.parked)

    def cancel(self, rid: str, reason: str | None) -> None:
        wid = self.owner.pop(rid, None)
        cancelled = False
        if wid is not None and wid in self.workers:
            slot = self.workers[wid]
            cancelled = slot.policy.cancel(rid)
            slot.needs_plan = True  # the worker must be told to release the sequence
        else:
            before = len(self.parked)
            self.parked = [(r, o) for r, o in self.parked if r.request_id != rid]
            cancelled = len(self.parked) < before
        self.ops.append(("delete", self.keys.request_record(rid)))
        self.outputs_written.pop(rid, None)
        self.quarantine.forget(rid)
        self.stats_dirty = True
        log.info("request cancelled", request_id=rid, reason=reason, found=cancelled)

    # ------------------------------------------------------------------ prefill -> decode handoffs

    def hand_off_ready(self, src: WorkerSlot) -> None:
        """Move the sequences whose prefill finished on `src` to the decode worker with the most free blocks
        that can take them; with none, they decode on `src`."""
        for rid in src.policy.ready_handoffs():
            ready = src.policy.handoff_of(rid)
            takers = [s for s in self.workers.values()
                      if s.role == "decode" and not s.draining and s.policy.can_accept_handoff(ready)]
            if not takers:
                src.policy.keep(rid)
                self.handoffs.kept += 1
                log.info("no decode worker has room; decoding on the prefill worker", request_id=rid,
                         worker_id=src.info.worker_id)
                continue
            dst = max(takers, key=lambda s: (s.policy.num_free_blocks - s.policy.num_running, s.info.worker_id))
            handoff = src.policy.hand_off(rid)
            dst.policy.accept_handoff(handoff)
            self.owner[rid] = dst.info.worker_id
            self.ops.append(("hset", self.keys.request_record(rid), "worker", dst.info.worker_id))
            self.handoffs.handed(handoff.kv_send.transfer_id, handoff.kv_send.transport)
            log.info("handed to a decode worker", request_id=rid, source=src.info.worker_id,
                     worker_id=dst.info.worker_id, num_cached=handoff.num_cached,
                     transfer_id=handoff.kv_send.transfer_id, transport=handoff.kv_send.transport)

    def count_handoff_results(self, result: StepResult) -> None:
        for h in result.handoffs:
            if h.ok:
                self.handoffs.received_kv(h.transfer_id, h.num_blocks, h.num_bytes, h.seconds)
            else:
                self.handoffs.failed += 1
                log.warning("KV handoff failed; recomputing the sequence", request_id=h.seq_id,
                            worker_id=result.worker_id, transfer_id=h.transfer_id, error=h.error)

    # ------------------------------------------------------------------ draining workers

    def start_drain(self, slot: WorkerSlot, info: WorkerInfo, now: float) -> None:
        """The worker announced it is leaving: from now on nothing new goes to it (pick_worker), and its
        waiting sequences go elsewhere at once."""
        slot.info = info
        slot.drain_deadline = now + self.drain_timeout
        log.info("worker draining", worker_id=info.worker_id, running=slot.policy.num_running,
                 waiting=slot.policy.num_waiting, drain_timeout_s=self.drain_timeout)
        self.move_waiting(slot)
        self.stats_dirty = True

    def move_waiting(self, slot: WorkerSlot) -> None:
        """A draining worker's waiting sequences (no blocks, nothing in flight) go to the other workers, or
        are parked until one joins."""
        for req, output_ids in slot.policy.take_waiting():
            self.owner.pop(req.request_id, None)
            self.admit(req, output_ids)

    def advance_drains(self, now: float, epoch: int) -> None:
        """Each turn, for every draining worker: move what waits (a preempted sequence), hand back what still
        runs once the drain deadline passed and no plan of it is in flight, and tell a worker that holds
        nothing that it may exit (its `drained` plan goes out with the turn's other writes)."""
        for slot in self.workers.values():
            if not slot.draining or slot.drained:
                continue
            if slot.policy.num_waiting:
                self.move_waiting(slot)
            if slot.policy.has_unfinished() and now >= slot.drain_deadline and not slot.handing_back:
                slot.handing_back = True  # plan_steps sends it nothing more
                log.info("drain deadline passed; handing its sequences back", worker_id=slot.info.worker_id,
                         running=slot.policy.num_running, plans_in_flight=len(slot.in_flight))
            # the results of plans in flight first: a recompute starts from every token the worker published
            if slot.handing_back and not slot.in_flight and slot.policy.has_unfinished():
                moved = slot.policy.take_all()
                log.warning("recomputing a draining worker's sequences elsewhere", worker_id=slot.info.worker_id,
                            sequences_moved=len(moved))
                for req, output_ids in moved:
                    self.owner.pop(req.request_id, None)
                    self.admit(req, output_ids)
            if not slot.policy.has_unfinished():
                wid = slot.info.worker_id
                # step -1 matches no open step; after the plans in flight, in stream order
                self.ops.append(("plan", self.keys.steps(wid),
                                 StepPlan(-1, wid, epoch=epoch, drained=True).to_wire()))
                slot.drained = True
                log.info("worker drained; it may exit", worker_id=wid)
                self.stats_dirty = True

    # ------------------------------------------------------------------ steps

    def plan_steps(self, now: float, epoch: int, plans_in_flight: int, timeout_of: Callable, deadline_margin: float
                   ) -> list[tuple[str, StepPlan]]:
        """The next plans, filling every worker's pipeline to `plans_in_flight`, as (worker id, plan) for the
        caller to send; each is in flight from now. `timeout_of(plan, expected_s)` is a plan's deadline."""
        plans = []
        for wid, slot in self.workers.items():
            if not slot.takes_plans:  # a draining worker past its deadline, or told to go
                continue
            while len(slot.in_flight) < plans_in_flight and (slot.policy.has_unfinished() or slot.needs_plan):
                plan = slot.policy.schedule()
                slot.needs_plan = False
                if plan is None or not (plan.chunks or plan.starts or plan.releases):
                    break
                plan.epoch = epoch
                features = plan_features(plan.chunks)
                plan.timeout_s = timeout_of(plan, slot.step_costs.expected_bound(*features))
                slot.in_flight.append((plan.step_id, now, plan.timeout_s + deadline_margin))
                slot.plan_features[plan.step_id] = features
                if self.watched:
                    budget = slot.policy.last_budget
                    slot.plan_samples[plan.step_id] = StepSample(*slot.policy.last_split, 0.0, budget.predicted_s,
                                                                 budget.target_s)
                plans.append((wid, plan))
        if plans:
            self.stats_dirty = True
        return plans

    def add_grammar_masks(self, counts: list[float]) -> None:
        if len(self.grammar_masks) != len(counts):  # the first, or a worker with other buckets: start over
            self.grammar_masks = [0.0] * len(counts)
        self.grammar_masks = [a + b for a, b in zip(self.grammar_masks, counts)]

    def apply_result(self, result: StepResult, epoch: int, now: float) -> None:
        """A worker's step result: close its step (and any older one it overtook), feed the policy, hand off
        finished prefills, and record confirmed outputs and finished requests."""
        slot = self.workers.get(result.worker_id)
        open_ids = [entry[0] for entry in slot.in_flight] if slot is not None else []
        if result.epoch not in (0, epoch) or result.step_id not in open_ids:
            # an earlier scheduler's plan, a worker we gave up on, a step given up, or a duplicate
            log.debug("ignoring stale step result", worker_id=result.worker_id, step_id=result.step_id,
                      epoch=result.epoch)
            self.num_stale_results += 1
            self.stats_dirty = True
            return
        # the worker runs plans in order: the open steps before this one lost their plan or result (the
        # policy recomputes what they sampled when it applies this result)
        while slot.in_flight[0][0] != result.step_id:
            lost = slot.in_flight.popleft()[0]
            self.num_steps_given_up += 1
            log.warning("step result missing (a later one came first)", worker_id=result.worker_id, step_id=lost)
        slot.in_flight.popleft()
        slot.head_since = now
        self.learn_step_cost(slot, result)
        self.sample_step(slot, result, now)
        policy = slot.policy
        before = {}
        for ev in result.events:
            outputs = policy.outputs_of(ev.seq_id)
            if outputs is not None:
                before[ev.seq_id] = len(outputs)
        finished = set(policy.update(result))
        if result.handoffs:
            self.count_handoff_results(result)
        if result.grammar_masks:
            self.add_grammar_masks(result.grammar_masks)
        self.hand_off_ready(slot)
        for rid in before:
            if rid in finished:
                continue
            outputs = policy.outputs_of(rid)
            written = self.outputs_written.get(rid, 0)
            if outputs is not None and len(outputs) - written >= OUTPUTS_PER_WRITE:  # a takeover resumes here
                self.ops.append(("outputs", self.keys.request_record(rid), written, outputs[written:]))
                self.outputs_written[rid] = len(outputs)
        for rid in finished:
            self.owner.pop(rid, None)
            self.outputs_written.pop(rid, None)
            self.quarantine.forget(rid)
            self.ops.append(("delete", self.keys.request_record(rid)))
            reason = next((e.finish_reason for e in result.events if e.seq_id == rid and e.finish_reason), None)
            log.info("request finished", request_id=rid, finish_reason=reason, worker_id=result.worker_id)
        self.stats_dirty = True

    def learn_step_cost(self, slot: WorkerSlot, result: StepResult) -> None:
        """Feed the worker's measured step time, with what its plan held, to its cost model; the policy
        plans with the refitted costs from its next plan on."""
        features = slot.plan_features
        for step_id in [k for k in features if k < result.step_id]:  # given up or lost: no time to learn
            del features[step_id]
        planned = features.pop(result.step_id, None)
        if planned is None or any(e.error for e in result.events):
            return
        tokens, keys, prefill_chunks = result.ran if len(result.ran) == 3 else planned  # speculation: as run
        model = slot.step_costs
        model.observe(tokens, keys, result.step_time_s, prefill_chunks)
        slot.policy.step_costs = costs = model.costs
        if costs is not None and model.num_samples % STEP_COST_LOG_EVERY == model.min_samples % STEP_COST_LOG_EVERY:
            log.info("step costs learned", worker_id=slot.info.worker_id, steps=model.num_samples,
                     overhead_ms=round(costs.overhead_s * 1e3, 3), token_ms=round(costs.token_s * 1e3, 4),
                     key_us=round(costs.key_s * 1e6, 5), prefill_chunk_ms=round(costs.prefill_chunk_s * 1e3, 3),
                     horizon=round(costs.horizon),
                     measured_over_predicted_prefill=round(model.prefill_ratio, 3),
                     measured_over_predicted_decode=round(model.decode_ratio, 3),
                     itl_target=str(self.limits.itl_target),
                     verify_units=(round(slot.policy.drafts.verify_cost.units, 2) if slot.info.speculative_tokens
                                   else None))

    @staticmethod
    def sample_step(slot: WorkerSlot, result: StepResult, now: float) -> None:
        """The step's plan and measured time, for the live view (a speculative step as it ran)."""
        samples = slot.plan_samples
        if not samples:  # nobody watches
            return
        for step_id in [k for k in samples if k < result.step_id]:  # given up or lost
            del samples[step_id]
        sample = samples.pop(result.step_id, None)
        if sample is None:
            return
        sample.step_s = result.step_time_s
        if len(result.ran) == 3:  # speculation verified what the worker proposed, not what was allowed
            sample.decode_tokens = result.ran[0] - sample.prefill_tokens
        slot.recent_steps.append(sample)
        slot.last_step_at = now

    def view(self, taken_at: float, now: float) -> StackView:
        """The live view's picture of the cluster now (phaseserve/stack_view.py): built every few hundred
        milliseconds from what the policies hold, never per step. `taken_at`: unix time; `now`: monotonic."""
        workers, unprefilled, tenants = [], [], {}
        for wid, slot in self.workers.items():
            p = slot.policy
            pstats = p.stats()
            workers.append(WorkerView(
                wid, slot.role, slot.info.host, slot.info.threads, slot.draining, p.num_running, p.num_waiting,
                p.num_used_blocks, pstats.prefix_cache.cached_blocks, p.num_free_blocks, slot.info.num_blocks,
                pstats.num_handoffs_in_flight, pstats.prefix_cache.queries, pstats.prefix_cache.hits,
                pstats.spec_decoding.num_draft_tokens, pstats.spec_decoding.num_accepted_tokens,
                list(slot.recent_steps),
                round(now - slot.last_step_at, 3) if slot.recent_steps else 0.0))
            for seq, total, done in p.unprefilled():
                unprefilled.append((seq.request, wid, total, done))
            for seq in p.running_sequences():
                share_of(tenants, seq.request).num_running += 1
        unprefilled += [(req, "", len(req.prompt_ids) + len(outputs or ()), 0) for req, outputs in self.parked]
        for req, *_ in unprefilled:
            share_of(tenants, req).num_waiting += 1
        unprefilled.sort(key=lambda x: x[0].arrival_time)
        waiting = [WaitingSequence(req.request_id, wid, req.arrival_time, total, done, req.tenant)
                   for req, wid, total, done in unprefilled[:WAITING_SHOWN]]
        shares = [] if set(tenants) <= {""} else [tenants[t] for t in sorted(tenants)]  # no tenants: no table
        return StackView(taken_at, str(self.limits.itl_target), self.limits.max_num_batched_tokens, workers,
                         len(unprefilled), waiting, shares)

    def give_up_overdue_steps(self, now: float) -> float | None:
        """Steps whose deadline passed with no result: their plan or result was lost (a hung worker is
        retired by its heartbeat before this). Returns seconds until the next deadline, or None."""
        nearest = None
        for slot in self.workers.values():
            while True:
                deadline = slot.head_deadline()
                if deadline is None:
                    break
                if deadline > now:
                    nearest = deadline - now if nearest is None else min(nearest, deadline - now)
                    break
                step_id, _sent, timeout = slot.in_flight.popleft()
                slot.head_since = now
                self.num_steps_given_up += 1
                log.warning("step overran its deadline; giving it up", worker_id=slot.info.worker_id,
                            step_id=step_id, timeout_s=timeout)
                slot.policy.drop_step(step_id)
                self.stats_dirty = True
        return nearest

    def void_unsent_plans(self, planned_before: dict[str, int]) -> None:
        """The plans of a turn whose pipeline failed probably never reached their workers: give each up as
        soon as it is the worker's oldest (its deadline 0) instead of at the step timeout, so an outage
        stalls streams for its own length, not for --step-timeout. A plan that did arrive is harmless: its
        late result is dropped like any given-up step's, its tokens by offset."""
        for wid, n in planned_before.items():
            slot = self.workers.get(wid)
            if slot is None:
                continue
            for i in range(n, len(slot.in_flight)):
                step_id, sent_at, _timeout = slot.in_flight[i]
                slot.in_flight[i] = (step_id, sent_at, 0.0)

    def stats(self) -> SchedulerStats:
        policies = [s.policy for s in self.workers.values()]
        per = [p.stats() for p in policies]
        return SchedulerStats(
            num_waiting=sum(p.num_waiting for p in per) + len(self.parked),
            num_waiting_tokens=sum(p.queued_prefill_tokens for p in policies)
            + sum(len(r.prompt_ids) + len(o or ()) for r, o in self.parked),
            num_stale_results=self.num_stale_results,
            num_running=sum(p.num_running for p in per),
            kv_blocks_used=sum(p.num_used_blocks for p in per),
            kv_blocks_total=sum(s.info.num_blocks for s in self.workers.values()),
            num_preemptions=sum(p.counters.num_preemptions for p in per) + self.retired.num_preemptions,
            num_fair_share_preemptions=sum(p.counters.num_fair_share_preemptions for p in per),  # live workers'
            num_workers=len(per),
            handoffs=self.handoffs.as_stats(),
            num_steps_held_by_itl_target=sum(p.counters.num_steps_held_by_itl_target for p in per),
            num_steps_past_itl_patience=sum(p.counters.num_steps_past_itl_patience for p in per),
            prefix_cache=sum((p.prefix_cache for p in per), self.retired_prefix_cache),
            spec_decoding=sum((p.spec_decoding for p in per), SpecDecodingStats()),
            grammar_masks=list(self.grammar_masks),
            num_sat_out=sum(p.counters.num_sat_out for p in per) + self.retired.num_sat_out,
            num_quarantined=self.quarantine.num_quarantined)
