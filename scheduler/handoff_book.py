"""A phase worker's policy's book of prefill -> decode handoffs: the transfers its prefills stream into, the
sequences ready to leave, and what it handed over and took in. No I/O.

While `kv_transport` is set (the service sets it on a prefill worker when a decode worker exists), every
sequence started there streams its prefill's KV into a transfer, and once its prefill is planned whole it is
not decoded there: after its first token is confirmed it is ready, and the service moves it
(`WorkerPolicy.hand_off` here, `accept_handoff` on the decode worker's policy) or keeps it (`keep`). A decode
worker's handed-in sequence is started with its KVReceive in its first plan, beside its first decode.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from phaseserve.wire import KVReceive, KVSend, SubmitRequest
from phaseserve.scheduler.sequence import Sequence


@dataclass
class Handoff:
    """A sequence leaving a prefill worker for a decode worker: its KV (positions [0, num_cached)) is in
    transfer `kv_send`; the decode worker continues at output offset len(output_ids)."""

    request: SubmitRequest
    output_ids: list[int]
    num_cached: int
    kv_send: KVSend


class HandoffBook:
    """The handoffs of one worker's policy."""

    def __init__(self, transfer_prefix: str = "t"):
        self.kv_transport: str | None = None  # set by the service: stream prefills out for decode workers
        # unguessable: a shared-memory transfer's file is named by its id (workers/kv_transfer/shm_transport.py)
        self._transfer_ids = (f"{transfer_prefix}-{secrets.token_hex(12)}" for _ in itertools.count())
        self._ready: list[Sequence] = []  # first token confirmed, waiting for the service
        self.num_handed_off = 0  # sequences moved to a decode worker
        self.num_handed_in = 0  # sequences taken from a prefill worker

    def new_send(self) -> KVSend | None:
        """The transfer a (re)started prefill streams into (a new one each time: ids are single-use), or None
        when this worker decodes its own prefills."""
        return None if self.kv_transport is None else KVSend(next(self._transfer_ids), self.kv_transport)

    def first_token_confirmed(self, seq: Sequence) -> None:
        """`seq`'s prefill is whole and its first token in: it is ready to leave."""
        self._ready.append(seq)

    def take_ready(self, live: Mapping[str, Sequence]) -> list[str]:
        """The ready sequences still live and waiting (each reported once)."""
        ready, self._ready = self._ready, []
        return [s.seq_id for s in ready if live.get(s.seq_id) is s and s.awaiting_handoff]

    @staticmethod
    def handoff_of(seq: Sequence) -> Handoff:
        """What a sequence waiting for its handoff takes to a decode worker."""
        assert seq.awaiting_handoff and seq.kv_send is not None, seq.seq_id
        return Handoff(seq.request, list(seq.output_ids), seq.prefill_len, seq.kv_send)

    @staticmethod
    def keep(seq: Sequence) -> None:
        """No decode worker can take it: it decodes here (the worker drops its transfer at the first decode)."""
        seq.awaiting_handoff = False
        seq.kv_send = None

    @staticmethod
    def receive(handoff: Handoff, block_table: list[int], timeout_s: float) -> KVReceive:
        """The receive a handed-in sequence's first plan carries, into `block_table`."""
        req, send = handoff.request, handoff.kv_send
        return KVReceive(req.request_id, send.transfer_id, send.transport, list(block_table), handoff.num_cached,
                         timeout_s)
