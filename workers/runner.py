"""The model runner: executes one StepPlan as one forward pass and samples.

It owns the model, the paged KV cache and the per-sequence token state, and composes the parts that do
the rest: the plan's checks (workers/plan_checks.py), packing the chunks into one unpadded batch
(workers/input_packer.py), grammar masks (workers/grammar_masks.py), drafts (workers/ngram_drafts.py,
workers/draft_model.py) and turning draws into tokens (workers/token_acceptance.py). Block ids come from
the plan; the runner never allocates any.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import structlog
import torch

from phaseserve import kernels
from phaseserve.lora import DEFAULT_MAX_LORA_RANK
from phaseserve.params import SamplingParams
from phaseserve.speculative_config import SpeculativeConfig, parse_speculative_config
from phaseserve.step_shape import step_shape
from phaseserve.wire import ERROR_GRAMMAR, ScheduledChunk, SeqStart, StepPlan, StepResult, TokenEvent
from phaseserve.workers.attention_horizon import attention_horizon
from phaseserve.workers.grammar_masks import DEFAULT_GRAMMAR_PREPARE_TIMEOUT_S, GrammarMasks
from phaseserve.workers.input_packer import InputPacker
from phaseserve.workers.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from phaseserve.workers.lora import LoadedAdapters
from phaseserve.workers.model_build import build_model, kernel_implementations
from phaseserve.workers.ngram_drafts import NgramDrafts
from phaseserve.workers.plan_checks import PlanChecks
from phaseserve.workers.sampler import SampleRow, Sampler
from phaseserve.workers.sequence_state import SequenceState
from phaseserve.workers.token_acceptance import accept_draws

log = structlog.get_logger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20


class ModelRunner:
    def __init__(
        self, model_dir: str | Path, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None, max_model_len: int | None = None, seed: int | None = None,
        num_threads: int | None = None, quantization: str = "auto", activation_quant: str = "auto",
        speculative: SpeculativeConfig | dict | str | None = None, max_loras: int = 8,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        grammar_prepare_timeout: float = DEFAULT_GRAMMAR_PREPARE_TIMEOUT_S,
    ):
        if num_threads:
            # process-wide; on a CPU shared with other busy processes, fewer threads than cores
            # avoids OpenMP barrier stalls that otherwise dominate small ops
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        built = build_model(model_dir, self.device, dtype=dtype, max_model_len=max_model_len,
                            quantization=quantization, activation_quant=activation_quant)
        cfg = self.config = built.config
        self.model, self.dtype, self.max_model_len = built.model, built.dtype, built.max_model_len
        self.model_name, self.vocab_size, self.eos_token_ids = cfg.name, cfg.vocab_size, cfg.eos_token_ids
        if num_blocks is None and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = DEFAULT_KV_CACHE_BYTES
        spec = self.speculative = parse_speculative_config(speculative)  # also a dict or vLLM's JSON
        if spec is not None and spec.method == "draft_model" and num_blocks is None:
            kv_cache_memory_bytes //= 2  # the draft model's cache has as many blocks (workers/draft_model.py)
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size,
                          num_blocks=num_blocks, memory_bytes=kv_cache_memory_bytes, dtype=self.dtype,
                          device=self.device)
        self.num_blocks = self.kv.num_blocks
        self.block_size = block_size
        self.sampler = Sampler(cfg.vocab_size, seed)
        self.proposer = self._proposer(spec)
        self.seqs: dict[str, SequenceState] = {}
        # LoRA adapters, loaded from their folders when a sequence first needs them (docs/lora.md)
        self.loras = LoadedAdapters(cfg, max_loras, max_lora_rank, self.device, self.dtype)
        self.grammar = GrammarMasks(model_dir, self.vocab_size, self.eos_token_ids, grammar_prepare_timeout)
        self.checks = PlanChecks(vocab_size=self.vocab_size, block_size=block_size, num_blocks=self.num_blocks,
                                 max_model_len=self.max_model_len, loras=self.loras,
                                 speculating=self.proposer is not None)
        # CPU attends decodes in their own call; the torch decode path pads rows to the call's longest
        # context, so it gets decodes bucketed by length, while the native one reads each row's own length
        split = self.device.type == "cpu"
        self.packer = InputPacker(self.seqs, self.loras, block_size=block_size, device=self.device,
                                  dtype=self.dtype, split_decodes=split,
                                  bucket_decodes=split and not kernels.decode_reads_own_lengths(
                                      self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        log.info("model runner ready", model=self.model_name, dtype=str(self.dtype), num_blocks=self.num_blocks,
                 block_size=block_size, max_model_len=self.max_model_len)

    def _proposer(self, spec: SpeculativeConfig | None):
        """The drafts' source for speculative decoding, or None."""
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramDrafts(spec.prompt_lookup_min, spec.prompt_lookup_max)
        from phaseserve.workers.draft_model import DraftModelDrafts

        # the draft is a runner of its own (its model, its KV cache) with the target's block ids: the
        # scheduler's accounting covers both caches
        draft = ModelRunner(spec.model, dtype=self.dtype, device=str(self.device), block_size=self.block_size,
                            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                            quantization=spec.quantization)
        return DraftModelDrafts(draft, self)

    @property
    def attention_horizon(self) -> int:
        """The scheduler's attention horizon for this model (published in WorkerInfo)."""
        return attention_horizon(self.config)

    def warm_up(self) -> dict[str, str]:
        """Run one tiny prefill chunk and one decode of a scratch sequence in block 0, then forget it: every
        kernel the model's steps use is compiled or loaded now (kernels loads a native op on its first call),
        not inside the first step a scheduler plans, and the background builds of the other native ops this
        CPU runs have finished (no compiler competes with the first steps). Call it before the worker announces
        itself: nothing else holds blocks yet (it writes the first one or two). Also starts building the grammar
        engine's index of the vocabulary, so the first constrained request does not wait for it. Returns
        kernel_implementations()."""
        seq = "warm-up"
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompt = [0, min(1, self.vocab_size - 1)]
        blocks = list(range(-(-(len(prompt) + 1) // self.block_size)))
        self.execute(StepPlan(0, "warm-up", starts=[SeqStart(seq, "", prompt, params)],
                              chunks=[ScheduledChunk(seq, 0, len(prompt), blocks)]))
        self.execute(StepPlan(0, "warm-up", chunks=[ScheduledChunk(seq, len(prompt), 1, blocks)]))
        kernels.native.finish_prebuilds()
        self.reset()
        self.checks.forget_written()  # scratch: no prefix of anyone's
        if self.proposer is not None:
            self.proposer.warm_up()
        self.grammar.warm_up()
        return self.kernel_implementations()

    def kernel_implementations(self) -> dict[str, str]:
        """Which implementation runs each op family this model uses (workers/model_build.py)."""
        return kernel_implementations(self.model, self.device, self.dtype)

    def mark_written(self, block_ids) -> None:
        """Blocks whose KV this process wrote (a chunk) or received (a KV transfer)."""
        self.checks.mark_written(block_ids)

    def reset(self) -> None:
        """Forget every sequence (a new scheduler or adoption owns this worker's blocks now)."""
        for seq in self.seqs.values():
            if seq.matcher is not None:
                seq.matcher.cancel()
        self.seqs.clear()
        if self.proposer is not None:
            self.proposer.reset()

    def take_grammar_masks(self) -> list[float]:
        """StepResult.grammar_masks of the masks computed since the last call ([] when none)."""
        return self.grammar.take()

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.reset:
            self.reset()
        for seq_id in plan.releases:
            gone = self.seqs.pop(seq_id, None)
            if gone is not None and gone.matcher is not None:
                gone.matcher.cancel()
            if self.proposer is not None:
                self.proposer.forget(seq_id)
        events = [e for s in plan.starts if (e := self._start(s)) is not None]
        admitted = self.checks.admit(plan, self.seqs, self.grammar.prepare_timeout)
        events += admitted.events
        chunks, deferred = admitted.chunks, admitted.deferred
        drafts = self._propose(admitted.wants, chunks)
        bs = self.block_size
        for c in chunks:  # with their drafts
            self.checks.mark_written(c.block_table[c.start_pos // bs:(c.start_pos + c.num_tokens - 1) // bs + 1])
        if chunks:
            events.extend(self._run(chunks, drafts, deferred))
        self.loras.evict_beyond_limit({seq.lora.key for c in chunks if (seq := self.seqs[c.seq_id]).lora})
        num_tokens = sum(c.num_tokens for c in chunks)
        # a speculating worker reports every step's shape: the scheduler learns a verification's extra cost
        # against the steps without one
        ran = list(step_shape(chunks, drafts)) if self.proposer is not None else []
        return StepResult(plan.step_id, plan.worker_id, events, num_tokens, time.perf_counter() - t0, ran=ran,
                          drafted={seq_id: len(d) for seq_id, d in drafts.items()},
                          grammar_masks=self.take_grammar_masks(), deferred=deferred)

    def _start(self, s: SeqStart) -> TokenEvent | None:
        """Open a plan's sequence; the error event of one that cannot run (it fails alone: its chunks are
        skipped, the batch runs)."""
        if self.proposer is not None:
            self.proposer.forget(s.seq_id)
        matcher = self.grammar.prepare(s.grammar, s.output_ids) if s.grammar else None
        seq = self.seqs[s.seq_id] = SequenceState.started(s, self.eos_token_ids, self.vocab_size, matcher)
        problem = self.checks.check_start(s)
        if not problem:
            return None
        log.error("bad sequence", seq_id=s.seq_id, error=problem)
        seq.finished = True
        return TokenEvent(s.seq_id, len(s.output_ids), [], "error", None, problem)

    def _propose(self, wants: dict[str, tuple[list[int], int, list[int]]],
                 chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        """The drafts of the step's speculative decodes (all proposed at once: a draft model batches them),
        each decode's chunk grown by its drafts."""
        if not wants:
            return {}
        drafts = self.proposer.propose(wants)
        for seq_id, d in list(drafts.items()):
            self.grammar.cut_to_grammar(self.seqs[seq_id], d)
            if not d:
                del drafts[seq_id]
                self.proposer.kept(seq_id, len(self.seqs[seq_id].token_ids), 0)
        for i, c in enumerate(chunks):
            d = drafts.get(c.seq_id)
            if d:
                chunks[i] = ScheduledChunk(c.seq_id, c.start_pos, 1 + len(d), c.block_table)
        return drafts

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]],
             deferred: dict[str, int]) -> list[TokenEvent]:
        """The step's forward pass and samples. A sequence whose matcher is still being built after the forward
        pass goes into `deferred`, held at its chunk's start (the KV written for it is written again then)."""
        inp, ordered = self.packer.pack(chunks, drafts)
        seqs = self.seqs
        # (sequence, its drafts) of every chunk that samples: one row for its next token, one more per draft
        sampling = [(seqs[c.seq_id], drafts.get(c.seq_id, [])) for c in ordered
                    if c.seq_id in drafts or c.start_pos + c.num_tokens == len(seqs[c.seq_id].token_ids)]
        first_row = list(itertools.accumulate((1 + len(d) for _, d in sampling), initial=0))
        constrained = [k for k, (s, _) in enumerate(sampling) if s.matcher is not None]
        # The masks depend only on the tokens so far. They are computed here, before the forward pass, by
        # llguidance's threads without the GIL. Computing them on the grammar thread during the forward pass
        # cost more CPU a step (the two threads hand the GIL to each other), and a worker's core has no idle
        # time for an overlap to fill (docs/decisions.md, "Structured outputs").
        # A matcher still being built (a sequence started by this plan) gets its mask after the forward
        # pass, which its build overlaps; one still not built then sits out (its row is sampled and dropped).
        ready = [k for k in constrained if sampling[k][0].matcher.done()]
        building = [k for k in constrained if k not in ready]
        masks = self.grammar.entry_masks(ready, sampling, first_row)
        logits = self.model.forward(inp, self.kv, fp32=False)  # the sampler upcasts what it needs
        built = [k for k in building if sampling[k][0].matcher.done()]
        masks += self.grammar.entry_masks(built, sampling, first_row)
        unready = set(building) - set(built)
        if unready:
            starts = {c.seq_id: c.start_pos for c in ordered}
            for k in unready:
                seq = sampling[k][0]
                seq.num_computed = deferred[seq.seq_id] = starts[seq.seq_id]
        if not sampling:
            return []
        rows = []
        for s, d in sampling:
            rows.append(SampleRow(s.params, s.num_outputs, s.token_ids, s.prompt_len, s.stop_ids, s.stop_tensor,
                                  s.bias))
            # each draft's position is drawn as decoding would draw it there: its output offset, and the
            # drafts before it counted as outputs (penalties, min_tokens)
            rows += [SampleRow(s.params, s.num_outputs + j, s.token_ids + list(d[:j]), s.prompt_len, s.stop_ids,
                               s.stop_tensor, s.bias) for j in range(1, len(d) + 1)]
        errors: dict[int, str] = {}
        for row_ids, disallowed, entry_errors in masks:
            for j, r in enumerate(row_ids):
                rows[r].disallowed = disallowed[j]
            errors.update((k, e) for k, e in entry_errors.items() if e is not None)
        out = self.sampler(logits, rows)
        events = []
        for k, (seq, d) in enumerate(sampling):
            if k in unready:
                continue
            if k in errors:
                log.error("grammar failed", seq_id=seq.seq_id, error=errors[k])
                seq.finished = True
                events.append(TokenEvent(seq.seq_id, seq.num_outputs, [], "error", None, errors[k], ERROR_GRAMMAR))
                continue
            r = first_row[k]
            event, n = accept_draws(seq, list(d), out.token_ids[r:r + len(d) + 1], out.logprobs[r:r + len(d) + 1],
                                    self.eos_token_ids, self.max_model_len)
            if d:
                self.proposer.kept(seq.seq_id, len(seq.token_ids) - n, n - 1)
            events.append(event)
        return events
