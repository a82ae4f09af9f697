"""Drafts from a second, smaller model on the worker (speculative method "draft_model"): greedy, so each
draft is a deterministic function of the sequence's tokens and the target's verification stays exact
(workers/token_acceptance.py).

The draft model has a KV cache of its own with the target's block count and size, indexed by the same block
ids: a block the scheduler gives a sequence holds its positions in both caches, so the scheduler's accounting
covers the draft's KV too (the worker's KV memory is shared between the two caches). A sequence's draft KV is
kept per position like the target's: after a verification, the positions of kept drafts stay valid, and the
next proposal first runs the draft model over the tokens it has not seen (the prompt, the first time; then the
last token or two), then one pass a draft, every verifying sequence of the step batched in each pass.
"""

from __future__ import annotations

from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan


class DraftModelDrafts:
    def __init__(self, runner, target):
        self.runner = runner  # a ModelRunner with the target's block count and size
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.runner.vocab_size}) is not the target's "
                             f"({target.vocab_size}): it must share the target's tokenizer")
        self._params = SamplingParams(temperature=0.0, max_tokens=target.max_model_len, ignore_eos=True)
        self._valid: dict[str, int] = {}  # seq id -> positions whose draft KV matches the sequence's tokens
        self._step = 0

    def _execute(self, chunks: list[ScheduledChunk], starts: list[SeqStart] | None = None) -> dict[str, int]:
        self._step += 1
        result = self.runner.execute(StepPlan(self._step, "draft", starts or [], chunks))
        return {e.seq_id: e.token_ids[0] for e in result.events if e.token_ids}

    def propose(self, wants: dict[str, tuple[list[int], int, list[int]]]) -> dict[str, list[int]]:
        seqs = self.runner.seqs
        starts, first = [], []
        for seq_id, (tokens, room, table) in wants.items():
            if room <= 0:
                continue
            if seq_id not in seqs:
                starts.append(SeqStart(seq_id, "", list(tokens), self._params))
                self._valid[seq_id] = 0
            first.append(ScheduledChunk(seq_id, 0, 0, table))
        if not first:
            return {}
        drafts: dict[str, list[int]] = {c.seq_id: [] for c in first}
        chunks = []
        for c in first:
            tokens, _, table = wants[c.seq_id]
            valid = self._valid[c.seq_id]
            if starts and any(s.seq_id == c.seq_id for s in starts):
                pass  # its state is made by the SeqStart below, from `tokens`
            else:
                state = seqs[c.seq_id]
                state.token_ids = list(tokens)  # the target's: rejected drafts are gone
                state.prompt_len = len(tokens)
                state.num_computed = valid
                state.finished = False
            chunks.append(ScheduledChunk(c.seq_id, valid, len(tokens) - valid, table))
        got = self._execute(chunks, starts)
        for seq_id, tok in got.items():
            drafts[seq_id].append(tok)
        depth = 1
        while True:  # one batched pass a draft, for the sequences whose room allows another
            chunks = [ScheduledChunk(s, len(wants[s][0]) + depth - 1, 1, wants[s][2]) for s, d in drafts.items()
                      if len(d) == depth and wants[s][1] > depth]
            if not chunks:
                break
            for seq_id, tok in self._execute(chunks).items():
                drafts[seq_id].append(tok)
            depth += 1
        for seq_id, d in drafts.items():
            self._valid[seq_id] = len(wants[seq_id][0]) + len(d) - 1
        return {s: d for s, d in drafts.items() if d}

    def kept(self, seq_id: str, num_before: int, accepted: int) -> None:
        if seq_id in self._valid:
            self._valid[seq_id] = min(self._valid[seq_id], num_before + accepted)

    def forget(self, seq_id: str) -> None:
        self._valid.pop(seq_id, None)
        self.runner.seqs.pop(seq_id, None)

    def warm_up(self) -> None:
        """Its kernels loaded now, with the target's, not inside a planned step."""
        self.runner.warm_up()

    def reset(self) -> None:
        self._valid.clear()
        self.runner.reset()
