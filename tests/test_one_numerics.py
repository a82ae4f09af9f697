"""One numerics: a position's logits have the same bits whichever path computed them.

For small random GQA models, every position of a sequence is computed along the paths a worker takes:
one prefill, chunked prefills of several sizes, a prefill then decodes, decodes after a recompute (the
sequence released and started again with its outputs, as after a worker's death or a preemption), k+1 rows
verified in one extend pass among decodes (as speculation verifies), and a prefix reused by a second
sequence (its prefill starts at num_cached over blocks the first one wrote, as prefix caching will). All
of them run batched in the same steps, on 1 and on 2 threads, against the one-chunk prefill of the
sequence alone on one thread: identical logits bits. The model runs through the worker's own code
(workers/runner.ModelRunner executing StepPlans); only the logits of every row are kept, not just the
sampled ones.

It runs at each CPU level this host supports (kernels/cpu_isa.py): the AVX512-BF16 ops in bfloat16 and the
AVX2 ops in float32 (PHASESERVE_CPU_ISA=avx2), dense and with int4 weights."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch

from phaseserve import kernels
from phaseserve.kernels import cpu_isa, native
from model_factory import make_model
from native_ops import load_or_skip, torch_threads
from phaseserve.params import SamplingParams
from phaseserve.wire import LoraRef, ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner

LENGTH = 700  # two attention partitions (512 keys each)
PREFIX = 256  # positions of the sequence a second one reuses (whole blocks)
LEVELS = {"avx512-bf16": ("bfloat16", "extend_attention"), "avx2": ("float32", "attention_f32")}
# GQA models whose head_dim the native attention takes (2 and 3 query heads per KV head; qwen2 has qkv biases)
MODELS = {
    "llama": ("llama_gqa_llama3", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024)),
    "qwen2": ("qwen2", dict(hidden_size=192, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2,
                            max_position_embeddings=1024)),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(params=list(LEVELS))
def level(request, monkeypatch, fresh_dispatch):
    """This CPU level's ops, chosen afresh (the dispatch caches its choices per process). Never above the
    level the process was started at (a capped run stays capped)."""
    if not cpu_isa.supports(request.param):
        pytest.skip(f"the {request.param} level: this process runs {cpu_isa.level()}")
    monkeypatch.setenv(cpu_isa.ENV_CAP, request.param)
    load_or_skip(LEVELS[request.param][1])  # below the level: skipped, saying why
    return request.param


@dataclass
class Path:
    """One way to compute a sequence: `chunks` are the sizes of its chunks in order, the last ones cycled."""

    seq_id: str
    tokens: list[int]
    chunks: list[int]
    blocks: list[int]
    prompt_len: int | None = None  # < len(tokens): the rest are outputs (a recompute)
    num_cached: int = 0  # positions already in its blocks (a reused prefix)
    after: str | None = None  # starts once this sequence has computed all its tokens
    lora: LoraRef | None = None  # its LoRA adapter
    computed: int = field(default=0, init=False)
    sizes: object = field(default=None, init=False)

    def next_chunk(self) -> int:
        if self.sizes is None:
            self.sizes = itertools.chain(self.chunks[:1], itertools.cycle(self.chunks[1:] or self.chunks))
        return min(next(self.sizes), len(self.tokens) - self.computed)


class AllRowsLogits:
    """Wraps a runner so that each step's forward pass returns the logits of every packed row to a record,
    (seq_id, position) -> [logits], and the sampled rows to the runner as usual."""

    def __init__(self, runner: ModelRunner):
        self.record: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._ordered = None
        inputs, forward = runner.packer.pack, runner.model.forward

        def keep_order(chunks, drafts=None):
            inp, ordered = inputs(chunks, drafts)
            self._ordered = ordered
            return inp, ordered

        def every_row(inp, kv, fp32=True):
            sampled = inp.logits_indices
            inp.logits_indices = torch.arange(inp.input_ids.shape[0])
            logits = forward(inp, kv, fp32=fp32)
            row = 0
            for c in self._ordered:
                for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                    self.record.setdefault((c.seq_id, pos), []).append(logits[row].clone())
                    row += 1
            return logits[sampled]

        runner.packer.pack, runner.model.forward = keep_order, every_row


def run_paths(runner: ModelRunner, paths: list[Path]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """Every path's chunks, each step one chunk of every live path, until all are computed."""
    rec = AllRowsLogits(runner)
    waiting, live, done = list(paths), [], set()
    for step in itertools.count():
        starts, releases = [], []
        for p in list(waiting):
            if p.after is None or p.after in done:
                waiting.remove(p)
                prompt = p.tokens[:p.prompt_len] if p.prompt_len else p.tokens
                starts.append(SeqStart(p.seq_id, "gw", prompt, GREEDY, p.tokens[len(prompt):], num_cached=p.num_cached,
                                       lora=p.lora))
                p.computed = p.num_cached
                live.append(p)
        if not live:
            return rec.record
        chunks = []
        for p in live:
            n = p.next_chunk()
            chunks.append(ScheduledChunk(p.seq_id, p.computed, n, p.blocks))
            p.computed += n
        runner.execute(StepPlan(step, "w", starts, chunks, releases))
        for p in [p for p in live if p.computed == len(p.tokens)]:
            live.remove(p)
            done.add(p.seq_id)
            runner.execute(StepPlan(step, "w", releases=[p.seq_id]))


def _paths(tokens: list[int], other: list[int], bs: int) -> tuple[list[Path], dict[str, list[int]]]:
    """The paths of `tokens` (and of `other`, which shares its first PREFIX tokens), each on blocks of its own
    but the reused prefix; and which sequence each path computes."""
    per_seq = -(-LENGTH // bs) + 1
    blocks = (list(range(i * per_seq, (i + 1) * per_seq)) for i in itertools.count())
    rc = next(blocks)
    whole = next(blocks)
    own = next(blocks)
    paths = [
        Path("whole", tokens, [LENGTH], whole),
        Path("chunks-7", tokens, [7], next(blocks)),
        Path("chunks-64", tokens, [64], next(blocks)),
        Path("chunks-200", tokens, [200], next(blocks)),
        Path("chunks-511", tokens, [511], next(blocks)),
        Path("prefill-decode", tokens, [100, 1], next(blocks)),
        Path("verify", tokens, [100, 5, 1, 4, 1, 1, 3], next(blocks)),  # k+1 rows among decodes
        # decoded up to 300, then released and started again: prompt 100 + 200 outputs recomputed, then decodes
        Path("before-recompute", tokens[:300], [100, 1], rc),
        Path("recompute", tokens, [300, 1], rc, prompt_len=100, after="before-recompute"),
        # a second sequence over the first PREFIX positions "whole" wrote: its prefill starts there
        Path("prefix-reused", other, [64, 1, 33], whole[:PREFIX // bs] + own, num_cached=PREFIX, after="whole"),
        Path("other-whole", other, [LENGTH], next(blocks)),
    ]
    seq_of = {p.seq_id: (other if p.seq_id in ("prefix-reused", "other-whole") else tokens) for p in paths}
    return paths, seq_of


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_path_gives_a_position_the_same_logits(tmp_path_factory, monkeypatch, level, model, quantization):
    dtype = LEVELS[level][0]
    kind, overrides = MODELS[model]
    path = make_model(tmp_path_factory.mktemp("one_numerics"), kind, dtype=dtype, **overrides)
    runner = ModelRunner(path, dtype=dtype, num_blocks=16 * 46, quantization=quantization)
    bs = runner.block_size
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, runner.vocab_size, (LENGTH,), generator=g).tolist()
    other = tokens[:PREFIX] + torch.randint(3, runner.vocab_size, (LENGTH - PREFIX,), generator=g).tolist()

    with torch_threads(1):  # the references: each sequence alone, in one prefill
        ref_paths, _ = _paths(tokens, other, bs)
        alone = run_paths(runner, [p for p in ref_paths if p.seq_id == "whole"])
        alone |= run_paths(runner, [p for p in ref_paths if p.seq_id == "other-whole"])
    reference = {"whole": [alone[("whole", i)][0] for i in range(LENGTH)],
                 "other-whole": [alone[("other-whole", i)][0] for i in range(LENGTH)]}
    ran = kernels.native.implementations(("attention", "layer_ops"), getattr(torch, dtype))
    assert all(v == f"native {level}" for v in ran.values()), ran  # the level's native ops, no torch fallback

    one_call = []  # decode steps whose layers ran in one native call (kernels.DecodeLayers), counted
    decode_layers = kernels.DecodeLayers.__call__
    monkeypatch.setattr(kernels.DecodeLayers, "__call__", lambda *a: one_call.append(1) or decode_layers(*a))
    for threads in (1, 2):
        with torch_threads(threads):
            paths, seq_of = _paths(tokens, other, bs)
            record = run_paths(runner, paths)
        for (seq_id, pos), rows in record.items():
            want = reference["other-whole" if seq_of[seq_id] is other else "whole"][pos]
            for got in rows:
                assert torch.equal(got, want), (
                    f"{seq_id} at position {pos} on {threads} threads: logits differ from one prefill alone "
                    f"(max |diff| {(got.float() - want.float()).abs().max().item():.3g})")
        computed = {p.seq_id: sorted(pos for (s, pos) in record if s == p.seq_id) for p in paths}
        assert computed["prefix-reused"] == list(range(PREFIX, LENGTH))  # the cached prefix was not recomputed
        assert computed["recompute"] == list(range(LENGTH))
        assert all(computed[p.seq_id] == list(range(len(p.tokens))) for p in paths if p.num_cached == 0)
    # float32 with int4 weights packed for int8 activations, no biases (llama): its decode steps took that path
    assert bool(one_call) == (level == "avx2" and quantization == "int4" and model == "llama")


def test_lora_rows_keep_one_numerics(tmp_path_factory, monkeypatch, level):
    """The paths above with a LoRA adapter (trained with peft) on one sequence and another adapter on the
    other, beside each other in every step: each position's logits have the bits of its sequence's one
    prefill alone with its adapter. At the avx2 level with int4 weights, decode steps holding LoRA rows run
    layer by layer (kernels.DecodeLayers takes no adapter), and their rows still have those bits."""
    from lora_factory import make_adapter

    dtype = LEVELS[level][0]
    kind, overrides = MODELS["llama"]
    path = make_model(tmp_path_factory.mktemp("one_numerics"), kind, dtype=dtype, **overrides)
    out = tmp_path_factory.mktemp("one_numerics_adapters")
    lora_a = LoraRef("a", str(make_adapter(path, out, seed=3, steps=5)))
    lora_b = LoraRef("b", str(make_adapter(path, out, seed=4, target_modules=("q_proj", "down_proj"), r=4,
                                           steps=5)))
    # int4 weights at the avx2 level: the model whose base decode steps run in one native call
    runner = ModelRunner(path, dtype=dtype, num_blocks=16 * 46, quantization="int4" if level == "avx2" else "none")
    bs = runner.block_size
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, runner.vocab_size, (LENGTH,), generator=g).tolist()
    other = tokens[:PREFIX] + torch.randint(3, runner.vocab_size, (LENGTH - PREFIX,), generator=g).tolist()

    def with_adapters(paths: list[Path]) -> list[Path]:
        for p in paths:  # `other` with adapter b but where it reuses a's prefix (it must then be a's too)
            p.lora = lora_b if p.seq_id == "other-whole" else lora_a
        return paths

    with torch_threads(1):
        ref_paths = with_adapters(_paths(tokens, other, bs)[0])
        alone = run_paths(runner, [p for p in ref_paths if p.seq_id == "whole"])
        alone |= run_paths(runner, [p for p in ref_paths if p.seq_id == "other-whole"])
    one_call = []
    decode_layers = kernels.DecodeLayers.__call__
    monkeypatch.setattr(kernels.DecodeLayers, "__call__", lambda *a: one_call.append(1) or decode_layers(*a))
    for threads in (1, 2):
        with torch_threads(threads):
            paths, seq_of = _paths(tokens, other, bs)
            record = run_paths(runner, with_adapters(paths))
        for (seq_id, pos), rows in record.items():
            want = alone[("other-whole", pos) if seq_id == "other-whole" else ("whole", pos)][0] \
                if seq_of[seq_id] is tokens or seq_id == "other-whole" else None
            if want is None:  # prefix-reused: `other`'s tokens with adapter a, no reference of its own here
                continue
            for got in rows:
                assert torch.equal(got, want), f"{seq_id} at position {pos} on {threads} threads"
    assert not one_call  # every step held LoRA rows
