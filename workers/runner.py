"""The model runner: executes one StepPlan as one forward pass and samples.

It owns the model, the paged KV cache and the per-sequence token state. All
chunks of a plan (decodes and prefill chunks) are packed into one unpadded
batch. Block ids come from the plan; the runner never allocates any.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

import kernels
from phaseserve.params import SamplingParams, finish_reason
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan, StepResult, TokenEvent
from workers.cpu_memory import keep_heap_memory, release_free_heap
from workers.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from workers.linear import QuantizedLinear
from workers.loader import ModelConfig, load_checkpoint, read_config, resolve_dtype
from workers.model import AttentionGroup, LlamaFamilyModel, StepInputs
from workers.sampler import SampleRow, Sampler, stop_id_tensor

log = structlog.get_logger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20

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
    # positions whose KV this worker wrote: a chunk must start here, else a plan between was lost
    num_computed: int = 0

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len


class ModelRunner:
    def __init__(
        self, model_dir: str | Path, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None, max_model_len: int | None = None, seed: int | None = None,
        num_threads: int | None = None, quantization: str = "auto", activation_quant: str = "auto",
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
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size,
                          num_blocks=num_blocks, memory_bytes=kv_cache_memory_bytes, dtype=self.dtype,
                          device=self.device)
        self.num_blocks = self.kv.num_blocks
        self.block_size = block_size
        self.sampler = Sampler(cfg.vocab_size, seed)
        self.seqs: dict[str, SequenceState] = {}
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
        holds blocks yet (it writes the first one or two). Returns kernel_implementations()."""
        seq = "warm-up"
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompt = [0, min(1, self.vocab_size - 1)]
        blocks = list(range(-(-(len(prompt) + 1) // self.block_size)))
        self.execute(StepPlan(0, "warm-up", starts=[SeqStart(seq, "", prompt, params)],
                              chunks=[ScheduledChunk(seq, 0, len(prompt), blocks)]))
        self.execute(StepPlan(0, "warm-up", chunks=[ScheduledChunk(seq, len(prompt), 1, blocks)]))
        self.reset()
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
            num_computed=s.num_cached,
        )

    # ------------------------------------------------------------------ step

    def reset(self) -> None:
        """Forget every sequence (a new scheduler or adoption owns this worker's blocks now)."""
        self.seqs.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.reset:
            self.reset()
        for seq_id in plan.releases:
            self.seqs.pop(seq_id, None)
        events: list[TokenEvent] = []
        for s in plan.starts:
            self._start(s)
            problem = self._check_start(s)
            if problem:  # fails this sequence alone: its chunks are skipped below, the batch runs
                log.error("bad sequence", seq_id=s.seq_id, error=problem)
                self.seqs[s.seq_id].finished = True
                events.append(TokenEvent(s.seq_id, len(s.output_ids), [], "error", None, problem))
        chunks: list[ScheduledChunk] = []
        for c in plan.chunks:
            seq = self.seqs.get(c.seq_id)
            if seq is None or seq.finished:
                continue  # planned one step ahead of a finish, or already released
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
                events.append(TokenEvent(c.seq_id, seq.num_outputs, [], "error", None, problem))
                continue
            chunks.append(c)
            seq.num_computed = c.start_pos + c.num_tokens
        if chunks:
            events.extend(self._run(chunks))
        num_tokens = sum(c.num_tokens for c in chunks)
        return StepResult(plan.step_id, plan.worker_id, events, num_tokens, time.perf_counter() - t0)

    def _check_start(self, s) -> str | None:
        """A sequence whose token ids the embedding cannot look up would fail the whole batch's forward pass."""
        vocab = self.vocab_size
        bad = [t for t in (*s.prompt_ids, *s.output_ids) if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
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

    def _inputs(self, chunks: list[ScheduledChunk]) -> tuple[StepInputs, list[ScheduledChunk]]:
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
        for c in ordered:
            tokens = seqs[c.seq_id].token_ids
            start = c.start_pos
            end = start + c.num_tokens
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
            if end == len(tokens):
                sample_rows.append(len(ids) - 1)
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
        )
        return inp, ordered

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> list[TokenEvent]:
        inp, ordered = self._inputs(chunks)
        sampling = [self.seqs[c.seq_id] for c in ordered if c.start_pos + c.num_tokens == len(self.seqs[c.seq_id].token_ids)]
        logits = self.model.forward(inp, self.kv, fp32=False)  # the sampler upcasts what it needs
        if not sampling:
            return []
        rows = [SampleRow(s.params, s.num_outputs, s.token_ids, s.prompt_len, s.stop_ids, s.stop_tensor)
                for s in sampling]
        out = self.sampler(logits, rows)
        events = []
        for seq, tok, lp in zip(sampling, out.token_ids, out.logprobs):
            offset = seq.num_outputs
            seq.token_ids.append(tok)
            reason = finish_reason(seq.params, tok, seq.num_outputs, len(seq.token_ids), self.eos_token_ids,
                                   self.max_model_len)
            if reason is not None:
                seq.finished = True
            events.append(TokenEvent(seq.seq_id, offset, [tok], reason, [lp] if lp is not None else None))
        return events
