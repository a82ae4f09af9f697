"""One worker's sequences and the queues they move between: waiting (no blocks), running (holding blocks),
and the releases the next plan tells the worker of. No I/O; what moves them when is scheduler/policy.py.

Both queues stay sorted by rank ((priority, arrival): `sequence.by_rank`). A sequence is live while
`seqs` maps its id to that very object: a cancelled and re-added request id is another sequence.
"""

from __future__ import annotations

import bisect
import itertools

from phaseserve.wire import SubmitRequest
from phaseserve.scheduler.fair_share import TenantShares
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.sequence import Sequence, SequenceStatus, by_rank

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING


class SequenceQueues:
    """The sequences of one worker, their queues, and the releases pending for its next plan."""

    def __init__(self, kv: KVCacheManager, shares: TenantShares):
        self.kv = kv
        self.shares = shares
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self.waiting: list[Sequence] = []  # sorted by rank; no blocks
        self.running: list[Sequence] = []  # sorted by rank; hold blocks
        self.releases: list[str] = []  # for the next plan
        self._arrivals = itertools.count()
        self._prefill_marks: dict[str, int] = {}  # seq id -> positions computed at the last quiet_progress

    def new(self, req: SubmitRequest, output_ids: list[int], status: SequenceStatus = WAITING) -> Sequence:
        """A new live sequence of `req`, queued waiting (or running: the caller gives it its blocks)."""
        if req.request_id in self.seqs:
            raise ValueError(f"request {req.request_id!r} is already scheduled")
        seq = Sequence(req, next(self._arrivals), output_ids, status=status)
        self.seqs[req.request_id] = seq
        self.shares.join(seq.tenant, req.tenant_weight)
        bisect.insort(self.running if status is RUNNING else self.waiting, seq, key=by_rank)
        return seq

    def is_live(self, seq: Sequence) -> bool:
        return self.seqs.get(seq.seq_id) is seq

    def start(self, seq: Sequence) -> None:
        """A waiting sequence is admitted: it runs (the caller gives it its blocks and its prefill)."""
        self.waiting.remove(seq)
        seq.status = RUNNING
        bisect.insort(self.running, seq, key=by_rank)

    def send_back(self, seq: Sequence) -> None:
        """A running sequence loses its blocks and waits to be recomputed from its confirmed outputs."""
        self.running.remove(seq)
        self.kv.free(seq.block_table)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.prefill_len = 0
        seq.num_named_blocks = 0
        seq.kv_send, seq.kv_receive, seq.awaiting_handoff = None, None, False  # a recompute starts afresh
        self._release(seq)
        bisect.insort(self.waiting, seq, key=by_rank)

    def retire(self, seq: Sequence) -> None:
        """Finished or cancelled: out of every queue, blocks freed, worker told."""
        if seq.status is RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.block_table)
        elif seq.status is WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        if self.is_live(seq):
            del self.seqs[seq.seq_id]
            self.shares.leave(seq.tenant)

    def _release(self, seq: Sequence) -> None:
        if seq.on_worker:
            self.releases.append(seq.seq_id)
            seq.on_worker = False

    def take_releases(self) -> list[str]:
        releases, self.releases = self.releases, []
        return releases

    def take_all(self) -> list[Sequence]:
        """Retire every unfinished sequence, returning them in rank order."""
        seqs = sorted(self.seqs.values(), key=by_rank)
        for seq in seqs:
            self.retire(seq)
        return seqs

    def take_waiting(self) -> list[Sequence]:
        """Retire the waiting sequences that may start elsewhere now: one with a sample still in flight stays
        until that result is in (its recompute must carry every token the worker published for it)."""
        seqs = [s for s in self.waiting if s.num_inflight_samples == 0]
        for seq in seqs:
            self.retire(seq)
        return seqs

    def quiet_progress(self) -> list[SubmitRequest]:
        """The sequences moving on without a token to show for it since the last call: waiting (queued, or
        preempted), prefilling with more positions computed than then (a long prompt's chunks; a chunk
        is planned only once the results of the plans before it came back, so a stuck worker stops this),
        and those the worker is still preparing (they sit out steps; its budget bounds that)."""
        marks, self._prefill_marks = self._prefill_marks, {}
        moving = [s.request for s in self.waiting]
        for seq in self.running:
            if seq.sat_out:
                moving.append(seq.request)
            elif seq.is_prefilling:
                self._prefill_marks[seq.seq_id] = seq.num_computed_tokens
                if seq.num_computed_tokens > marks.get(seq.seq_id, -1):
                    moving.append(seq.request)
        return moving

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens not yet planned: the waiting sequences' whole prefills, the rest of partial ones."""
        return (sum(s.num_known_tokens for s in self.waiting)
                + sum(s.num_prefill_remaining for s in self.running if s.is_prefilling))

    def unprefilled(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, tokens to prefill, of them computed or planned) of the waiting sequences and those part
        way through their prefill, in rank order of each."""
        return ([(s, s.num_known_tokens, 0) for s in self.waiting]
                + [(s, s.prefill_len, s.num_computed_tokens) for s in self.running if s.is_prefilling])

    @property
    def num_handoffs_in_flight(self) -> int:
        """Sequences whose KV is moving: prefilled here for a decode worker, or handed in and not yet applied."""
        return sum(1 for s in self.running if s.awaiting_handoff or s.kv_receive is not None)
