"""What the prefill -> decode handoffs between workers came to, since this scheduler took the lease (the
gateway's /metrics shows them). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.scheduler_stats import HandoffStats
from phaseserve.wire import KV_TRANSPORTS

MAX_PENDING_HANDOFFS = 4096  # handoffs whose transport is remembered until their receive is reported


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
