"""A minimal hand-written planner for runner tests: builds StepPlans directly, no scheduler.

Every step gives each live sequence its next chunk (up to `chunk_size` known tokens
not yet computed), so decodes and prefill chunks share steps; one that sat out (its
grammar not ready: StepResult.deferred) gets it again. Blocks come from a
bump allocator that reserves each sequence's worst case up front.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner


@dataclass
class DrivenSeq:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


def run(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        chunk_size: int = 64, output_ids: list[list[int]] | None = None, max_steps: int = 10_000,
        grammars: list | None = None) -> list[DrivenSeq]:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    bs = runner.block_size
    next_block = 0
    seqs = []
    starts = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        prior = list(output_ids[i]) if output_ids else []
        s = DrivenSeq(f"s{i}", list(p), sp, outputs=prior)
        need = -(-(len(p) + len(prior) + sp.max_tokens) // bs)
        s.blocks = list(range(next_block, next_block + need))
        next_block += need
        assert next_block <= runner.num_blocks, "test needs a bigger KV cache"
        seqs.append(s)
        starts.append(SeqStart(s.seq_id, "gw", s.prompt, sp, prior, grammar=grammars[i] if grammars else None))
    releases: list[str] = []
    for step in range(max_steps):
        live = [s for s in seqs if s.finish_reason is None]
        if not live:
            return seqs
        chunks = []
        for s in live:
            known = len(s.prompt) + len(s.outputs)
            n = min(chunk_size, known - s.computed)
            end = s.computed + n
            chunks.append(ScheduledChunk(s.seq_id, s.computed, n, s.blocks[:-(-end // bs)]))
        result = runner.execute(StepPlan(step, "w", starts, chunks, releases))
        starts, releases = [], []
        for c in chunks:  # a chunk that sat out (its grammar still being prepared) is planned again
            s = next(s for s in seqs if s.seq_id == c.seq_id)
            s.computed = result.deferred.get(c.seq_id, s.computed + c.num_tokens)
        if len(result.deferred) == len(chunks):
            time.sleep(0.002)  # nothing ran: every sequence waits for its grammar
        by_id = {s.seq_id: s for s in seqs}
        for ev in result.events:
            s = by_id[ev.seq_id]
            assert ev.offset == len(s.outputs), (ev.offset, len(s.outputs))
            s.outputs.extend(ev.token_ids)
            s.offsets.append(ev.offset)
            if ev.logprobs:
                s.logprobs.extend(ev.logprobs)
            if ev.finish_reason:
                s.finish_reason = ev.finish_reason
                releases.append(s.seq_id)
    raise AssertionError("sequences did not finish")
