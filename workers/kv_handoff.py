"""A worker's side of prefill -> decode handoffs: it streams its prefills' KV out, or takes
handed-in KV into its cache, around each model step. The scheduler decides everything; see
docs/kv-transfer.md ("The handoff") for the whole sequence of messages.

- Prefill worker. A `SeqStart` with `send_kv` opens an outgoing transfer. After each step, every block the
  sequence's chunk completed is sent (`KVSender.send_blocks`), so the transfer overlaps the prompt's later
  chunks; the step that ends the prefill also sends the last, partial block and closes the transfer, before
  the step's result (the first token) is published. So by the time the scheduler hands the sequence to a
  decode worker, the transfer is whole and the prefill worker's blocks are free to reuse.
  A sequence the scheduler kept here (no decode worker had room) gets a decode chunk instead, and one whose
  first token was its last is released finished: their transfers are aborted then. A released one that
  was handed off (or cancelled) just leaves: a handed-off transfer is the decode worker's to take; an
  abandoned one expires (Redis TTL; shared-memory files are swept).
- Decode worker. A plan's `KVReceive`s are applied before its chunks run. A failed one (timeout, checksum,
  layout) writes nothing: the sequence is not started, its chunks are skipped, and the scheduler, seeing
  no token, recomputes it.

Why in the model process: it owns the cache (export and import are tensor copies). The Redis transport
makes its own round trips here, which the step pays for (a prefill chunk's blocks: one pipeline); the
shared-memory transport, for workers on one host, costs a copy and a checksum.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import structlog

from phaseserve.redis_client import connect
from phaseserve.wire import KVHandoffResult, KVReceive, KVSend, StepPlan
from phaseserve.workers.kv_transfer import KVReceiver, KVSender, KVTransferError
from phaseserve.workers.kv_transfer.redis_transport import RedisKVReceiver, RedisKVSender
from phaseserve.workers.kv_transfer.shm_transport import ShmKVReceiver, ShmKVSender, private_dir, remove_stale_transfers

log = structlog.get_logger(__name__)

STALE_TRANSFER_S = 120.0  # a shared-memory transfer nobody took in this long is swept
SWEEP_EVERY_S = 30.0


@dataclass
class _Outgoing:
    send: KVSend
    num_tokens: int  # the prefill's length: prompt + outputs at (re)start
    sender: KVSender | None = None  # opened at the first chunk, when the first block ids are known
    blocks_sent: int = 0
    finished: bool = False  # closed: whole, until the release (handed off) or a decode here (kept: aborted)


class KVHandoffs:
    def __init__(self, runner, redis_url: str | None = None, key_prefix: str = "ps"):
        self.runner = runner
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.outgoing: dict[str, _Outgoing] = {}
        self._client = None
        self._receivers: dict[str, KVReceiver] = {}
        self._next_sweep = 0.0
        self._uses_shm = False  # this worker sent through shared memory: it sweeps what nobody took
        self._shm_dir = None  # the stack's private directory of shared-memory transfers, made on first use
        self.num_sent: Counter[str] = Counter()  # transfers completed, by transport

    def _redis(self):
        if self._client is None:
            if not self.redis_url:
                raise KVTransferError("the Redis KV transport needs the worker's --redis-url")
            self._client = connect(self.redis_url, name=f"{self.key_prefix}:kv-transfer", key_prefix=self.key_prefix)
        return self._client

    def shm_dir(self):
        if self._shm_dir is None:
            self._shm_dir = private_dir(self.key_prefix)
        return self._shm_dir

    def _receiver(self, transport: str) -> KVReceiver:
        if transport not in self._receivers:
            self._receivers[transport] = (ShmKVReceiver(directory=self.shm_dir()) if transport == "shm"
                                          else RedisKVReceiver(self._redis(), prefix=self.key_prefix))
        return self._receivers[transport]

    def _open(self, out: _Outgoing, block_ids: list[int]) -> KVSender:
        n = -(-out.num_tokens // self.runner.block_size)
        ids = (list(block_ids) + [-1] * n)[:n]  # later blocks are learned chunk by chunk
        t = out.send.transfer_id
        if out.send.transport == "shm":
            return ShmKVSender(t, self.runner.kv, ids, directory=self.shm_dir())
        return RedisKVSender(self._redis(), t, self.runner.kv, ids, prefix=self.key_prefix)

    # ------------------------------------------------------------------ around a step

    def before_step(self, plan: StepPlan) -> list[KVHandoffResult]:
        """Forget released transfers, open new ones, and apply the plan's receives (removing the SeqStart of
        each that failed, so the runner never decodes over it)."""
        if plan.reset:
            self.outgoing.clear()
        if self.outgoing:
            for seq_id in plan.releases:  # handed off (the transfer is the decode worker's now), or done here
                state = self.runner.seqs.get(seq_id)
                if state is not None and state.finished:  # its first token was its last: nobody takes it
                    self._abort(seq_id, "finished on the prefill worker")
                else:
                    self.outgoing.pop(seq_id, None)
            for c in plan.chunks:  # a decode of a sequence kept here: nobody will take its transfer
                out = self.outgoing.get(c.seq_id)
                if out is not None and c.start_pos >= out.num_tokens:
                    self._abort(c.seq_id, "kept on the prefill worker")
        for s in plan.starts:
            if s.send_kv is not None:
                self.outgoing[s.seq_id] = _Outgoing(s.send_kv, s.num_tokens)
                self._uses_shm |= s.send_kv.transport == "shm"
        results = [self._receive(r) for r in plan.receives]
        failed = {r.seq_id for r in results if not r.ok}
        if failed:
            plan.starts = [s for s in plan.starts if s.seq_id not in failed]
        if self._uses_shm:
            self._sweep()
        return results

    def after_step(self, plan: StepPlan) -> None:
        """Send every block the step's prefill chunks completed; close the transfers whose prefill ended."""
        if not self.outgoing:
            return
        bs = self.runner.block_size
        for c in plan.chunks:
            out = self.outgoing.get(c.seq_id)
            end = c.start_pos + c.num_tokens
            state = self.runner.seqs.get(c.seq_id)
            if (out is None or out.finished or end > out.num_tokens or state is None
                    or state.num_computed != end):
                continue  # not streamed, a decode, or a chunk the runner did not run (the scheduler recomputes)
            try:
                if out.sender is None:
                    out.sender = self._open(out, c.block_table)
                done = end == out.num_tokens
                full = -(-end // bs) if done else end // bs
                if full > out.blocks_sent:
                    out.sender.update_block_ids(c.block_table)
                    out.sender.send_blocks(out.blocks_sent, full)
                    out.blocks_sent = full
                if done:
                    out.sender.finish(out.num_tokens)
                    out.finished = True
                    self.num_sent[out.send.transport] += 1
                    log.debug("kv transfer sent", seq_id=c.seq_id, transfer_id=out.send.transfer_id,
                              num_bytes=out.sender.num_bytes)
            except (KVTransferError, OSError) as e:  # the decode worker's receive then fails: a recompute
                log.error("kv transfer send failed", seq_id=c.seq_id, transfer_id=out.send.transfer_id, error=str(e))
                self._abort(c.seq_id, str(e))

    # ------------------------------------------------------------------ helpers

    def _receive(self, r: KVReceive) -> KVHandoffResult:
        try:
            summary = self._receiver(r.transport).receive(r.transfer_id, self.runner.kv, r.block_ids, r.timeout_s)
        except (KVTransferError, OSError) as e:
            log.warning("kv handoff failed; the scheduler recomputes the sequence", seq_id=r.seq_id,
                        transfer_id=r.transfer_id, error=str(e))
            return KVHandoffResult(r.seq_id, r.transfer_id, False, error=f"{type(e).__name__}: {e}")
        if summary.num_tokens != r.num_tokens:
            log.error("kv handoff of the wrong length", seq_id=r.seq_id, sent=summary.num_tokens, expected=r.num_tokens)
            return KVHandoffResult(r.seq_id, r.transfer_id, False,
                                   error=f"{summary.num_tokens} tokens sent, {r.num_tokens} expected")
        self.runner.mark_written(r.block_ids)  # its prefix may be shared here later (a recompute)
        return KVHandoffResult(r.seq_id, r.transfer_id, True, summary.num_blocks, summary.num_bytes, summary.seconds)

    def _abort(self, seq_id: str, why: str) -> None:
        out = self.outgoing.pop(seq_id, None)
        if out is not None and out.sender is not None:
            try:
                out.sender.abort()
            except (KVTransferError, OSError) as e:
                log.warning("kv transfer abort failed", transfer_id=out.send.transfer_id, error=str(e))
        log.debug("kv transfer dropped", seq_id=seq_id, reason=why)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_EVERY_S
            remove_stale_transfers(STALE_TRANSFER_S, self.shm_dir())

