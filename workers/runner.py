"""The model runner: executes one StepPlan as one forward pass and samples.

It owns the model, the paged KV cache and the per-sequence token state. All
chunks of a plan (decodes and prefill chunks) are packed into one unpadded
batch. Block ids come from the plan; the runner never allocates any.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

import kernels
from phaseserve import grammar
from phaseserve.lora import DEFAULT_MAX_LORA_RANK, LoraError
from phaseserve.params import SamplingParams, finish_reason
from phaseserve.speculative_config import SpeculativeConfig, parse_speculative_config
from phaseserve.wire import ERROR_GRAMMAR, LoraRef, ScheduledChunk, SeqStart, StepPlan, StepResult, TokenEvent
from workers.cpu_memory import keep_heap_memory, release_free_heap
from workers.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from workers.linear import QuantizedLinear
from workers.loader import ModelConfig, load_checkpoint, read_config, resolve_dtype
from workers.lora import LoadedAdapters, LoraStep
from workers.model import AttentionGroup, LlamaFamilyModel, StepInputs
from workers.preparation import Preparation
from workers.sampler import SampleRow, Sampler, logit_bias_tensors, stop_id_tensor
from workers.speculation import NgramDrafts, accepted_run

log = structlog.get_logger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20
DEFAULT_GRAMMAR_PREPARE_TIMEOUT_S = 10.0  # the worker's --grammar-prepare-timeout
# threads building matchers: one request's long build does not hold every other constrained request's
GRAMMAR_THREADS = 2

# Attention runs at about this fraction of the linear layers' FLOP rate (small per-head matmuls, softmax,
# gathering paged K/V). Fitted on how the bundled model's chunk steps grew across a long prompt
# (bench/results/2026-11-22-step-budget.md); a low K only makes late chunks smaller, so the constant errs
# that way.
ATTENTION_EFFICIENCY = 0.32


def attention_horizon(cfg: ModelConfig) -> int:
    """K: the context length at which a token's attention costs as much as its linear layers
    (the scheduler's cost model, see scheduler/budget.py). Counts matmul weights only: biases, norms,
    the embedding and the lm_head (run on sampled rows only) are small or not per token."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h  # qkv, o, gate_up, down
    linear_flops = 2 * per_layer * cfg.num_layers
    # per context token and layer, each head does q.k and p.v: 2 dot products of head_dim, 2 FLOPs a term
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return max(1, round(ATTENTION_EFFICIENCY * linear_flops / attention_flops))


# A decode bucket never splits below this many blocks: one more attention call per layer costs more
# than padding short sequences to a common length.
MIN_BUCKET_BLOCKS = 16


def decode_buckets(lengths: list[int], block_size: int) -> list[tuple[int, int]]:
    """Ranges [a, b) of decodes, sorted by context length, that the CPU path attends in one batched call.
    That call pads every row to the bucket's longest context, so a bucket stops before a sequence that
    needs more than twice the blocks of the bucket's shortest (and MIN_BUCKET_BLOCKS): one 2,000-token
    sequence among sixteen 200-token ones is then attended alone instead of making all 17 rows read
    2,000 positions."""
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


@dataclass
class SequenceState:
    seq_id: str
    gateway_id: str
    params: SamplingParams
    prompt_len: int
    token_ids: list[int]  # prompt + outputs
    finished: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    stop_tensor: torch.Tensor | None = None  # stop_ids for the sampler's min_tokens mask, built once
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # params.logit_bias for the sampler, built once
    # positions whose KV this worker wrote: a chunk must start here, else a plan between was lost
    num_computed: int = 0
    cached_tokens: int = 0  # prompt positions the scheduler's prefix cache had: told with the first token
    # positions its first chunk reads from cached blocks, checked against the blocks written in this process
    unchecked_cached: int = 0
    # a constrained sequence's matcher, built on a grammar thread (its result a GrammarMatcher once done)
    matcher: Preparation | None = None
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len


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
        if self.device.type == "cpu":
            keep_heap_memory()  # no page faults on every layer's activations
        dtype = resolve_dtype(dtype, read_config(model_dir), self.device)
        if self.device.type == "cpu":  # compiled side by side while the weights load (a first start only)
            kernels.native.prebuild(kernels.native.runnable(dtype))
        # a GGUF's Q8_0/Q4_0/Q4_1 blocks stay as stored unless every weight is wanted dense
        cfg, weights, self.dtype = load_checkpoint(model_dir, dtype, self.device,
                                                   keep_quantized=quantization != "none")
        self.config = cfg
        self.model_name = cfg.name
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:  # no sliding-window attention here: stay where full attention is exact
            limit = min(limit, cfg.sliding_window)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds what the model supports ({limit})")
        self.max_model_len = max_model_len or limit
        self.model = LlamaFamilyModel(cfg, weights, self.max_model_len, self.device, quantization=quantization,
                                      dtype=self.dtype, activation_quant=activation_quant)
        del weights
        if self.device.type == "cpu":
            release_free_heap()  # float weights converted at load (quantized) are gone: return their memory
        if num_blocks is None and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = DEFAULT_KV_CACHE_BYTES
        spec = parse_speculative_config(speculative)  # also a dict or vLLM's JSON
        if spec is not None and spec.method == "draft_model" and num_blocks is None:
            kv_cache_memory_bytes //= 2  # the draft model's cache has as many blocks (workers/draft_model.py)
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size,
                          num_blocks=num_blocks, memory_bytes=kv_cache_memory_bytes, dtype=self.dtype,
                          device=self.device)
        self.num_blocks = self.kv.num_blocks
        self.block_size = block_size
        self.sampler = Sampler(cfg.vocab_size, seed)
        self.speculative = spec
        self.proposer = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramDrafts(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec is not None:
            from workers.draft_model import DraftModelDrafts

            # the draft is a runner of its own (its model, its KV cache) with the target's block ids: the
            # scheduler's accounting covers both caches
            draft = ModelRunner(spec.model, dtype=self.dtype, device=str(self.device), block_size=block_size,
                                num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                                quantization=spec.quantization)
            self.proposer = DraftModelDrafts(draft, self)
        self.seqs: dict[str, SequenceState] = {}
        # LoRA adapters, loaded from their folders when a sequence first needs them (docs/lora.md)
        self.loras = LoadedAdapters(cfg, max_loras, max_lora_rank, self.device, self.dtype)
        # grammar matchers are built on these threads (a large grammar, or a recomputed sequence's rebuild over
        # many outputs, takes a while), beside the steps, which never wait for one (workers/preparation.py)
        self._tokenizer_json = os.path.join(str(model_dir), "tokenizer.json")
        self._grammar_threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        self.grammar_prepare_timeout = grammar_prepare_timeout
        # computes half of a step's masks beside the model thread when torch runs on more than one core
        self._mask_helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") \
            if torch.get_num_threads() > 1 else None
        self.grammar_masks = grammar.MaskHistogram()  # since the last step result
        # blocks this process wrote (or received): a cached prefix may be read only from those. A scheduler that
        # has not yet seen this worker restart may still name blocks its previous life computed.
        self.written_blocks = bytearray(self.num_blocks)
        # CPU attends decodes in their own call (its prefill path loops over sequences); a GPU kernel takes the
        # whole packed batch at once. The torch decode path pads every row to the call's longest context, so it
        # gets decodes in calls of similar lengths (decode_buckets); a kernel reading each sequence's own
        # length (the native one) takes them all in one.
        self._split_decodes = self.device.type == "cpu"
        self._bucket_decodes = self._split_decodes and not kernels.decode_reads_own_lengths(
            self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        log.info("model runner ready", model=self.model_name, dtype=str(self.dtype), num_blocks=self.num_blocks,
                 block_size=block_size, max_model_len=self.max_model_len)

    @property
    def attention_horizon(self) -> int:
        """The scheduler's attention horizon for this model (published in WorkerInfo)."""
        return attention_horizon(self.config)

    def warm_up(self) -> dict[str, str]:
        """Run one tiny prefill chunk and one decode of a scratch sequence in block 0, then forget it: every
        kernel the model's steps use is compiled or loaded now (kernels loads a native op on its first call),
        not inside the first step a scheduler plans. Call it before the worker announces itself: nothing else
        holds blocks yet (it writes the first one or two). Also starts building the grammar engine's index of
        the vocabulary, so the first constrained request does not wait for it. Returns kernel_implementations()."""
        seq = "warm-up"
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompt = [0, min(1, self.vocab_size - 1)]
        blocks = list(range(-(-(len(prompt) + 1) // self.block_size)))
        self.execute(StepPlan(0, "warm-up", starts=[SeqStart(seq, "", prompt, params)],
                              chunks=[ScheduledChunk(seq, 0, len(prompt), blocks)]))
        self.execute(StepPlan(0, "warm-up", chunks=[ScheduledChunk(seq, len(prompt), 1, blocks)]))
        self.reset()
        self.written_blocks[:] = bytes(self.num_blocks)  # scratch: no prefix of anyone's
        if self.proposer is not None:
            self.proposer.warm_up()
        if os.path.isfile(self._tokenizer_json):
            self._grammar_threads.submit(self._engine_tokenizer)
        return self.kernel_implementations()

    def kernel_implementations(self) -> dict[str, str]:
        """Which implementation runs each op family this model uses (attention, layer_ops, and linear and
        quant_linear where it has linears of that kind): triton on CUDA; on CPU what kernels chose so far
        (see warm_up); quant_linear's ends in ", int8 activations" where --activation-quant int8 is in effect."""
        m = self.model
        linears = [m.lm_head] + [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        quantized = sum(isinstance(lin, QuantizedLinear) for lin in linears)
        used = {"attention": True, "layer_ops": True, "linear": quantized < len(linears), "quant_linear": quantized > 0}
        families = [f for f in kernels.native.FAMILIES if used[f]]
        if self.device.type == "cuda":
            return {f: "triton" for f in families}
        found = kernels.native.implementations(families, self.dtype)
        if quantized and self.model.activation_quant == "int8":  # --activation-quant int8 in effect
            found["quant_linear"] += ", int8 activations"
        return found

    # ------------------------------------------------------------------ state

    def _start(self, s) -> None:
        params = s.params
        tokens = list(s.prompt_ids) + list(s.output_ids)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self.seqs[s.seq_id] = SequenceState(
            s.seq_id, s.gateway_id, params, len(s.prompt_ids), tokens, stop_ids=stop_ids,
            stop_tensor=stop_id_tensor(stop_ids, self.vocab_size) if params.min_tokens else None,
            bias=logit_bias_tensors(params.logit_bias, self.vocab_size) if params.logit_bias else None,
            num_computed=s.num_cached, cached_tokens=s.cached_tokens,
            unchecked_cached=s.num_cached if s.cached_tokens else 0,
            matcher=Preparation(self._grammar_threads,
                                functools.partial(self._matcher, s.grammar, list(s.output_ids)),
                                self.grammar_prepare_timeout) if s.grammar else None,
            lora=s.lora,
        )

    def _engine_tokenizer(self):
        return grammar.engine_tokenizer(self._tokenizer_json, self.vocab_size, tuple(sorted(self.eos_token_ids)))

    def _matcher(self, spec, output_ids: list[int]) -> grammar.GrammarMatcher:
        """On a grammar thread: the sequence's matcher, advanced over the outputs it already has, and its first
        mask computed once (the engine's costly first look at a grammar happens here, not in a step; a
        grammar it refuses there is an error the step reports)."""
        matcher = grammar.GrammarMatcher(spec, self._engine_tokenizer(), output_ids)
        if matcher.error is None:
            grammar.fill_masks([matcher], grammar.allocate_masks(1, self.vocab_size))
        return matcher

    def _masks(self, futures: list[Preparation]) -> tuple[torch.Tensor, list[str | None]]:
        """The forbidden tokens of each constrained row ([B, vocab] bool), and per row the error of a matcher
        that could not be built or advanced (None: fine). Every preparation given is done."""
        matchers, errors = [], []
        for f in futures:
            try:
                m = f.result()
                errors.append(m.error)
            except Exception as e:  # the gateway checked the grammar: this is a worker-side failure
                m, _ = None, errors.append(f"grammar: {e}")
            matchers.append(m)
        ok = [m for m, e in zip(matchers, errors) if e is None]
        masks = grammar.allocate_masks(len(matchers), self.vocab_size)
        if len(ok) == len(matchers):
            seconds = grammar.fill_masks(ok, masks, self._mask_helper)
        elif ok:  # a failed row keeps everything allowed; it is not sampled from
            rows = torch.tensor([i for i, e in enumerate(errors) if e is None])
            part = masks[rows].contiguous()
            seconds = grammar.fill_masks(ok, part, self._mask_helper)
            masks[rows] = part
        if ok:
            self.grammar_masks.add(seconds / len(ok), len(ok))
        return grammar.disallowed_tokens(masks, self.vocab_size), errors

    def _entry_masks(self, entries: list[int], sampling: list, first_row: list[int]) \
            -> list[tuple[list[int], torch.Tensor, dict[int, str | None]]]:
        """(sample rows, their forbidden tokens, errors by entry) of the constrained `entries` of a step's
        sampling: a plain decode's one row, or a verification's row per position (its drafts are left only to
        a built matcher that allows them, _cut_to_grammar)."""
        plain = [k for k in entries if not sampling[k][1]]
        out = []
        if plain:
            disallowed, errs = self._masks([sampling[k][0].matcher for k in plain])
            out.append(([first_row[k] for k in plain], disallowed, dict(zip(plain, errs))))
        for k in entries:
            seq, d = sampling[k]
            if d:
                t = time.perf_counter()
                masks = grammar.allocate_masks(1 + len(d), self.vocab_size)
                seq.matcher.result().fill_proposal_masks(d, masks)
                self.grammar_masks.add((time.perf_counter() - t) / (1 + len(d)), 1 + len(d))
                out.append((list(range(first_row[k], first_row[k] + 1 + len(d))),
                            grammar.disallowed_tokens(masks, self.vocab_size), {}))
        return out

    # ------------------------------------------------------------------ step

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
        return self.grammar_masks.take()

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
        events: list[TokenEvent] = []
        for s in plan.starts:
            if self.proposer is not None:
                self.proposer.forget(s.seq_id)
            self._start(s)
            problem = self._check_start(s) or self._load_lora(s.lora)
            if problem:  # fails this sequence alone: its chunks are skipped below, the batch runs
                log.error("bad sequence", seq_id=s.seq_id, error=problem)
                self.seqs[s.seq_id].finished = True
                events.append(TokenEvent(s.seq_id, len(s.output_ids), [], "error", None, problem))
        chunks: list[ScheduledChunk] = []
        wants: dict[str, tuple[list[int], int, list[int]]] = {}  # seq id -> (tokens, most drafts, block table)
        deferred: dict[str, int] = {}  # sequences sitting out this step -> the position they are held at
        started = {s.seq_id for s in plan.starts}
        now = time.monotonic()
        for c in plan.chunks:
            seq = self.seqs.get(c.seq_id)
            if seq is None or seq.finished:
                continue  # planned one step ahead of a finish, or already released
            if seq.matcher is not None and not seq.matcher.done() and self._samples(c, seq):
                # its preparation is not ready: the step does not wait for it (workers/preparation.py)
                if seq.matcher.overdue(now):
                    problem = (f"grammar: the worker could not prepare this request's grammar within "
                               f"{self.grammar_prepare_timeout:g} s (--grammar-prepare-timeout)")
                    log.error("grammar preparation past its budget; failing the sequence", seq_id=c.seq_id,
                              budget_s=self.grammar_prepare_timeout)
                    seq.finished = True
                    seq.matcher.cancel()
                    events.append(TokenEvent(c.seq_id, seq.num_outputs, [], "error", None, problem, ERROR_GRAMMAR))
                    continue
                if c.seq_id not in started or c.start_pos != seq.num_computed:
                    deferred[c.seq_id] = seq.num_computed
                    continue
                # started by this plan: it runs, its build overlapping the forward pass (_run defers it if the
                # build is still going after that)
            if (c.num_draft or c.slack) and c.start_pos - c.slack <= seq.num_computed <= c.start_pos:
                # a decode with drafts in flight or its own: earlier steps may have kept fewer drafts than the
                # plan allowed for, so it runs from where this sequence is (its blocks cover the highest start)
                c, room = self._verify_chunk(c, seq)
                if room > 0:
                    wants[c.seq_id] = (seq.token_ids, room, c.block_table)
            if c.start_pos != seq.num_computed:
                # a plan before this one never reached us (lost from its stream): this chunk's context is
                # missing from the cache. Run nothing for it; the scheduler sees no sample and recomputes it.
                log.warning("chunk after a missing one; skipped", seq_id=c.seq_id, start_pos=c.start_pos,
                            computed=seq.num_computed, step_id=plan.step_id)
                continue
            problem = self._check_chunk(c, seq) or self._load_lora(seq.lora)
            if problem:
                log.error("bad chunk", seq_id=c.seq_id, error=problem)
                seq.finished = True
                events.append(TokenEvent(c.seq_id, seq.num_outputs, [], "error", None, problem))
                continue
            if seq.unchecked_cached and not self._holds_prefix(c.block_table, seq.unchecked_cached):
                # a prefix cached in this worker's previous life (the scheduler has not seen it restart):
                # compute nothing over it; no token comes, and the scheduler recomputes the sequence
                log.warning("told of a cached prefix this worker never computed; skipped", seq_id=c.seq_id,
                            num_cached=seq.unchecked_cached, step_id=plan.step_id)
                seq.finished = True
                continue
            seq.unchecked_cached = 0
            chunks.append(c)
            seq.num_computed = c.start_pos + c.num_tokens  # a verification's is set by what it keeps
        drafts = self._propose(wants, chunks)
        for c in chunks:  # with their drafts
            self.mark_written(c.block_table[c.start_pos // self.block_size:
                                            (c.start_pos + c.num_tokens - 1) // self.block_size + 1])
        if chunks:
            events.extend(self._run(chunks, drafts, deferred))
        self.loras.evict_beyond_limit({seq.lora.key for c in chunks if (seq := self.seqs[c.seq_id]).lora})
        num_tokens = sum(c.num_tokens for c in chunks)
        # a speculating worker reports every step's shape: the scheduler learns a verification's extra cost
        # against the steps without one
        ran = step_shape(chunks, drafts) if self.proposer is not None else []
        return StepResult(plan.step_id, plan.worker_id, events, num_tokens, time.perf_counter() - t0, ran=ran,
                          drafted={seq_id: len(d) for seq_id, d in drafts.items()},
                          grammar_masks=self.take_grammar_masks(), deferred=deferred)

    def _samples(self, c: ScheduledChunk, seq: SequenceState) -> bool:
        """The chunk samples a token (the last of a prefill, a decode, or a verification), so it needs the
        sequence's matcher; a chunk past the tokens known counts too (it follows a chunk that sat out)."""
        return bool(c.num_draft or c.slack) or c.start_pos + c.num_tokens >= len(seq.token_ids)

    def _verify_chunk(self, c: ScheduledChunk, seq: SequenceState) -> tuple[ScheduledChunk, int]:
        """A speculative decode as run: a decode from the sequence's own position, and the most drafts it may
        verify (the plan's num_draft, and none past its blocks, max_model_len or max_tokens)."""
        start = seq.num_computed
        if start != len(seq.token_ids) - 1 or self.proposer is None:
            return ScheduledChunk(c.seq_id, start, 1, c.block_table), 0
        room = min(c.num_draft, len(c.block_table) * self.block_size - start - 1,
                   self.max_model_len - start - 1, seq.params.max_tokens - seq.num_outputs - 1)
        return ScheduledChunk(c.seq_id, start, 1, c.block_table), room

    def _propose(self, wants: dict[str, tuple[list[int], int, list[int]]],
                 chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        """The drafts of the step's speculative decodes (all proposed at once: a draft model batches them),
        each decode's chunk grown by its drafts."""
        if not wants:
            return {}
        drafts = self.proposer.propose(wants)
        for seq_id, d in list(drafts.items()):
            self._cut_to_grammar(self.seqs[seq_id], d)
            if not d:
                del drafts[seq_id]
                self.proposer.kept(seq_id, len(self.seqs[seq_id].token_ids), 0)
        for i, c in enumerate(chunks):
            d = drafts.get(c.seq_id)
            if d:
                chunks[i] = ScheduledChunk(c.seq_id, c.start_pos, 1 + len(d), c.block_table)
        return drafts

    @staticmethod
    def _cut_to_grammar(seq: SequenceState, drafts: list[int]) -> None:
        """A constrained sequence verifies only the drafts its grammar allows (none while its matcher is still
        being built), so every position verified has a mask and every token kept is valid."""
        if seq.matcher is None:
            return
        m = seq.matcher.result() if seq.matcher.done() else None
        n = m.accepted_prefix(drafts) if m is not None and m.error is None else 0
        del drafts[n:]

    def mark_written(self, block_ids) -> None:
        """Blocks whose KV this process wrote (a chunk) or received (a KV transfer)."""
        for b in block_ids:
            self.written_blocks[b] = 1

    def _holds_prefix(self, block_table: list[int], num_cached: int) -> bool:
        written = self.written_blocks
        return all(written[b] for b in block_table[:num_cached // self.block_size])

    def _check_start(self, s) -> str | None:
        """A sequence whose token ids the embedding cannot look up would fail the whole batch's forward pass."""
        vocab = self.vocab_size
        bad = [t for t in (*s.prompt_ids, *s.output_ids) if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        return None

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
        return None

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

    def _inputs(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]] | None = None
                ) -> tuple[StepInputs, list[ScheduledChunk]]:
        """Pack the chunks (decodes first) into the step's tensors, built once for all layers (int32 where the
        kernels read int32, so no layer converts anything). Plain Python lists and one torch.tensor per
        input: between two forward passes the caches are cold, and there this costs ~105 us a 16-decode step
        against ~210 for the same arithmetic in numpy and ~265 in torch ops (which are faster warm)."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        if self._bucket_decodes:
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
        if self._split_decodes:
            if self._bucket_decodes:
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

    def _lora_step(self, lora_rows: dict[str, list[int]]) -> LoraStep:
        """The step's LoRA rows by adapter (each loaded by the chunk checks of this step)."""
        held = self.loras.held
        return LoraStep([(held(key), rows) for key, rows in lora_rows.items()], self.device,
                        self.loras.columns, self.dtype)

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]],
             deferred: dict[str, int]) -> list[TokenEvent]:
        """The step's forward pass and samples. A sequence whose matcher is still being built after the forward
        pass goes into `deferred`, held at its chunk's start (the KV written for it is written again then)."""
        inp, ordered = self._inputs(chunks, drafts)
        seqs = self.seqs
        # (sequence, its drafts) of every chunk that samples: one row for its next token, one more per draft
        sampling = [(seqs[c.seq_id], drafts.get(c.seq_id, ())) for c in ordered
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
        masks = self._entry_masks(ready, sampling, first_row)
        logits = self.model.forward(inp, self.kv, fp32=False)  # the sampler upcasts what it needs
        built = [k for k in building if sampling[k][0].matcher.done()]
        masks += self._entry_masks(built, sampling, first_row)
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
            r = first_row[k]
            draws = out.token_ids[r:r + len(d) + 1]
            lps = out.logprobs[r:r + len(d) + 1]
            offset = seq.num_outputs
            if k in unready:
                continue
            if k in errors:
                log.error("grammar failed", seq_id=seq.seq_id, error=errors[k])
                seq.finished = True
                events.append(TokenEvent(seq.seq_id, offset, [], "error", None, errors[k], ERROR_GRAMMAR))
                continue
            kept = draws[:accepted_run(list(d), draws) + 1]
            matcher = seq.matcher.result() if seq.matcher is not None else None
            reason = None
            n = 0
            for tok in kept:  # a stop token, the length limit or a complete document inside an accepted run ends it
                seq.token_ids.append(tok)
                n += 1
                reason = finish_reason(seq.params, tok, seq.num_outputs, len(seq.token_ids), self.eos_token_ids,
                                       self.max_model_len)
                if matcher is not None and reason is None:
                    if not matcher.advance(tok):
                        reason = "error"
                    elif matcher.is_stopped:  # the document is complete: nothing but EOS could follow
                        reason = "stop"
                if reason is not None:
                    seq.finished = True
                    break
            if d:
                self.proposer.kept(seq.seq_id, len(seq.token_ids) - n, n - 1)
                seq.num_computed = len(seq.token_ids) - 1
            if reason == "error":
                events.append(TokenEvent(seq.seq_id, offset, [], "error", None, f"grammar: {matcher.error}",
                                         ERROR_GRAMMAR))
                continue
            events.append(TokenEvent(seq.seq_id, offset, kept[:n], reason, lps[:n] if lps[0] is not None else None,
                                     cached_tokens=seq.cached_tokens if offset == 0 else 0))
        return events


def step_shape(chunks: list[ScheduledChunk], drafts: dict[str, list[int]]) -> list[int]:
    """[tokens, keys, prefill chunks] of the chunks a step ran (the scheduler's step-cost features). A
    verification is not counted as a prefill chunk: the scheduler learns what one costs beyond its tokens on
    its own (scheduler/draft_planner.py), and the prefill chunks' cost stays that of prefills."""
    tokens = keys = prefills = 0
    for c in chunks:
        n, s = c.num_tokens, c.start_pos
        tokens += n
        keys += n * s + n * (n + 1) // 2
        prefills += n > 1 and c.seq_id not in drafts
    return [tokens, keys, prefills]
