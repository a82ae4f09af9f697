"""The handoff bookkeeping of a worker's policy (phase workers): sequences leaving a prefill worker for a
decode worker, and arriving there. No I/O.

While `WorkerPolicy.kv_transport` is set (the service sets it on a prefill worker when a decode worker
exists), every sequence started there streams its prefill's KV into a transfer, and once its prefill is
planned whole it is not decoded there: after its first token is confirmed it is `ready_handoffs`, and the
service moves it (`hand_off` here, `accept_handoff` on the decode worker's policy) or keeps it (`keep`). A
decode worker's handed-in sequence is started with its KVReceive in its first plan, beside its first decode.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from phaseserve.wire import KVReceive, KVSend, SubmitRequest
from scheduler.sequence import Sequence, SequenceStatus, by_rank


@dataclass
class Handoff:
    """A sequence leaving a prefill worker for a decode worker: its KV (positions [0, num_cached)) is in
    transfer `kv_send`; the decode worker continues at output offset len(output_ids)."""

    request: SubmitRequest
    output_ids: list[int]
    num_cached: int
    kv_send: KVSend


class HandoffBookkeeping:
    """The part of `WorkerPolicy` that hands sequences over; it works on the policy's queues and blocks."""

    def ready_handoffs(self) -> list[str]:
        """Sequences whose prefill is done and first token confirmed, waiting to be handed to a decode
        worker (`hand_off`) or kept here (`keep`); each is reported once."""
        ready, self._ready_handoffs = self._ready_handoffs, []
        return [s.seq_id for s in ready if self._seqs.get(s.seq_id) is s and s.awaiting_handoff]

    def handoff_of(self, seq_id: str) -> Handoff:
        """What a sequence waiting for its handoff would take to a decode worker."""
        seq = self._seqs[seq_id]
        assert seq.awaiting_handoff and seq.kv_send is not None, seq_id
        return Handoff(seq.request, list(seq.output_ids), seq.prefill_len, seq.kv_send)

    def hand_off(self, seq_id: str) -> Handoff:
        """Let a sequence go to a decode worker: its blocks are freed and the worker told to forget it (its
        KV is already whole in the transfer: the worker finishes the transfer when the prefill ends, before
        it reports the first token)."""
        handoff = self.handoff_of(seq_id)
        self._retire(self._seqs[seq_id])
        self._num_handed_off += 1
        return handoff

    def keep(self, seq_id: str) -> None:
        """No decode worker can take it: it decodes here (the worker drops its transfer at the first decode)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.awaiting_handoff = False
            seq.kv_send = None

    def can_accept_handoff(self, handoff: Handoff) -> bool:
        """Room for a handed-in sequence now: a max_num_seqs slot, blocks for its cached positions and its
        first decode above the watermark and the blocks promised to prefills."""
        bm, req = self.block_manager, handoff.request
        return (self.capacity.rejection(len(req.prompt_ids), req.params.max_tokens, len(handoff.output_ids)) is None
                and len(self._running) < self.config.max_num_seqs
                and bm.can_allocate(bm.blocks_for(handoff.num_cached + 1), reserved=self._promised_blocks()))

    def accept_handoff(self, handoff: Handoff, timeout_s: float = 2.0) -> None:
        """Take a sequence from a prefill worker: blocks for its cached positions now, its KV received into
        them with its first decode (`_schedule_decodes`). If the receive fails the worker reports no token
        and the sequence is recomputed here (`_settle`), never decoded over a half-received cache."""
        req = handoff.request
        if req.request_id in self._seqs:
            raise ValueError(f"request {req.request_id!r} is already scheduled")
        seq = Sequence(req, next(self._arrivals), list(handoff.output_ids), status=SequenceStatus.RUNNING)
        seq.prefill_len = seq.num_computed_tokens = handoff.num_cached
        self.block_manager.append(seq.block_table, 0, handoff.num_cached)
        seq.kv_receive = KVReceive(req.request_id, handoff.kv_send.transfer_id, handoff.kv_send.transport,
                                   list(seq.block_table), handoff.num_cached, timeout_s)
        self._seqs[req.request_id] = seq
        self.shares.join(seq.tenant, req.tenant_weight)
        bisect.insort(self._running, seq, key=by_rank)
        self._num_handed_in += 1
