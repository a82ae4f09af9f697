"""Model step speed: decode step time and prefill throughput, beside the machine's floor and transformers.

    python -m bench.bench_model [--model DIR] [--skip-random] [--steps 5] [--threads N] [--batches 1,8,16,32]
                                [--activation-quant auto | none | int8]

For each model: decode step time at batch 1/8/16/32 (context CONTEXT tokens per sequence) and
prefill throughput at chunk 128/512, for the phaseserve runner (paged KV, one packed forward
per step, sampling included), for transformers on the same weights and dtype (with its KV
cache), and for the floor on this machine: for a decode step the larger of weight bytes /
measured memory bandwidth and FLOPs / measured matmul rate in the model's dtype; FLOPs / matmul rate for prefill. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.runner import ModelRunner

CONTEXT = 128
DECODE_BATCHES = (1, 8, 16, 32)
PREFILL_CHUNKS = (128, 512)
RANDOM_200M = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, max_position_embeddings=2048,
)


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    return min(_timed(fn) for _ in range(repeats))


def median(fn, repeats: int) -> float:
    fn()
    return statistics.median(_timed(fn) for _ in range(repeats))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_bandwidth() -> float:
    """Bytes/s reading a 512 MiB tensor (a sum streams it from DRAM once)."""
    x = torch.ones(128 << 20, dtype=torch.float32)  # fp32: a sum every CPU vectorizes natively
    return x.numel() * x.element_size() / best(lambda: x.sum(), 3)


def measure_matmul(dtype=torch.bfloat16) -> float:
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / best(lambda: a @ b, 3)


def build_random_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**RANDOM_200M)).to(torch.bfloat16)
    path = root / "random-200m"
    model.save_pretrained(path, safe_serialization=True)
    return path


# ---------------------------------------------------------------------- phaseserve runner


def machine_line() -> str:
    """The CPU this process computes on: its level (kernels/cpu_isa.py, with any cap) and the vector flags
    that decide it."""
    from phaseserve.kernels import cpu_isa

    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        flags = set()
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
             if f in flags]
    capped = f" (capped by {cpu_isa.ENV_CAP}={cpu_isa.cap()})" if cpu_isa.cap() else ""
    return f"cpu level {cpu_isa.level()}{capped}; flags {' '.join(shown) or 'unknown'}; torch {torch.__version__}"


class RunnerBench:
    def __init__(self, path: Path, dtype: str, kv_cache_memory_bytes: int = 1 << 30, activation_quant: str = "auto"):
        self.runner = ModelRunner(path, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                  activation_quant=activation_quant)
        self.step = 0
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)

    def _exec(self, **kw):
        self.step += 1
        return self.runner.execute(StepPlan(self.step, "bench", **kw))

    def decode_step_time(self, batch: int, repeats: int, context: int | None = None, timer=None) -> float:
        """Time of one decode step of `batch` sequences holding `context` tokens each (default CONTEXT):
        the median of `repeats`, or what `timer(fn, repeats)` makes of them (`best`: the fastest)."""
        r = self.runner
        context = context or CONTEXT
        bs = r.block_size
        per_seq = -(-(context + 64) // bs)
        if batch * per_seq > r.num_blocks:
            raise ValueError(f"batch {batch} at context {context} needs {batch * per_seq} KV blocks; the runner "
                             f"has {r.num_blocks} (raise kv_cache_memory_bytes)")
        g = torch.Generator().manual_seed(batch)
        seqs = [f"d{batch}-{i}" for i in range(batch)]
        tables = {s: list(range(i * per_seq, (i + 1) * per_seq)) for i, s in enumerate(seqs)}
        # one prefill per sequence: a batch of long prompts in one forward would only cost memory
        for s in seqs:
            prompt = torch.randint(0, r.vocab_size, (context,), generator=g).tolist()
            self._exec(starts=[SeqStart(s, "g", prompt, self.params)], chunks=[ScheduledChunk(s, 0, context, tables[s])])

        def decode():
            chunks = [ScheduledChunk(s, len(r.seqs[s].token_ids) - 1, 1, tables[s]) for s in seqs]
            self._exec(chunks=chunks)

        t = (timer or median)(decode, repeats)
        self._exec(releases=seqs)
        return t

    def prefill_time(self, chunk: int, repeats: int) -> float:
        r = self.runner
        prompt = torch.randint(0, r.vocab_size, (chunk,), generator=torch.Generator().manual_seed(chunk)).tolist()
        table = list(range(-(-chunk // r.block_size)))

        def prefill():
            self._exec(starts=[SeqStart("p", "g", prompt, self.params)], chunks=[ScheduledChunk("p", 0, chunk, table)],
                       releases=["p"])

        return median(prefill, repeats)


# ---------------------------------------------------------------------- transformers


class HFBench:
    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.vocab = self.model.config.vocab_size

    @torch.inference_mode()
    def decode_step_time(self, batch: int, repeats: int) -> float:
        from transformers import DynamicCache

        ids = torch.randint(0, self.vocab, (batch, CONTEXT), generator=torch.Generator().manual_seed(batch))
        cache = DynamicCache(config=self.model.config)
        out = self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state = {"tok": out.logits[:, -1].argmax(-1, keepdim=True), "pos": CONTEXT}

        def decode():
            pos = torch.full((batch, 1), state["pos"])
            o = self.model(state["tok"], past_key_values=cache, position_ids=pos, use_cache=True)
            state["tok"] = o.logits[:, -1].argmax(-1, keepdim=True)
            state["pos"] += 1

        return median(decode, repeats)

    @torch.inference_mode()
    def prefill_time(self, chunk: int, repeats: int) -> float:
        ids = torch.randint(0, self.vocab, (1, chunk), generator=torch.Generator().manual_seed(chunk))
        return median(lambda: self.model(ids, use_cache=True, logits_to_keep=1), repeats)


# ---------------------------------------------------------------------- floors


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step must read: every weight matrix except the embedding table (a gather)."""
    m = runner.model
    norms = [m.norm] + [t for layer in m.layers for t in (layer.input_norm, layer.post_attn_norm)]
    linears = [m.lm_head] + [t for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(t.nbytes for t in norms) + sum(t.nbytes() for t in linears)


def decode_flops(runner: ModelRunner, batch: int) -> float:
    """Matmul FLOPs of one decode step: every linear and the lm_head once per sequence (attention is
    small beside them at CONTEXT tokens)."""
    m = runner.model
    linear = sum(t.numel() for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return 2 * (linear + m.lm_head.numel()) * batch


def prefill_flops(runner: ModelRunner, tokens: int) -> float:
    """Matmul FLOPs of one prefill of `tokens` tokens: linears + causal attention + one lm_head row."""
    c = runner.config
    m = runner.model
    linear = sum(t.numel() for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    attention = c.num_layers * 2 * 2 * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return 2 * linear * tokens + attention + 2 * m.lm_head.numel()


def bench_model(name: str, path: Path, dtype: str, bw: float, repeats: int,
                with_transformers: bool = True, activation_quant: str = "auto") -> list[list[str]]:
    rb = RunnerBench(path, dtype, activation_quant=activation_quant)
    torch_dtype = rb.runner.dtype
    flops = measure_matmul(torch_dtype)  # the rate of the dtype the model computes in
    print(f"{name}: {str(torch_dtype).removeprefix('torch.')}, matmul {flops / 1e9:.0f} GFLOP/s, "
          f"weights read per decode step {weight_bytes(rb.runner) / 1e6:.1f} MB, "
          f"activation quantization {rb.runner.model.activation_quant}")
    hf = HFBench(path, torch_dtype) if with_transformers else None
    rows = []
    wb = weight_bytes(rb.runner)
    for b in DECODE_BATCHES:
        ours = rb.decode_step_time(b, repeats)
        theirs = hf.decode_step_time(b, repeats) if hf else float("nan")
        floor = max(wb / bw, decode_flops(rb.runner, b) / flops)  # memory-bound at small batch, then compute
        rows.append([name, f"decode step, batch {b}", f"{ours * 1e3:.1f} ms", f"{floor * 1e3:.1f} ms",
                     f"{ours / floor:.2f}x", f"{theirs * 1e3:.1f} ms", f"{theirs / ours:.2f}x"])
    for cs in PREFILL_CHUNKS:
        ours = rb.prefill_time(cs, repeats)
        theirs = hf.prefill_time(cs, repeats) if hf else float("nan")
        floor = prefill_flops(rb.runner, cs) / flops
        rows.append([name, f"prefill, chunk {cs}", f"{cs / ours:.0f} tok/s", f"{cs / floor:.0f} tok/s",
                     f"{ours / floor:.2f}x", f"{cs / theirs:.0f} tok/s", f"{theirs / ours:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    global CONTEXT, DECODE_BATCHES
    bundled = Path(__file__).resolve().parent.parent / "phaseserve" / "bundled_model"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=bundled if (bundled / "config.json").is_file() else None)
    ap.add_argument("--dtype", default="auto", help="as the worker's --dtype (auto: what this CPU computes natively)")
    ap.add_argument("--skip-random", action="store_true", help="skip the ~200M random-weight Llama")
    ap.add_argument("--steps", type=int, default=5, help="timed repeats per figure (median)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a machine shared with other busy "
                         "processes, 1 avoids OpenMP barrier stalls that can cost 5x")
    ap.add_argument("--context", type=int, default=CONTEXT, help="context tokens per sequence at decode")
    ap.add_argument("--skip-transformers", action="store_true", help="phaseserve and the floor only (faster)")
    ap.add_argument("--activation-quant", default="auto", choices=("auto", "none", "int8"),
                    help="as the worker's --activation-quant")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    CONTEXT = args.context
    DECODE_BATCHES = tuple(int(b) for b in args.batches.split(","))

    torch.manual_seed(0)
    bw = measure_bandwidth()
    print(f"machine: {torch.get_num_threads()} threads, memory read {bw / 1e9:.1f} GB/s; {machine_line()}")
    rows = []
    if args.model is not None:
        rows += bench_model(args.model.name, args.model, args.dtype, bw, args.steps, not args.skip_transformers,
                            args.activation_quant)
    if not args.skip_random:
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench_model("random-200m", build_random_model(Path(tmp)), args.dtype, bw, args.steps,
                                not args.skip_transformers, args.activation_quant)
    header = ["model", "figure", "phaseserve", "floor", "phaseserve / floor", "transformers",
              "transformers / phaseserve (time)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
