"""The scheduler service: the pure policy (scheduler/policy.py) connected to Redis.

One loop, one Redis round trip per turn: a single non-transactional pipeline
carries everything decided since the last turn (step plans XADDed to each
worker, XACKs, request records, the stats key) and ends with ONE XREADGROUP
that blocks on both the `requests` and the `results` stream.

Pipelining: each worker may have two plans in flight. While a worker runs
step N, plan N+1 already waits in its stream, so the worker never idles on
the scheduler's round trip (the policy supports scheduling one step ahead;
decode chunks need no token ids from the scheduler because the worker owns
the tokens).

Workers are discovered from the `workers` set plus their expiring heartbeat
keys; one policy instance per live worker holds that worker's KV block
accounting. A worker whose heartbeat lapses has its sequences taken back and
re-planned elsewhere by recompute (prompt + tokens already generated).

Reliability:
- A plan in flight has a deadline (`step_timeout` from when it is due, plus a margin); a result that
  overtakes an older open step, or a deadline passing, gives the older step up: the policy recomputes its
  sequences from their confirmed outputs (`WorkerPolicy.drop_step`). A lost plan or result never strands a
  worker. (A hung model is noticed by the worker's relay, which withdraws its heartbeat.)
- One active scheduler: it holds a lease (`Keys.scheduler_lease`, SET NX PX, renewed by a check-and-renew
  script in every turn's pipeline). A second scheduler waits as a standby and takes over when the lease
  lapses, with a new epoch (`Keys.scheduler_epoch`) that goes into every StepPlan; workers drop plans of
  an older epoch, and the first plan to each adopted worker resets it.
- Nothing submitted vanishes: at takeover the scheduler re-admits every request record (prompt + the
  confirmed outputs stored in the record), then claims the pending entries of every earlier consumer
  (XAUTOCLAIM) and its own (XREADGROUP 0); duplicates are dropped by request id (submits) and by epoch,
  step id and offset (results). A message nobody can read goes to `Keys.dead_letters` with the reason,
  and a submit whose request id and gateway can be read gets an error event.
- An unseeded sampled request is given a seed at admission (kept in its record), so a recompute samples
  the tokens the client already has (exactly in float32; see docs/architecture.md for bf16).
- Redis outages: commands retry with backoff, the loop waits and resumes, consumer groups are recreated.

Draining (a worker given SIGTERM announces WorkerInfo.draining; docs/architecture.md, "Workers joining
and leaving"): nothing new is placed on it, its waiting sequences go to other workers at once (or are
parked while no other worker lives), its running ones finish there for up to `drain_timeout`; then it
gets no more plans, and once those in flight have answered the rest is recomputed elsewhere. Holding
nothing, it gets a `drained` plan: it may exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from phaseserve import event_loop, token_log
from phaseserve.client_lease import OrphanTracker
from phaseserve.procs import freeze_startup_heap
from phaseserve.redis_client import CONNECTION_ERRORS, Backoff, connect_async
from phaseserve.wire import (
    ERROR_REJECTED, FIELD, FIELD_BYTES, OUTPUT_FIELD_PREFIX, STREAM_MAXLEN, CancelRequest, Keys, SequenceProgress,
    StepResult, StepPlan, SubmitRequest, TokenBatch, TokenEvent, WireError, WorkerInfo, peek_kind,
)
from scheduler.policy import AdmissionError, SchedulerConfig, WorkerPolicy
from scheduler.step_cost import ItlTarget, StepCostModel, plan_features, step_deadline

log = structlog.get_logger("scheduler.service")

STATS_INTERVAL_S = 0.1  # the stats key is written at most ~10 times a second
STEP_COST_LOG_EVERY = 512  # steps between log lines of a worker's learned step costs
READ_COUNT = 512
# step ids of one adoption of a worker start at (adoption number) * this: a late result of an earlier
# adoption (or of a scheduler before us, whose epoch differs anyway) matches no open step
STEP_IDS_PER_ADOPTION = 1_000_000_000
DEAD_LETTER_MAXLEN = 10_000
# confirmed tokens go into a request's record in runs of this many: one Redis command per run, not per token
# (a command per token was most of the scheduler's CPU). A takeover resumes from the record, up to this far
# behind the client, and regenerates the rest: the same tokens (greedy, or sampled with the request's seed,
# exactly in float32), or it reads them from the relay's token log when there is one.
OUTPUTS_PER_WRITE = 16

# Renew the lease only if we hold it, or take it back if it vanished (a Redis restart without persistence)
# and nobody else took it meanwhile; the epoch key comes back with it. 1: ours, 0: someone else's.
RENEW_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'NX')
  return 1
end
return 0
"""
# A new epoch: one more than the last, and at least the wall clock in ms, so it still grows if Redis
# lost the key (workers remember the newest epoch they saw and drop older plans).
NEXT_EPOCH = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = math.max(last + 1, tonumber(ARGV[1]))
redis.call('SET', KEYS[1], epoch)
return epoch
"""


class LeaseLost(Exception):
    """Another scheduler holds the lease now: this one stops planning and waits as a standby."""


@dataclass
class WorkerSlot:
    info: WorkerInfo
    policy: WorkerPolicy
    # (step id, sent at, seconds it may take once due) of plans sent with no result yet, oldest first
    in_flight: deque = field(default_factory=deque)
    needs_plan: bool = False  # something (a cancel) the worker must hear about even with no work left
    head_since: float = 0.0  # when the oldest in-flight plan became the one the worker runs (a result came)
    last_admission: int = 0  # when (SchedulerService._admissions) it was last given a new sequence; 0: never
    drain_deadline: float | None = None  # draining: when its running sequences are handed back (monotonic)
    handing_back: bool = False  # the deadline passed: no more plans; the rest moves once none is in flight
    drained: bool = False  # told it holds nothing and may exit

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

    def as_stats(self) -> dict:
        return {"handoff_sequences": self.sequences, "handoff_kept": self.kept, "handoff_received": self.received,
                "handoff_failed": self.failed, "handoff_blocks": self.blocks, "handoff_bytes": self.bytes,
                "handoff_seconds": round(self.seconds, 6)}


class SchedulerService:
    def __init__(self, client: aioredis.Redis, keys: Keys, limits: PolicyLimits, *, consumer: str | None = None,
                 heartbeat_interval: float = 1.0, plans_in_flight: int = 2, step_timeout: float = 30.0,
                 lease_ttl: float = 5.0, resume_grace: float = 10.0, drain_timeout: float = 30.0,
                 step_timeout_floor: float = 3.0, step_timeout_factor: float = 10.0):
        self.client = client
        self.keys = keys
        self.limits = limits
        # unique per process: pending entries of a dead scheduler are another consumer's, claimed at takeover
        self.consumer = consumer or f"scheduler-{socket.gethostname()}-{os.getpid()}"
        self.refresh_interval = max(0.05, heartbeat_interval)
        self.plans_in_flight = max(1, plans_in_flight)
        # the worker's relay gives up on a step after its timeout; we wait a refresh longer, so its
        # heartbeat is withdrawn (a hung model: retire) before we give up on the step (a lost message)
        self.base_step_timeout = step_timeout
        # once a worker's step costs are learned, a step's deadline is this factor times its predicted time,
        # never below the floor: a frozen model is found in seconds, not after --step-timeout
        self.step_timeout_floor = step_timeout_floor
        self.step_timeout_factor = step_timeout_factor
        self.deadline_margin = max(1.0, self.refresh_interval)
        self.lease_ttl_ms = max(100, int(lease_ttl * 1000))
        self.epoch = 0  # ours, from the epoch key when we took the lease
        self.is_leader = False
        self.resume_grace = resume_grace
        self.drain_timeout = drain_timeout  # how long a draining worker's running sequences may finish there
        self._reset_state()

    def _reset_state(self) -> None:
        """Everything a scheduler knows is rebuilt from Redis when it takes the lease."""
        self.workers: dict[str, WorkerSlot] = {}
        self.owner: dict[str, str] = {}  # request id -> worker id
        self.parked: list[tuple[SubmitRequest, list[int] | None]] = []  # no live worker to run them yet
        self.retired_preemptions = 0  # preemptions counted by policies of workers that went away
        self.stopping = getattr(self, "stopping", None) or asyncio.Event()
        self._next_refresh = 0.0
        self._stats_dirty = True
        self._stats_written_at = 0.0
        self._last_stats: dict | None = None
        self._pending_ops: list[tuple] = []  # Redis writes decided while handling messages, sent next turn
        self._acks: list[tuple[str, list]] = []
        self._adoptions = 0
        self._admissions = 0
        self._outputs_written: dict[str, int] = {}  # request id -> confirmed outputs its record holds
        self._next_claim = 0.0
        self._renew_at = 0.0
        self.num_dead_letters = 0
        self.num_duplicates = 0
        self.num_steps_given_up = 0
        self.handoffs = HandoffCounters()
        self.orphans = OrphanTracker(self.resume_grace)  # sequences whose gateway and client are gone

    # ------------------------------------------------------------------ lease and takeover

    async def acquire_lease(self) -> None:
        """Wait (a standby) until the lease is ours, then take a new epoch."""
        waiting_logged = False
        while not self.stopping.is_set():
            if await self.client.set(self.keys.scheduler_lease(), self.consumer, nx=True, px=self.lease_ttl_ms):
                break
            if not waiting_logged:
                holder = await self.client.get(self.keys.scheduler_lease())
                log.info("standby: another scheduler holds the lease", holder=holder.decode() if holder else None)
                waiting_logged = True
            try:  # poll a few times per lease: a takeover comes within about one lease time
                await asyncio.wait_for(self.stopping.wait(), self.lease_ttl_ms / 4000)
            except asyncio.TimeoutError:
                pass
        if self.stopping.is_set():
            return
        self.epoch = int(await self.client.eval(NEXT_EPOCH, 1, self.keys.scheduler_epoch(), int(time.time() * 1000)))
        self.is_leader = True
        log.info("lease taken: this scheduler is the active one", consumer=self.consumer, epoch=self.epoch)

    def renew_lease(self, pipe, now: float) -> bool:
        """Queue the check-and-renew when a quarter of the lease has passed since the last (not every
        turn: a turn can be a few milliseconds); True if queued (its reply comes first)."""
        if now < self._renew_at:
            return False
        self._renew_at = now + self.lease_ttl_ms / 4000
        pipe.eval(RENEW_LEASE, 2, self.keys.scheduler_lease(), self.keys.scheduler_epoch(), self.consumer,
                  self.lease_ttl_ms, self.epoch)
        return True

    async def release_lease(self) -> None:
        """On a clean stop: a standby need not wait for the lease to lapse."""
        if self.is_leader:
            self.is_leader = False
            await self.client.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
                                   "end return 0", 1, self.keys.scheduler_lease(), self.consumer)

    # ------------------------------------------------------------------ setup

    async def setup(self) -> None:
        await self.create_groups()
        await self.refresh_workers(time.monotonic())
        await self.recover_records()
        await self.claim_pending()

    async def create_groups(self) -> None:
        for stream in (self.keys.requests, self.keys.results):
            try:
                # id 0: requests a gateway queued before the scheduler started are served too
                await self.client.xgroup_create(stream, self.keys.scheduler_group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    async def recover_records(self) -> None:
        """Requests a previous scheduler accepted but did not finish: re-admit them with their confirmed
        outputs (recompute), so each continues where its client is."""
        found = 0
        async for key in self.client.scan_iter(match=self.keys.request_record("*"), count=500):
            try:
                record = await self.client.hgetall(key)
            except ResponseError:  # not a record (WRONGTYPE): another key under the same pattern
                continue
            data = record.get(b"submit")
            if data is None:
                continue
            try:
                req = SubmitRequest.from_wire(data)
            except (WireError, KeyError, TypeError, ValueError) as e:
                log.warning("dropping unreadable request record", key=key, error=str(e))
                self._pending_ops.append(("dead", "record", data, key, f"unreadable record: {e}"))
                await self.client.delete(key)
                continue
            if self.is_known(req.request_id):
                continue
            outputs = recorded = confirmed_outputs(record)
            tokens, finished = await self.logged_outputs(req.request_id)
            if finished:  # its client saw the end: nothing left to do
                await self.client.delete(key)
                continue
            if len(tokens) > len(outputs) or tokens != outputs[:len(tokens)]:
                outputs = tokens  # what its client has (the log's first writer wins, as the client's does)
            if len(outputs) >= req.params.max_tokens:  # its last token was confirmed: nothing left to do
                await self.client.delete(key)
                continue
            self.parked.append((req, outputs))
            # what the record holds of them (none, if the log disagreed: the next write rewrites from 0)
            self._outputs_written[req.request_id] = len(recorded) if outputs[:len(recorded)] == recorded else 0
            found += 1
        if found:
            log.info("recovered requests", count=found)
            self.place_parked()

    async def logged_outputs(self, request_id: str) -> tuple[list[int], bool]:
        """A sequence's tokens in the relay's durable token log, contiguous from offset 0, and whether it
        ended. It can be ahead of the record's confirmed outputs (a result the scheduler had not handled
        yet), and it is what the client has."""
        return token_log.replay(await self.client.xrange(self.keys.token_log(request_id)))

    async def claim_pending(self, min_idle_ms: int = 0) -> None:
        """Entries read but never acknowledged: at takeover (min idle 0) every earlier consumer's, such as a
        submit a dead scheduler read but had not recorded, and our own earlier life's; then now and again
        those idle longer than two leases (a deposed scheduler's last read, made in the same round trip as
        the renewal that told it it was deposed). Handled like new ones: a submit already known is dropped
        by request id, an old result by epoch and step id."""
        claimed = 0
        for stream in (self.keys.requests, self.keys.results):
            if min_idle_ms == 0:  # our own consumer's pending entries (a restart under the same name)
                resp = await self.client.xreadgroup(self.keys.scheduler_group, self.consumer, {stream: "0"},
                                                    count=READ_COUNT)
                self.handle(resp)
                claimed += sum(len(e) for _s, e in (resp.items() if isinstance(resp, dict) else resp or ()))
            start = "0-0"
            while True:
                reply = await self.client.xautoclaim(stream, self.keys.scheduler_group, self.consumer, min_idle_ms,
                                                     start_id=start, count=READ_COUNT)
                start, entries = reply[0], reply[1]
                if entries:
                    self.handle([(stream, entries)])
                    claimed += len(entries)
                if not entries or start in (b"0-0", "0-0"):
                    break
        self._next_claim = time.monotonic() + self.lease_ttl_ms / 1000
        if claimed:
            log.info("claimed pending entries", count=claimed, min_idle_ms=min_idle_ms)

    # ------------------------------------------------------------------ workers

    async def refresh_workers(self, now: float) -> None:
        self._next_refresh = now + self.refresh_interval
        await self.client.set(self.keys.scheduler_alive(), self.consumer,
                              px=max(3000, int(3000 * self.refresh_interval)))
        members = sorted(m.decode() for m in await self.client.smembers(self.keys.workers))
        beats = await self.client.mget([self.keys.worker_heartbeat(m) for m in members]) if members else []
        live: dict[str, WorkerInfo] = {}
        for wid, data in zip(members, beats):
            if data is None:
                continue
            try:
                live[wid] = WorkerInfo.from_wire(data)
            except (WireError, TypeError) as e:
                log.warning("unreadable heartbeat", worker_id=wid, error=str(e))
        for wid in list(self.workers):
            info = live.get(wid)
            if info is None or info.started_at != self.workers[wid].info.started_at:
                # a new started_at: a new process, or a model that moved again after stalling past the step
                # deadline (its relay starts a new life); the old life's plans are void either way
                self.retire_worker(wid, "heartbeat expired" if info is None else "new life (restarted or stalled)")
        for wid, info in live.items():
            if wid not in self.workers:
                await self.adopt_worker(info)
            if info.draining and self.workers[wid].drain_deadline is None:  # (adopted draining, too)
                self.start_drain(self.workers[wid], info, now)
        self.set_kv_transports()
        if self.parked and self.workers:
            self.place_parked()
        await self.cancel_orphans(now)
        self.vouch_for_quiet_sequences()

    def vouch_for_quiet_sequences(self) -> None:
        """Tell each gateway which of its sequences are waiting at a live worker or prefilling
        (SequenceProgress): no token shows it, yet they are not stalled, and its no-progress deadline must
        not fail them. Parked ones (no worker to run them) are not vouched for: that deadline bounds their
        wait."""
        by_gateway: dict[str, list[str]] = {}
        quiet = [r for s in self.workers.values() for r in s.policy.quiet_progress()]
        for req in quiet:
            by_gateway.setdefault(req.gateway_id, []).append(req.request_id)
        for gateway_id, seq_ids in by_gateway.items():
            self._pending_ops.append(("publish", self.keys.gateway_channel(gateway_id),
                                      SequenceProgress(seq_ids).to_wire()))

    async def cancel_orphans(self, now: float) -> None:
        """Cancel the sequences nobody serves any more: a gateway refreshes a client lease for every sequence
        it streams (phaseserve/client_lease.py); one that died leaves leases that expire, and after the resume
        grace its sequences stop generating instead of running to the end of their context."""
        seq_ids = list(self.owner) + [r.request_id for r, _ in self.parked]
        leases = await self.client.mget([self.keys.client_lease(s) for s in seq_ids]) if seq_ids else []
        for rid in self.orphans.update(seq_ids, [v is not None for v in leases], now):
            self.cancel(rid, "no client or gateway left")
            self._pending_ops.append(("abort", rid))

    async def adopt_worker(self, info: WorkerInfo) -> None:
        cfg = SchedulerConfig(
            num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            max_num_seqs=self.limits.max_num_seqs, max_num_batched_tokens=self.limits.max_num_batched_tokens,
            enable_chunked_prefill=self.limits.enable_chunked_prefill,
            attention_horizon=info.attention_horizon if self.limits.attention_horizon is None
            else self.limits.attention_horizon,
            long_prefill_threshold=self.limits.long_prefill_threshold,
            itl_target=self.limits.itl_target, vocab_size=info.vocab_size,
        )
        # plans left in its stream by an earlier scheduler would write into blocks this one hands out
        # then a fence: the worker forgets every sequence it holds (another scheduler's, or a life we retired),
        # and from here on drops plans of an older epoch (a deposed scheduler's late ones). Its result
        # (step -1) matches no open step.
        steps = self.keys.steps(info.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xtrim(steps, maxlen=0)
        pipe.xadd(steps, {FIELD: StepPlan(-1, info.worker_id, epoch=self.epoch, reset=True).to_wire()},
                  maxlen=STREAM_MAXLEN, approximate=True)
        await pipe.execute()
        self._adoptions += 1
        policy = WorkerPolicy(cfg, info.worker_id, first_step_id=self._adoptions * STEP_IDS_PER_ADOPTION,
                              transfer_prefix=f"{self.epoch}-{self._adoptions}")
        self.workers[info.worker_id] = WorkerSlot(info, policy)
        self._stats_dirty = True
        log.info("worker joined", worker_id=info.worker_id, model=info.model, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len,
                 attention_horizon=cfg.attention_horizon)

    def retire_worker(self, wid: str, why: str) -> None:
        slot = self.workers.pop(wid)
        self.retired_preemptions += slot.policy.num_preemptions
        moved = slot.policy.take_all()
        if slot.drained and not moved:
            log.info("worker left after draining", worker_id=wid)
        else:
            log.warning("worker lost", worker_id=wid, reason=why, sequences_moved=len(moved))
        for req, output_ids in moved:
            self.owner.pop(req.request_id, None)
            self.parked.append((req, output_ids))
        self._stats_dirty = True
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
            self._pending_ops.append(("hset", self.keys.request_record(rid), "worker", dst.info.worker_id))
            self.handoffs.sequences += 1
            log.info("handed to a decode worker", request_id=rid, source=src.info.worker_id,
                     worker_id=dst.info.worker_id, num_cached=handoff.num_cached,
                     transfer_id=handoff.kv_send.transfer_id, transport=handoff.kv_send.transport)

    def count_handoff_results(self, result: StepResult) -> None:
        for h in result.handoffs:
            if h.ok:
                self.handoffs.received += 1
                self.handoffs.blocks += h.num_blocks
                self.handoffs.bytes += h.num_bytes
                self.handoffs.seconds += h.seconds
            else:
                self.handoffs.failed += 1
                log.warning("KV handoff failed; recomputing the sequence", request_id=h.seq_id,
                            worker_id=result.worker_id, transfer_id=h.transfer_id, error=h.error)

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
        return min(fits, key=lambda s: (s.policy.queued_prefill_tokens if s.role == "prefill" else 0,
                                        s.policy.num_waiting + s.policy.num_running, -s.policy.num_free_blocks,
                                        s.last_admission, s.info.worker_id))

    def place_parked(self) -> None:
        parked, self.parked = self.parked, []
        for req, output_ids in parked:
            self.admit(req, output_ids)

    # ------------------------------------------------------------------ draining workers

    def start_drain(self, slot: WorkerSlot, info: WorkerInfo, now: float) -> None:
        """The worker announced it is leaving: from now on nothing new goes to it (pick_worker), and its
        waiting sequences go elsewhere at once."""
        slot.info = info
        slot.drain_deadline = now + self.drain_timeout
        log.info("worker draining", worker_id=info.worker_id, running=slot.policy.num_running,
                 waiting=slot.policy.num_waiting, drain_timeout_s=self.drain_timeout)
        self.move_waiting(slot)
        self._stats_dirty = True

    def move_waiting(self, slot: WorkerSlot) -> None:
        """A draining worker's waiting sequences (no blocks, nothing in flight) go to the other workers, or
        are parked until one joins."""
        for req, output_ids in slot.policy.take_waiting():
            self.owner.pop(req.request_id, None)
            self.admit(req, output_ids)

    def advance_drains(self, now: float) -> None:
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
                self._pending_ops.append(("plan", self.keys.steps(wid),
                                          StepPlan(-1, wid, epoch=self.epoch, drained=True).to_wire()))
                slot.drained = True
                log.info("worker drained; it may exit", worker_id=wid)
                self._stats_dirty = True

    # ------------------------------------------------------------------ requests

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        slot = self.pick_worker(req, output_ids)
        if slot is None:
            self.parked.append((req, output_ids))
            self._stats_dirty = True  # counted in num_waiting
            return True
        try:
            slot.policy.add_request(req, output_ids=output_ids or None)
        except ValueError as e:  # e.g. a prompt no worker can hold: fail this request, not the scheduler
            # a new request too big for every worker is the client's error; a resumed one whose surviving
            # workers are smaller than the one it started on is the cluster's
            rejected = isinstance(e, AdmissionError) and not output_ids
            log.warning("request rejected", request_id=req.request_id, error=str(e), bad_input=rejected)
            self._fail_request(req, str(e), ERROR_REJECTED if rejected else None)
            return False
        self.owner[req.request_id] = slot.info.worker_id
        self._admissions += 1
        slot.last_admission = self._admissions
        self._pending_ops.append(("hset", self.keys.request_record(req.request_id), "worker", slot.info.worker_id))
        log.info("request admitted", request_id=req.request_id, worker_id=slot.info.worker_id,
                 prompt_tokens=len(req.prompt_ids), max_tokens=req.params.max_tokens,
                 resumed_from=len(output_ids or ()))
        self._stats_dirty = True
        return True

    def _fail_request(self, req: SubmitRequest, message: str, error_kind: str | None = None) -> None:
        self._tell_error(req.request_id, req.gateway_id, message, error_kind)
        self._pending_ops.append(("delete", self.keys.request_record(req.request_id)))
        self._outputs_written.pop(req.request_id, None)

    def is_known(self, request_id: str) -> bool:
        return request_id in self.owner or any(r.request_id == request_id for r, _ in self.parked)

    def on_submit(self, data: bytes) -> None:
        req = SubmitRequest.from_wire(data)
        if self.is_known(req.request_id):  # a claimed pending entry of a request recovered from its record
            self.num_duplicates += 1
            log.info("dropping a duplicate submit", request_id=req.request_id)
            return
        if req.params.seed is None and not req.params.greedy:
            # a seed of its own, kept in the record: a recompute (worker lost, scheduler fail-over) then
            # samples again the tokens its client already has, so the stream stays one sample
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=random.getrandbits(63)))
            data = req.to_wire()
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        try:
            # the record first (same pipeline, earlier): a restarted scheduler finds every admitted request
            self._pending_ops.append(("record", self.keys.request_record(req.request_id), data))
            self.admit(req)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def _tell_error(self, rid: str, gateway_id: str, message: str, error_kind: str | None = None) -> None:
        """An error event for a request's client: published, and in its token log, so a gateway that missed
        the message (or a client resuming later) still reads it instead of waiting for a deadline."""
        event = TokenEvent(rid, 0, [], "error", None, message, error_kind)
        self._pending_ops.append(("error", self.keys.gateway_channel(gateway_id),
                                  TokenBatch(-1, "scheduler", [event]).to_wire(), event.to_list()))

    def on_cancel(self, data: bytes) -> None:
        msg = CancelRequest.from_wire(data)
        self.cancel(msg.request_id, msg.reason)

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
        self._pending_ops.append(("delete", self.keys.request_record(rid)))
        self._outputs_written.pop(rid, None)
        self._stats_dirty = True
        log.info("request cancelled", request_id=rid, reason=reason, found=cancelled)

    def on_result(self, data: bytes) -> None:
        result = StepResult.from_wire(data)
        slot = self.workers.get(result.worker_id)
        open_ids = [entry[0] for entry in slot.in_flight] if slot is not None else []
        if result.epoch not in (0, self.epoch) or result.step_id not in open_ids:
            # an earlier scheduler's plan, a worker we gave up on, a step given up, or a duplicate
            log.debug("ignoring stale step result", worker_id=result.worker_id, step_id=result.step_id,
                      epoch=result.epoch)
            return
        # the worker runs plans in order: the open steps before this one lost their plan or result (the
        # policy recomputes what they sampled when it applies this result)
        while slot.in_flight[0][0] != result.step_id:
            lost = slot.in_flight.popleft()[0]
            self.num_steps_given_up += 1
            log.warning("step result missing (a later one came first)", worker_id=result.worker_id, step_id=lost)
        slot.in_flight.popleft()
        slot.head_since = time.monotonic()
        self._learn_step_cost(slot, result)
        policy = slot.policy
        before = {}
        for ev in result.events:
            outputs = policy.outputs_of(ev.seq_id)
            if outputs is not None:
                before[ev.seq_id] = len(outputs)
        finished = set(policy.update(result))
        if result.handoffs:
            self.count_handoff_results(result)
        self.hand_off_ready(slot)
        for rid in before:
            if rid in finished:
                continue
            outputs = policy.outputs_of(rid)
            written = self._outputs_written.get(rid, 0)
            if outputs is not None and len(outputs) - written >= OUTPUTS_PER_WRITE:  # a takeover resumes here
                self._pending_ops.append(("outputs", self.keys.request_record(rid), written, outputs[written:]))
                self._outputs_written[rid] = len(outputs)
        for rid in finished:
            self.owner.pop(rid, None)
            self._outputs_written.pop(rid, None)
            self._pending_ops.append(("delete", self.keys.request_record(rid)))
            reason = next((e.finish_reason for e in result.events if e.seq_id == rid and e.finish_reason), None)
            log.info("request finished", request_id=rid, finish_reason=reason, worker_id=result.worker_id)
        self._stats_dirty = True

    def _learn_step_cost(self, slot: WorkerSlot, result: StepResult) -> None:
        """Feed the worker's measured step time, with what its plan held, to its cost model; the policy
        plans with the refitted costs from its next plan on."""
        features = slot.plan_features
        for step_id in [k for k in features if k < result.step_id]:  # given up or lost: no time to learn
            del features[step_id]
        planned = features.pop(result.step_id, None)
        if planned is None or any(e.error for e in result.events):
            return
        tokens, keys, prefill_chunks = planned
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
                     itl_target=str(self.limits.itl_target))

    @property
    def step_timeout(self) -> float:
        """How long a step of at most the budget may go without a result before it is given up."""
        return self.base_step_timeout + self.deadline_margin

    def plan_timeout(self, plan: StepPlan, expected_s: float | None = None) -> float:
        """A step's deadline (the relay withdraws the heartbeat of a model that overruns it): from what the
        worker's learned step costs expect of it when there are some (step_deadline), else --step-timeout,
        scaled for a step larger than the token budget (chunked prefill off)."""
        fallback = self.base_step_timeout * max(1.0, plan.num_tokens / self.limits.max_num_batched_tokens)
        return step_deadline(expected_s, floor_s=self.step_timeout_floor, factor=self.step_timeout_factor,
                             fallback_s=fallback)

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
                self._stats_dirty = True
        return nearest

    def _void_unsent_plans(self, planned_before: dict[str, int]) -> None:
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

    # ------------------------------------------------------------------ the loop

    def plan_steps(self, pipe, now: float | None = None) -> int:
        """Fill every worker's pipeline of plans; returns how many plans were queued."""
        now = time.monotonic() if now is None else now
        sent = 0
        for wid, slot in self.workers.items():
            if not slot.takes_plans:  # a draining worker past its deadline, or told to go
                continue
            while len(slot.in_flight) < self.plans_in_flight and (slot.policy.has_unfinished() or slot.needs_plan):
                plan = slot.policy.schedule()
                slot.needs_plan = False
                if plan is None or not (plan.chunks or plan.starts or plan.releases):
                    break
                plan.epoch = self.epoch
                features = plan_features(plan.chunks)
                plan.timeout_s = self.plan_timeout(plan, slot.step_costs.expected_bound(*features))
                pipe.xadd(self.keys.steps(wid), {FIELD: plan.to_wire()}, maxlen=STREAM_MAXLEN, approximate=True)
                slot.in_flight.append((plan.step_id, now, plan.timeout_s + self.deadline_margin))
                slot.plan_features[plan.step_id] = features
                sent += 1
        if sent:
            self._stats_dirty = True
        return sent

    def stats(self) -> dict:
        policies = [s.policy for s in self.workers.values()]
        return {
            "num_waiting": sum(p.num_waiting for p in policies) + len(self.parked),
            "num_running": sum(p.num_running for p in policies),
            "kv_blocks_used": sum(p.num_used_blocks for p in policies),
            "kv_blocks_total": sum(s.info.num_blocks for s in self.workers.values()),
            "num_preemptions": sum(p.num_preemptions for p in policies) + self.retired_preemptions,
            "num_workers": len(policies),
            **self.handoffs.as_stats(),
            "num_steps_held_by_itl_target": sum(p.num_steps_held_by_itl_target for p in policies),
        }

    def maybe_write_stats(self, pipe, now: float) -> float | None:
        """Queue the stats write if due; returns seconds until a deferred write is due (or None)."""
        if not self._stats_dirty:
            return None
        wait = self._stats_written_at + STATS_INTERVAL_S - now
        if wait > 0:
            return wait
        stats = self.stats()
        self._stats_dirty = False
        if stats != self._last_stats:
            self._last_stats = dict(stats)
            stats["updated_at"] = time.time()
            pipe.set(self.keys.scheduler_stats(), msgpack.packb(stats))
            self._stats_written_at = now
        return None

    def _flush_ops(self, pipe) -> None:
        for op in self._pending_ops:
            kind, key = op[0], op[1]
            if kind == "record":
                pipe.hset(key, "submit", op[2])
            elif kind == "hset":
                pipe.hset(key, op[2], op[3])
            elif kind == "outputs":  # one field per offset: a retried pipeline cannot duplicate a token
                pipe.hset(key, mapping={f"{OUTPUT_FIELD_PREFIX}{op[2] + i}": t for i, t in enumerate(op[3])})
            elif kind == "delete":
                pipe.delete(key)
            elif kind == "plan":  # a plan outside a policy's steps (a drained worker's last)
                pipe.xadd(key, {FIELD: op[2]}, maxlen=STREAM_MAXLEN, approximate=True)
            elif kind == "publish":
                pipe.publish(key, op[2])
            elif kind == "error":  # the durable copy first, as the relay does for tokens
                token_log.append_event(pipe, self.keys, op[3])
                pipe.publish(key, op[2])
            elif kind == "abort":
                token_log.append_abort(pipe, self.keys, key, 0)
            elif kind == "dead":
                pipe.xadd(self.keys.dead_letters, {FIELD: op[2], "stream": key, "entry_id": op[3], "reason": op[4]},
                          maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        self._pending_ops.clear()

    def dead_letter(self, stream: str, entry_id, data: bytes, reason: str) -> None:
        """An entry nobody can read: kept in the dead-letter stream with the reason, and when it is a submit
        whose request id and gateway can still be read, its client gets an error instead of silence."""
        self.num_dead_letters += 1
        log.error("unreadable message; dead-lettered", stream=stream, entry_id=entry_id, reason=reason)
        self._pending_ops.append(("dead", stream, data, entry_id, reason))
        if stream != self.keys.requests:
            return
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:  # not even msgpack: nobody to tell
            return
        if not isinstance(body, dict) or body.get("k") == CancelRequest.KIND:
            return
        rid, gateway = body.get("request_id"), body.get("gateway_id")
        if isinstance(rid, str) and isinstance(gateway, str) and not self.is_known(rid):
            self._tell_error(rid, gateway, f"the scheduler could not read this request: {reason}")

    def handle(self, resp) -> None:
        if isinstance(resp, dict):  # RESP3 replies map stream -> entries
            resp = list(resp.items())
        for stream, entries in resp or ():
            stream = stream.decode() if isinstance(stream, bytes) else stream
            ids = []
            for entry_id, fields in entries:
                ids.append(entry_id)
                if not fields:  # deleted from the stream while pending (XAUTOCLAIM reports it so): nothing to do
                    continue
                data = fields.get(FIELD_BYTES)
                if data is None:
                    self.dead_letter(stream, entry_id, b"", f"no {FIELD!r} field")
                    continue
                try:
                    if stream == self.keys.results:
                        self.on_result(data)
                    else:
                        kind = peek_kind(data)
                        if kind == SubmitRequest.KIND:
                            self.on_submit(data)
                        elif kind == CancelRequest.KIND:
                            self.on_cancel(data)
                        else:
                            raise WireError(f"unknown message kind {kind!r}")
                except Exception as e:  # noqa: BLE001 -- one bad message must not stop the scheduler
                    self.dead_letter(stream, entry_id, data, f"{type(e).__name__}: {e}")
            if ids:
                self._acks.append((stream, ids))

    async def run(self) -> None:
        """Standby until the lease is ours, then lead until stopped (or the lease is lost: standby again).
        A Redis outage is waited out with backoff; the state survives it."""
        backoff = Backoff()
        ready = False
        try:
            while not self.stopping.is_set():
                try:
                    if not self.is_leader:
                        ready = False
                        self._reset_state()
                        await self.acquire_lease()
                        if self.stopping.is_set():
                            break
                    if not ready:
                        await self.setup()
                        ready = True
                        log.info("scheduler ready", consumer=self.consumer, epoch=self.epoch,
                                 workers=len(self.workers))
                    await self.lead(backoff)
                except LeaseLost as e:
                    log.error("lease lost to another scheduler; standing by", holder=str(e))
                    self.is_leader = False
                except ResponseError as e:
                    # Redis came back without its data (a claim or read met no group): set up again, which
                    # recreates the groups; the lease is renewed by the next turn (RENEW_LEASE takes it back)
                    if "NOGROUP" not in str(e):
                        raise
                    log.warning("consumer group missing; recreating", error=str(e))
                    ready = False
                except CONNECTION_ERRORS as e:
                    delay = backoff.next_delay()
                    log.warning("redis unreachable; retrying", error=str(e), retry_in_s=round(delay, 2))
                    try:
                        await asyncio.wait_for(self.stopping.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
        finally:
            try:
                await self.release_lease()
            except (*CONNECTION_ERRORS, ResponseError):
                pass
        log.info("scheduler stopped")

    async def lead(self, backoff: Backoff) -> None:
        streams = {self.keys.requests: ">", self.keys.results: ">"}
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= self._next_refresh:
                await self.refresh_workers(now)
            if now >= self._next_claim:
                await self.claim_pending(min_idle_ms=2 * self.lease_ttl_ms)
            next_deadline = self.give_up_overdue_steps(now)
            self.advance_drains(now)
            ops, acks = list(self._pending_ops), list(self._acks)  # restored if Redis is unreachable
            pipe = self.client.pipeline(transaction=False)
            renewing = self.renew_lease(pipe, now)
            self._flush_ops(pipe)  # request records and publishes decided while handling the last read
            planned_before = {wid: len(slot.in_flight) for wid, slot in self.workers.items()}
            self.plan_steps(pipe, now)
            for stream, ids in self._acks:
                pipe.xack(stream, self.keys.scheduler_group, *ids)
                pipe.xdel(stream, *ids)  # acknowledged entries are history nobody reads
            self._acks.clear()
            stats_wait = self.maybe_write_stats(pipe, now)
            block_s = self._next_refresh - now
            for wait in (stats_wait, next_deadline, self._renew_at - now):
                if wait is not None:
                    block_s = min(block_s, wait)
            block_ms = max(1, int(block_s * 1000))
            # the blocking read rides in the same pipeline: one round trip per turn
            pipe.xreadgroup(self.keys.scheduler_group, self.consumer, streams, count=READ_COUNT, block=block_ms)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except CONNECTION_ERRORS:
                self._pending_ops[:0], self._acks[:0] = ops, acks
                self._renew_at = 0.0  # renew first thing once Redis is back
                self._void_unsent_plans(planned_before)
                raise
            backoff.reset()
            if renewing and replies[0] != 1:
                raise LeaseLost(await self.client.get(self.keys.scheduler_lease()))
            errors = [r for r in replies if isinstance(r, ResponseError)]
            if any("NOGROUP" in str(r) for r in errors):  # Redis was flushed or restarted: recreate the groups
                log.warning("consumer group missing; recreating", error=str(errors[0]))
                await self.setup()
                continue
            for err in errors:
                log.error("a scheduler write failed", error=str(err))
            if not isinstance(replies[-1], ResponseError):
                self.handle(replies[-1])

    def stop(self) -> None:
        self.stopping.set()


def confirmed_outputs(record: dict) -> list[int]:
    """A request record's confirmed output tokens, in offset order, up to the first gap."""
    by_offset = {}
    for name, value in record.items():
        name = name.decode() if isinstance(name, bytes) else name
        if name.startswith(OUTPUT_FIELD_PREFIX) and name[len(OUTPUT_FIELD_PREFIX):].isdigit():
            by_offset[int(name[len(OUTPUT_FIELD_PREFIX):])] = int(value)
    outputs = []
    while len(outputs) in by_offset:
        outputs.append(by_offset[len(outputs)])
    return outputs


async def serve(args) -> None:
    client = connect_async(args.redis_url, name=f"{args.key_prefix}:scheduler")
    limits = PolicyLimits(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                          args.attention_horizon, args.long_prefill_threshold, kv_transport=args.kv_transport,
                          itl_target=args.itl_target)
    service = SchedulerService(client, Keys(args.key_prefix), limits, heartbeat_interval=args.heartbeat_interval,
                               step_timeout=args.step_timeout, lease_ttl=args.scheduler_lease_ttl,
                               resume_grace=args.resume_grace, drain_timeout=args.drain_timeout,
                               step_timeout_floor=args.step_timeout_floor,
                               step_timeout_factor=args.step_timeout_factor)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    try:
        await service.run()
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    from phaseserve import logs, settings

    args = settings.parse("scheduler", argv, prog="phaseserve scheduler")
    logs.configure("scheduler", args.log_level, args.log_json)
    if not args.redis_url:
        raise SystemExit("phaseserve scheduler: --redis-url (or REDIS_URL) is required")
    if args.attention_horizon is not None and args.attention_horizon < 0:
        raise SystemExit(f"phaseserve scheduler: --attention-horizon must be >= 0 (0 = off), "
                         f"got {args.attention_horizon}")
    if args.long_prefill_threshold < 0:
        raise SystemExit(f"phaseserve scheduler: --long-prefill-threshold must be >= 0 (0 = no cap), "
                         f"got {args.long_prefill_threshold}")
    for name in ("step_timeout", "scheduler_lease_ttl", "heartbeat_interval", "step_timeout_floor"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"phaseserve scheduler: --{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.step_timeout_factor >= 0:
        raise SystemExit(f"phaseserve scheduler: --step-timeout-factor must be >= 0 (0 = always --step-timeout), "
                         f"got {args.step_timeout_factor}")
    if not args.drain_timeout >= 0:
        raise SystemExit(f"phaseserve scheduler: --drain-timeout must be >= 0 (0 = hand back at once), "
                         f"got {args.drain_timeout}")
    freeze_startup_heap()
    event_loop.run(serve(args))
    return 0
