"""Which of a plan's chunks the runner may run this step, and which fail, wait or are skipped: a plan comes
from another process (and a scheduler that may not yet have seen this worker restart), so the runner checks
it against what it holds before a forward pass that one bad chunk would fail for the whole batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from phaseserve.lora import LoraError
from phaseserve.wire import ERROR_GRAMMAR, LoraRef, ScheduledChunk, SeqStart, StepPlan, TokenEvent
from phaseserve.workers.lora import LoadedAdapters
from phaseserve.workers.sequence_state import SequenceState

log = structlog.get_logger(__name__)


@dataclass
class Admitted:
    """A plan's chunks as the step runs them."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    # seq id -> (its tokens, the most drafts it may verify, its block table): the step's speculative decodes
    wants: dict[str, tuple[list[int], int, list[int]]] = field(default_factory=dict)
    deferred: dict[str, int] = field(default_factory=dict)  # sequences sitting out -> the position held at
    events: list[TokenEvent] = field(default_factory=list)  # the sequences failed by the checks


class PlanChecks:
    def __init__(self, *, vocab_size: int, block_size: int, num_blocks: int, max_model_len: int,
                 loras: LoadedAdapters, speculating: bool):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.loras = loras
        self.speculating = speculating
        # blocks this process wrote (or received): a cached prefix may be read only from those. A scheduler that
        # has not yet seen this worker restart may still name blocks its previous life computed.
        self.written_blocks = bytearray(num_blocks)

    def mark_written(self, block_ids) -> None:
        """Blocks whose KV this process wrote (a chunk) or received (a KV transfer)."""
        for b in block_ids:
            self.written_blocks[b] = 1

    def forget_written(self) -> None:
        """No block holds anyone's prefix (after a scratch sequence's warm-up)."""
        self.written_blocks[:] = bytes(self.num_blocks)

    def _holds_prefix(self, block_table: list[int], num_cached: int) -> bool:
        written = self.written_blocks
        return all(written[b] for b in block_table[:num_cached // self.block_size])

    def check_start(self, s: SeqStart) -> str | None:
        """Why a started sequence cannot run (None: it can). A token id the embedding cannot look up would
        fail the whole batch's forward pass."""
        vocab = self.vocab_size
        bad = [t for t in (*s.prompt_ids, *s.output_ids) if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        return self._load_lora(s.lora)

    def _load_lora(self, ref: LoraRef | None) -> str | None:
        """Why the sequence's adapter cannot be loaded (its folder gone or changed since the gateway checked
        it), or None: loaded, and now the most recently used."""
        if ref is None:
            return None
        try:
            self.loras.get(ref)
        except LoraError as e:
            return f"LoRA adapter {ref.name!r}: {e}"
        return None

    def _check_chunk(self, c: ScheduledChunk, seq: SequenceState) -> str | None:
        end = c.start_pos + c.num_tokens
        if c.num_tokens < 1 or c.start_pos < 0 or end > len(seq.token_ids):
            return f"chunk [{c.start_pos}, {end}) is outside the {len(seq.token_ids)} known tokens"
        if len(c.block_table) * self.block_size < end:
            return f"block table of {len(c.block_table)} blocks cannot hold {end} tokens"
        if end > self.max_model_len:
            return f"chunk ends at {end}, beyond max_model_len {self.max_model_len}"
        if c.block_table and (min(c.block_table) < 0 or max(c.block_table) >= self.num_blocks):
            return f"block id out of range [0, {self.num_blocks})"
        return self._load_lora(seq.lora)

    def admit(self, plan: StepPlan, seqs: dict[str, SequenceState], prepare_timeout: float) -> Admitted:
        """The plan's chunks that run now. A sequence whose grammar matcher is not ready sits out (deferred;
        one past `prepare_timeout` fails), a chunk after a lost plan is skipped (the scheduler, seeing no
        token, recomputes it), a bad one fails its sequence alone."""
        out = Admitted()
        started = {s.seq_id for s in plan.starts}
        now = time.monotonic()
        for c in plan.chunks:
            seq = seqs.get(c.seq_id)
            if seq is None or seq.finished:
                continue  # planned one step ahead of a finish, or already released
            if seq.matcher is not None and not seq.matcher.done() and _samples(c, seq):
                # its preparation is not ready: the step does not wait for it (workers/preparation.py)
                if seq.matcher.overdue(now):
                    problem = (f"grammar: the worker could not prepare this request's grammar within "
                               f"{prepare_timeout:g} s (--grammar-prepare-timeout)")
                    log.error("grammar preparation past its budget; failing the sequence", seq_id=c.seq_id,
                              budget_s=prepare_timeout)
                    seq.finished = True
                    seq.matcher.cancel()
                    out.events.append(TokenEvent(c.seq_id, seq.num_outputs, [], "error", None, problem,
                                                 ERROR_GRAMMAR))
                    continue
                if c.seq_id not in started or c.start_pos != seq.num_computed:
                    out.deferred[c.seq_id] = seq.num_computed
                    continue
                # started by this plan: it runs, its build overlapping the forward pass (the runner defers it
                # if the build is still going after that)
            if (c.num_draft or c.slack) and c.start_pos - c.slack <= seq.num_computed <= c.start_pos:
                # a decode with drafts in flight or its own: earlier steps may have kept fewer drafts than the
                # plan allowed for, so it runs from where this sequence is (its blocks cover the highest start)
                c, room = self._verify_chunk(c, seq)
                if room > 0:
                    out.wants[c.seq_id] = (seq.token_ids, room, c.block_table)
            if c.start_pos != seq.num_computed:
                # a plan before this one never reached us (lost from its stream): this chunk's context is
                # missing from the cache. Run nothing for it; the scheduler sees no sample and recomputes it.
                log.warning("chunk after a missing one; skipped", seq_id=c.seq_id, start_pos=c.start_pos,
                            computed=seq.num_computed, step_id=plan.step_id)
                continue
            problem = self._check_chunk(c, seq)
            if problem:
                log.error("bad chunk", seq_id=c.seq_id, error=problem)
                seq.finished = True
                out.events.append(TokenEvent(c.seq_id, seq.num_outputs, [], "error", None, problem))
                continue
            if seq.unchecked_cached and not self._holds_prefix(c.block_table, seq.unchecked_cached):
                # a prefix cached in this worker's previous life (the scheduler has not seen it restart):
                # compute nothing over it; no token comes, and the scheduler recomputes the sequence
                log.warning("told of a cached prefix this worker never computed; skipped", seq_id=c.seq_id,
                            num_cached=seq.unchecked_cached, step_id=plan.step_id)
                seq.finished = True
                continue
            seq.unchecked_cached = 0
            out.chunks.append(c)
            seq.num_computed = c.start_pos + c.num_tokens  # a verification's is set by what it keeps
        return out

    def _verify_chunk(self, c: ScheduledChunk, seq: SequenceState) -> tuple[ScheduledChunk, int]:
        """A speculative decode as run: a decode from the sequence's own position, and the most drafts it may
        verify (the plan's num_draft, and none past its blocks, max_model_len or max_tokens)."""
        start = seq.num_computed
        if start != len(seq.token_ids) - 1 or not self.speculating:
            return ScheduledChunk(c.seq_id, start, 1, c.block_table), 0
        room = min(c.num_draft, len(c.block_table) * self.block_size - start - 1,
                   self.max_model_len - start - 1, seq.params.max_tokens - seq.num_outputs - 1)
        return ScheduledChunk(c.seq_id, start, 1, c.block_table), room


def _samples(c: ScheduledChunk, seq: SequenceState) -> bool:
    """The chunk samples a token (the last of a prefill, a decode, or a verification), so it needs the
    sequence's matcher; a chunk past the tokens known counts too (it follows a chunk that sat out)."""
    return bool(c.num_draft or c.slack) or c.start_pos + c.num_tokens >= len(seq.token_ids)
