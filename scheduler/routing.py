"""Routing requests to workers, pure: which worker a new (or resumed) request goes to, admitting it there or
parking it while no worker can run it, and a cancel reaching the worker that holds the request."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from phaseserve.wire import ERROR_REJECTED, SubmitRequest
from phaseserve.scheduler.cluster_stats import ClusterCounters
from phaseserve.scheduler.membership import Membership, PolicyLimits
from phaseserve.scheduler.policy import AdmissionError
from phaseserve.scheduler.prefix_index import request_seed
from phaseserve.scheduler.recent_prompts import RecentPrompts
from phaseserve.scheduler.request_book import RequestBook
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")

# Cache-aware routing: a request goes to the worker holding the longest cached prefix of it among the workers
# whose load (unfinished sequences) is within this slack of the least loaded one's: max(PREFIX_SLACK_SEQS,
# the least load), i.e. up to twice the least load (a few more at light load). A history prefilled again
# costs more than a few more sequences in a decode batch; past the slack, load wins, so a hot prefix does not
# pile every request on one worker (and once a second worker has it too, load decides between them).
PREFIX_SLACK_SEQS = 4
# a prompt agreeing with a recent one on at least this many positions, of which the cache matched under half,
# gets a debug line saying where the two first differ
SHARED_PREFIX_LOG_TOKENS = 64


def pick_worker(staying: list[WorkerSlot], req: SubmitRequest, output_ids: list[int] | None = None
                ) -> WorkerSlot | None:
    """Of the workers not draining (`staying`): the least loaded (least queued prefill on a prefill worker;
    fewest unfinished sequences, then most free blocks) of those that can hold it.
    If none can, the largest, whose policy then rejects it with the nearest miss in its message.
    New sequences start on prefill and mixed workers; decode workers take them only when there are
    no others (then they prefill too). None (park it) when no worker but draining ones lives."""
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


@dataclass
class RequestRouter:
    """Admits requests to the workers `pick_worker` chooses, and routes cancels to the worker holding them."""

    membership: Membership
    book: RequestBook
    counters: ClusterCounters
    limits: PolicyLimits
    recent_prompts: RecentPrompts = field(default_factory=RecentPrompts)
    admissions: int = 0  # requests admitted so far: WorkerSlot.last_admission is one of these

    def admit(self, req: SubmitRequest, output_ids: list[int] | None = None) -> bool:
        slot = pick_worker(self.membership.staying(), req, output_ids)
        if slot is None:
            self.book.parked.append((req, output_ids))
            self.counters.dirty = True  # counted in num_waiting
            return True
        try:
            slot.policy.add_request(req, output_ids=output_ids or None)
        except ValueError as e:  # e.g. a prompt no worker can hold: fail this request, not the scheduler
            # a new request too big for every worker is the client's error; a resumed one whose surviving
            # workers are smaller than the one it started on is the cluster's
            rejected = isinstance(e, AdmissionError) and not output_ids
            log.warning("request rejected", request_id=req.request_id, error=str(e), bad_input=rejected)
            self.book.fail_request(req, str(e), ERROR_REJECTED if rejected else None)
            return False
        slot.loras.use(req.lora.key if req.lora is not None else None)
        self.admissions += 1
        slot.last_admission = self.admissions
        if self.limits.enable_prefix_caching and not output_ids:
            self.note_prefix_miss(req, slot)
        self.book.placed(req.request_id, slot.info.worker_id)
        log.info("request admitted", request_id=req.request_id, worker_id=slot.info.worker_id,
                 prompt_tokens=len(req.prompt_ids), max_tokens=req.params.max_tokens,
                 resumed_from=len(output_ids or ()))
        self.counters.dirty = True
        return True

    def readmit(self, moved: list[tuple[SubmitRequest, list[int] | None]]) -> None:
        """Sequences taken from a worker (draining, or waiting there): admitted again elsewhere, or parked."""
        for req, output_ids in moved:
            self.book.owner.pop(req.request_id, None)
            self.admit(req, output_ids)

    def place_parked(self) -> None:
        for req, output_ids in self.book.take_parked():
            self.admit(req, output_ids)

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

    def cancel(self, rid: str, reason: str | None) -> None:
        wid = self.book.owner.pop(rid, None)
        workers = self.membership.workers
        if wid is not None and wid in workers:
            slot = workers[wid]
            cancelled = slot.policy.cancel(rid)
            slot.needs_plan = True  # the worker must be told to release the sequence
        else:
            cancelled = self.book.unpark(rid)
        self.book.forget(rid)
        self.counters.dirty = True
        log.info("request cancelled", request_id=rid, reason=reason, found=cancelled)
