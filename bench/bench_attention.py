"""Decode attention alone: the torch path against the native op, K/V cold, beside the machine's bandwidth;
with --prefill, prefill attention over a cached prefix (per layer call and in the model's chunk step).

    python -m bench.bench_attention [--threads 1] [--rounds 5] [--batch 1 16] [--dtype bfloat16|float32]
    python -m bench.bench_attention --prefill [--threads 1] [--rounds 5] [--model small-200m] [--dtype ...]

--dtype float32 times the float32 ops for AVX2 + FMA (kernels/native/attention_f32.cpp) against the torch
path in fp32, with fp32 caches (run it with PHASESERVE_CPU_ISA=avx2 to time what an AVX2-only CPU runs);
--prefill then times the per-call table only, with the fp32 matmul rate beside it (the model steps are bf16).

For each shape (query heads / KV heads, head_dim 64) and context length, one call per layer over as
many layers' caches as make ~256 MiB of K/V, so every layer's K/V comes from DRAM as in a real decode
step; the torch path and the native op alternate round by round and the best round of each is kept.
Prints the time per layer call, the ratio, and the K/V bytes each implementation read per second
beside a one-thread streaming read of this machine (bench_model's measure_bandwidth).

--prefill: (1) one layer's prefill attention call, a chunk of new queries over a cached prefix at the
200M model's shapes (16 query heads, 8 KV heads, head_dim 64), torch against native, best of the
alternating rounds, with the native op's GFLOP/s; (2) the model's step for a 256-token chunk after a
cached prefix of 0 / 512 / 1024 / 1536 tokens, the torch and the native prefill attention alternating
round by round in this one process, with the time spent in attention (its share of the step). Times are
the calling thread's CPU time (one thread: the whole op runs on it), so neighbours that preempt this
process on a shared machine do not inflate them; wall time of the best round beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from phaseserve import kernels
import phaseserve.kernels.native
from phaseserve import kernels
from bench.bench_model import measure_bandwidth, measure_matmul
from phaseserve.kernels import reference
from phaseserve.kernels.dispatch.attention import ATTENTION_SOURCE, EXTEND_ATTENTION

SHAPES = ((9, 3, 64, "SmolLM2-135M"), (8, 4, 64, "8/4"))
CONTEXTS = (128, 512, 1024, 2048, 4096)
BLOCK = 16
COLD_BYTES = 256 << 20


def make_layers(batch: int, context: int, hq: int, hkv: int, d: int, seed: int, dtype=torch.bfloat16):
    """Per layer: (q, k_cache, v_cache, tables, lens) with each sequence's blocks scattered in its cache."""
    per_seq = -(-context // BLOCK)
    layer_bytes = 2 * batch * per_seq * BLOCK * hkv * d * dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(max(2, -(-COLD_BYTES // layer_bytes))):
        nb = batch * per_seq
        k = torch.randn(nb, BLOCK, hkv, d, generator=g).to(dtype)
        v = torch.randn(nb, BLOCK, hkv, d, generator=g).to(dtype)
        tables = torch.randperm(nb, generator=g).view(batch, per_seq).int()
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, hq, d, generator=g).to(dtype)
        layers.append((q, k, v, tables, lens))
    return layers


def per_call(fn, layers, scale: float) -> float:
    t = time.perf_counter()
    for q, k, v, tables, lens in layers:
        fn(q, k, v, tables, lens, scale)
    return (time.perf_counter() - t) / len(layers)


PREFILL_SHAPE = (16, 8, 64)  # the 200M model's query heads, KV heads, head_dim
PREFILL_CALLS = ((1, 1536), (4, 1536), (16, 1536), (64, 1536), (256, 0), (256, 512), (256, 1024), (256, 1536))
STEP_CHUNK = 256
STEP_PREFIXES = (0, 512, 1024, 1536)


def prefill_case(chunk: int, prefix: int, hq: int, hkv: int, d: int, seed: int, dtype=torch.bfloat16):
    """(q, k_cache, v_cache, tables, lens, query_start_loc) for one sequence's chunk, blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-(prefix + chunk) // BLOCK)
    k = torch.randn(blocks, BLOCK, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).view(1, blocks).int()
    q = torch.randn(chunk, hq, d, generator=g).to(dtype)
    lens = torch.tensor([prefix + chunk], dtype=torch.int32)
    return q, k, v, tables, lens, torch.tensor([0, chunk], dtype=torch.int32)


def cpu_timed(fn) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of one call."""
    c, w = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c, time.perf_counter() - w


@contextlib.contextmanager
def prefill_attention(implementation: str, runner):
    """Within: the CPU prefill chunks of `runner`'s (bf16) model take the torch path ("torch") or the
    dispatch's own choice ("native")."""
    if implementation != "torch":
        yield
        return
    cfg = runner.model.cfg
    with kernels.CHOICES.pinned(EXTEND_ATTENTION, (torch.bfloat16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                                None):
        yield


class AttentionClock:
    """Thread CPU time spent inside kernels.paged_attention while installed (the model calls it through
    the module, once per layer)."""

    def __init__(self):
        self.seconds = 0.0
        self.inner = kernels.paged_attention

    def __enter__(self):
        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t

        kernels.paged_attention = timed
        return self

    def __exit__(self, *exc):
        kernels.paged_attention = self.inner


def native_op(name: str, dtype: torch.dtype):
    """The loaded native ops serving `name` (decode_attention or extend_attention) for `dtype`."""
    ops = kernels.native.load(ATTENTION_SOURCE[dtype][name])
    if ops is None:
        raise SystemExit(f"the native {name} for {dtype} is not available here (see the log line above)")
    return ops


def prefill_calls(rounds: int, dtype=torch.bfloat16) -> None:
    ops = native_op("extend_attention", dtype)
    hq, hkv, d = PREFILL_SHAPE
    print(f"\nOne layer's prefill attention call, {hq}/{hkv} heads x {d}, {str(dtype)[6:]}, block size {BLOCK}; "
          f"best of {rounds} alternating rounds (thread CPU time)")
    print("| chunk | cached prefix | torch | native | torch / native | native GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for chunk, prefix in PREFILL_CALLS:
        q, k, v, tables, lens, qsl = prefill_case(chunk, prefix, hq, hkv, d, seed=chunk + prefix, dtype=dtype)
        impls = {"torch": lambda: reference.paged_attention(q, k, v, tables, lens, qsl, d ** -0.5, chunk),
                 "native": lambda: ops.extend_attention(q, k, v, tables, lens, qsl, d ** -0.5)}
        best = {name: float("inf") for name in impls}
        for fn in impls.values():
            fn()
        for _ in range(rounds):
            for name, fn in impls.items():
                best[name] = min(best[name], cpu_timed(fn)[0])
        flops = 4 * chunk * (prefix + (chunk + 1) / 2) * hq * d  # QK^T and PV over the visible keys
        t, n = best["torch"], best["native"]
        print(f"| {chunk} | {prefix} | {t * 1e3:.3f} ms | {n * 1e3:.3f} ms | {t / n:.2f}x | {flops / n / 1e9:.0f} |")


def prefill_steps(model: str, rounds: int) -> None:
    from phaseserve.stack.benchmark.models import resolve_model
    from phaseserve.params import SamplingParams
    from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.runner import ModelRunner

    runner = ModelRunner(resolve_model(model), dtype="bfloat16", kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    bs = runner.block_size
    step = 0
    print(f"\n{model}: the step of a {STEP_CHUNK}-token chunk after a cached prefix, the torch and the native "
          f"prefill attention alternating; best of {rounds} rounds (thread CPU time; wall of that round)")
    print("| cached prefix | torch step | torch attention (share) | native step | native attention (share) "
          "| step torch / native | attention torch / native |")
    print("|---|---|---|---|---|---|---|")
    for prefix in STEP_PREFIXES:
        end = prefix + STEP_CHUNK
        prompt = torch.randint(0, runner.vocab_size, (end + 1,), generator=torch.Generator().manual_seed(end)).tolist()
        table = list(range(-(-(end + 1) // bs)))
        step += 1
        runner.execute(StepPlan(step, "bench", starts=[SeqStart("p", "g", prompt, params)],
                                chunks=[ScheduledChunk("p", 0, prefix, table)] if prefix else []))
        best = {}
        for r in range(rounds + 1):  # the first round warms up (oneDNN primitives, the native op's build)
            for impl in ("torch", "native"):
                step += 1
                runner.seqs["p"].num_computed = prefix  # the same chunk again (its K/V rewritten alike)
                plan = StepPlan(step, "bench", chunks=[ScheduledChunk("p", prefix, STEP_CHUNK, table)])
                with prefill_attention(impl, runner), AttentionClock() as clock:
                    cpu, wall = cpu_timed(lambda: runner.execute(plan))
                if r and (impl not in best or cpu < best[impl][0]):
                    best[impl] = (cpu, wall, clock.seconds)
        step += 1
        runner.execute(StepPlan(step, "bench", releases=["p"]))
        (tc, tw, ta), (nc, nw, na) = best["torch"], best["native"]
        print(f"| {prefix} | {tc * 1e3:.1f} ms (wall {tw * 1e3:.1f}) | {ta * 1e3:.1f} ms ({ta / tc:.0%}) "
              f"| {nc * 1e3:.1f} ms (wall {nw * 1e3:.1f}) | {na * 1e3:.1f} ms ({na / nc:.0%}) | {tc / nc:.2f}x "
              f"| {ta / na:.2f}x |")


MIXED_PROMPTS, MIXED_PROMPT_LEN, MIXED_DECODES = 4, 128, 16


def mixed_steps(model: str, rounds: int) -> None:
    """Workload A's heaviest step: MIXED_PROMPTS new 128-token prompts (no cached prefix) beside
    MIXED_DECODES running sequences' decodes (context ~MIXED_PROMPT_LEN + 32)."""
    from phaseserve.stack.benchmark.models import resolve_model
    from phaseserve.params import SamplingParams
    from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
    from phaseserve.workers.runner import ModelRunner

    runner = ModelRunner(resolve_model(model), dtype="bfloat16", kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    bs = runner.block_size
    per_seq = -(-(MIXED_PROMPT_LEN + 64) // bs)
    g = torch.Generator().manual_seed(0)
    n = MIXED_DECODES + MIXED_PROMPTS
    ids = [f"s{i}" for i in range(n)]
    tables = {s: list(range(i * per_seq, (i + 1) * per_seq)) for i, s in enumerate(ids)}
    prompts = {s: torch.randint(0, runner.vocab_size, (MIXED_PROMPT_LEN,), generator=g).tolist() for s in ids}
    step = 1
    decoding, prefilling = ids[:MIXED_DECODES], ids[MIXED_DECODES:]
    runner.execute(StepPlan(step, "bench", starts=[SeqStart(s, "g", prompts[s], params) for s in ids],
                            chunks=[ScheduledChunk(s, 0, MIXED_PROMPT_LEN, tables[s]) for s in decoding]))
    for _ in range(32):  # the running sequences to context ~160
        step += 1
        runner.execute(StepPlan(step, "bench", chunks=[
            ScheduledChunk(s, len(runner.seqs[s].token_ids) - 1, 1, tables[s]) for s in decoding]))
    print(f"\n{model}: workload A's prefill step, {MIXED_PROMPTS} new {MIXED_PROMPT_LEN}-token prompts beside "
          f"{MIXED_DECODES} decodes (context {len(runner.seqs[decoding[0]].token_ids)}), the torch and the native "
          f"prefill attention alternating; best of {rounds} rounds (thread CPU time)")
    print("| torch step | its attention (decode + prefill) | native step | its attention | step torch / native |")
    print("|---|---|---|---|---|")
    best = {}
    for r in range(rounds + 1):
        for impl in ("torch", "native"):
            step += 1
            for s in prefilling:
                runner.seqs[s].num_computed = 0  # the same prompts again (their K/V rewritten alike)
            # the decodes step on (one token each round): their context grows by 2 over a round
            chunks = [ScheduledChunk(s, len(runner.seqs[s].token_ids) - 1, 1, tables[s]) for s in decoding]
            chunks += [ScheduledChunk(s, 0, MIXED_PROMPT_LEN, tables[s]) for s in prefilling]
            with prefill_attention(impl, runner), AttentionClock() as clock:
                cpu, _ = cpu_timed(lambda: runner.execute(StepPlan(step, "bench", chunks=chunks)))
            for s in prefilling:  # drop the sampled token: the prompt stays 128 tokens
                del runner.seqs[s].token_ids[MIXED_PROMPT_LEN:]
            if r and (impl not in best or cpu < best[impl][0]):
                best[impl] = (cpu, clock.seconds)
    (tc, ta), (nc, na) = best["torch"], best["native"]
    print(f"| {tc * 1e3:.1f} ms | {ta * 1e3:.1f} ms | {nc * 1e3:.1f} ms | {na * 1e3:.1f} ms | {tc / nc:.2f}x |")


def prefill_main(args) -> None:
    dtype = getattr(torch, args.dtype)
    bw, mm = measure_bandwidth(), measure_matmul(dtype)
    print(f"machine: {args.threads} thread(s), memory read {bw / 1e9:.1f} GB/s, {args.dtype} matmul {mm / 1e9:.0f} "
          f"GFLOP/s")
    prefill_calls(args.rounds, dtype)
    if dtype != torch.bfloat16:
        return
    prefill_steps(args.model, args.rounds)
    mixed_steps(args.model, args.rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--prefill", action="store_true", help="prefill attention over a cached prefix instead")
    ap.add_argument("--model", default="small-200m", help="with --prefill: the model whose chunk step is timed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.prefill:
        prefill_main(args)
        return
    dtype = getattr(torch, args.dtype)
    ops = native_op("decode_attention", dtype)
    bw = measure_bandwidth()
    print(f"machine: {args.threads} thread(s), memory read {bw / 1e9:.1f} GB/s; block size {BLOCK}, {args.dtype}, "
          f"K/V cold; best of {args.rounds} alternating rounds")
    print("| shape | batch | context | torch | native | torch / native | torch K/V GB/s | native K/V GB/s "
          "| native / memory read |")
    print("|---|---|---|---|---|---|---|---|---|")
    impls = {"torch": reference._decode_attention, "native": ops.decode_attention}
    for hq, hkv, d, label in SHAPES:
        for batch in args.batch:
            for ctx in CONTEXTS:
                layers = make_layers(batch, ctx, hq, hkv, d, seed=ctx, dtype=dtype)
                scale = d ** -0.5
                best = {name: float("inf") for name in impls}
                for name, fn in impls.items():  # warm-up (oneDNN primitives, first-touch of the scratch)
                    per_call(fn, layers[:1], scale)
                for _ in range(args.rounds):
                    for name, fn in impls.items():
                        best[name] = min(best[name], per_call(fn, layers, scale))
                kv_bytes = 2 * batch * ctx * hkv * d * dtype.itemsize
                t, n = best["torch"], best["native"]
                print(f"| {hq}/{hkv} x {d} ({label}) | {batch} | {ctx} | {t * 1e3:.3f} ms | {n * 1e3:.3f} ms "
                      f"| {t / n:.2f}x | {kv_bytes / t / 1e9:.1f} | {kv_bytes / n / 1e9:.1f} | {kv_bytes / n / bw:.2f} |",
                      flush=True)
                del layers


if __name__ == "__main__":
    main()
