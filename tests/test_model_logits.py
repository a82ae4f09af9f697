"""Logits of the paged-KV model equal transformers' on the same fp32 weights, for every
architecture quirk, at prefill, chunked prefill and decode (decodes and prefill chunks
sharing steps)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import ALL_KINDS, make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner

# per sequence, the chunk sizes of successive steps (1 = a decode-shaped step)
SCHEDULES = {
    "prefill_then_decode": [[40, 1, 1, 1], [29, 1, 1, 1]],
    "chunks_7": [[7] * 6 + [1] * 2, [7, 7, 7, 7, 1]],
    "uneven_mixed": [[33, 1, 1, 1, 1, 1, 1, 1], [1, 5, 16, 64]],
}


def run_schedule(runner: ModelRunner, seqs: list[list[int]], schedule: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position, computed step by step as `schedule` says; one packed forward per step."""
    runner.execute(StepPlan(0, "w", [SeqStart(f"s{i}", "g", ids, SamplingParams()) for i, ids in enumerate(seqs)]))
    bs = runner.block_size
    pos = [0] * len(seqs)
    per_seq = [[] for _ in seqs]
    for step in range(max(len(s) for s in schedule)):
        chunks = []
        for i, sizes in enumerate(schedule):
            if step < len(sizes):
                end = pos[i] + sizes[step]
                base = i * 32  # each sequence owns blocks [32 i, 32 i + 32)
                chunks.append(ScheduledChunk(f"s{i}", pos[i], sizes[step], list(range(base, base + -(-end // bs)))))
                pos[i] = end
        inp, ordered = runner.packer.pack(chunks)
        inp.logits_indices = torch.arange(inp.input_ids.shape[0])  # every row, not just the sampled ones
        logits = runner.model.forward(inp, runner.kv)
        row = 0
        for c in ordered:
            per_seq[int(c.seq_id[1:])].append(logits[row:row + c.num_tokens])
            row += c.num_tokens
    return [torch.cat(x) for x in per_seq]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: make_model(root, k) for k in ALL_KINDS}


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_logits_match_transformers(models, kind):
    path = models[kind]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    # causal: the logits of a prefix are the first rows of the full sequence's logits
    full = [torch.randint(3, 320, (100,), generator=g).tolist() for _ in range(2)]
    with torch.no_grad():
        full_refs = [hf(torch.tensor([s])).logits[0] for s in full]
    runner = ModelRunner(path, dtype="float32", num_blocks=64, block_size=4 if kind == "mqa" else 16)
    for name, schedule in SCHEDULES.items():
        runner.execute(StepPlan(0, "w", releases=list(runner.seqs)))
        lens = [sum(x) for x in schedule]
        got = run_schedule(runner, [f[:n] for f, n in zip(full, lens)], schedule)
        for ref, out in zip([r[:n] for r, n in zip(full_refs, lens)], got):
            assert out.shape == ref.shape
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-4, f"{kind} {name}: max relative error {rel:.2e}"


def test_bf16_logits_close(tmp_path):
    """bf16 weights (the CPU fast path) stay close to fp32 transformers on the same checkpoint."""
    path = make_model(tmp_path, "llama_gqa_llama3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = torch.randint(3, 320, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    runner = ModelRunner(path, dtype="bfloat16", num_blocks=32)
    assert runner.kv.k[0].dtype == torch.bfloat16
    got = run_schedule(runner, [seq], [[20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])[0]
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 5e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
