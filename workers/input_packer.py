"""Packing a step's chunks into the model's inputs: token ids, positions, KV slots, the attention calls'
block tables and lengths, the sampled rows and the LoRA rows, all in one unpadded batch (decodes first).
Block ids come from the plan; nothing here allocates any."""

from __future__ import annotations

import itertools

import torch

from phaseserve.wire import ScheduledChunk
from phaseserve.workers.lora import LoadedAdapters, LoraStep
from phaseserve.workers.model import AttentionGroup, StepInputs
from phaseserve.workers.sequence_state import SequenceState

# A decode bucket never splits below this many blocks: one more attention call per layer costs more
# than padding short sequences to a common length.
MIN_BUCKET_BLOCKS = 16


def decode_buckets(lengths: list[int], block_size: int) -> list[tuple[int, int]]:
    """Ranges [a, b) of decodes, sorted by context length, that the CPU path attends in one batched call.
    That call pads every row to the bucket's longest context, so a bucket stops before a sequence that
    needs more than twice the blocks of the bucket's shortest (and MIN_BUCKET_BLOCKS): one long sequence
    among many short ones is then attended alone instead of making every row read its length."""
    buckets: list[tuple[int, int]] = []
    start = 0
    for i, n in enumerate(lengths):
        if i > start:
            first = -(-lengths[start] // block_size)
            if -(-n // block_size) > max(2 * first, MIN_BUCKET_BLOCKS):
                buckets.append((start, i))
                start = i
    if lengths:
        buckets.append((start, len(lengths)))
    return buckets


class InputPacker:
    """Builds StepInputs from chunks of the sequences in `seqs` (the runner's table, read when packing).

    `split_decodes`: decodes get attention calls of their own (the CPU: its prefill path loops over
    sequences); else one call takes the whole packed batch (a GPU kernel). `bucket_decodes`: those calls
    group decodes of similar lengths (decode_buckets), for a decode path that pads every row to the call's
    longest context; a kernel reading each sequence's own length takes them all in one."""

    def __init__(self, seqs: dict[str, SequenceState], loras: LoadedAdapters, *, block_size: int,
                 device: torch.device, dtype: torch.dtype, split_decodes: bool, bucket_decodes: bool):
        self.seqs = seqs
        self.loras = loras
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.split_decodes = split_decodes
        self.bucket_decodes = bucket_decodes

    def pack(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]] | None = None
             ) -> tuple[StepInputs, list[ScheduledChunk]]:
        """The chunks (decodes first) as the step's tensors, built once for all layers (int32 where the
        kernels read int32, so no layer converts anything), and the chunks in their packed order. Plain
        Python lists and one torch.tensor per input: between two forward passes the caches are cold, and
        there this beats the same arithmetic in numpy or in torch ops (docs/decisions.md)."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        if self.bucket_decodes:
            decodes.sort(key=lambda c: c.start_pos)  # shortest first, for the length buckets below
        ordered = decodes + prefills
        bs = self.block_size
        seqs = self.seqs
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        lora_rows: dict[str, list[int]] = {}  # adapter key -> its packed rows
        for c in ordered:
            seq = seqs[c.seq_id]
            tokens = seq.token_ids
            first_row = len(ids)
            start = c.start_pos
            end = start + c.num_tokens
            d = drafts.get(c.seq_id) if drafts else None
            if d:  # a verification: the last token, then the drafts; every row is sampled
                ids.append(tokens[start])
                ids += d
            else:
                ids += tokens[start:end]
            table = c.block_table
            if end - start == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                for b in range(start // bs, (end - 1) // bs + 1):  # the chunk's slots, block by block
                    first = table[b] * bs
                    slots += range(first + max(start - b * bs, 0), first + min(end - b * bs, bs))
            if d:
                sample_rows += range(len(ids) - len(d) - 1, len(ids))
            elif end == len(tokens):
                sample_rows.append(len(ids) - 1)
            if seq.lora is not None:
                lora_rows.setdefault(seq.lora.key, []).extend(range(first_row, len(ids)))
        nd = len(decodes)
        if self.split_decodes:
            if self.bucket_decodes:
                groups = [self._group(decodes[a:b], a)
                          for a, b in decode_buckets([c.start_pos + 1 for c in decodes], bs)]
            else:
                groups = [self._group(decodes, 0)] if decodes else []
            if prefills:
                groups.append(self._group(prefills, nd))
        else:
            groups = [self._group(ordered, 0)]
        d = self.device
        inp = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=d),
            positions=torch.tensor(positions, dtype=torch.int64, device=d),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=d),
            groups=groups,
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=d),
            lora=self._lora_step(lora_rows) if lora_rows else None,
        )
        return inp, ordered

    def _group(self, chunks: list[ScheduledChunk], token_start: int) -> AttentionGroup:
        """One attention call's metadata. Block tables are cut to the blocks the longest sequence uses now:
        the CPU decode path gathers every column, so spare reserved blocks would cost reads and FLOPs."""
        counts = [c.num_tokens for c in chunks]
        ends = [c.start_pos + c.num_tokens for c in chunks]
        width = -(-max(ends) // self.block_size)
        tables = [(list(c.block_table[:width]) + [0] * width)[:width] for c in chunks]
        qsl = [0, *itertools.accumulate(counts)]
        d = self.device
        return AttentionGroup(token_start, token_start + qsl[-1], torch.tensor(tables, dtype=torch.int32, device=d),
                              torch.tensor(ends, dtype=torch.int32, device=d),
                              torch.tensor(qsl, dtype=torch.int32, device=d), max(counts))

    def _lora_step(self, lora_rows: dict[str, list[int]]) -> LoraStep:
        """The step's LoRA rows by adapter (each loaded by the chunk checks of this step)."""
        held = self.loras.held
        return LoraStep([(held(key), rows) for key, rows in lora_rows.items()], self.device,
                        self.loras.columns, self.dtype)
