"""Where a batch-1 decode step's time goes: the step, its forward pass, and the forward's parts run alone in the
step's order (the quantized linears, the lm_head, the layer ops, rotary + KV write, attention), then the forward
with its ops stubbed out (what is left: the Python around them). Where the model runs a decode step's layers in
one native call (kernels.DecodeLayers), the step and the forward are timed that way and with the layers op by op
(the path before it), rounds alternating, and the layers in one call alone.

    python -m bench.decode_profile [--model smollm2] [--dtype float32] [--activation-quant int8] [--threads 1]
                                   [--rounds 4]

One sequence at CONTEXT tokens. Each part's time is the best of 20 calls per round over --rounds rounds; on one
thread it is the calling thread's CPU time (time.thread_time: a busy neighbour's preemption is not counted),
on more the wall time. Beside it, the machine's memory read in the same run and the step's floor (the weight
bytes a step reads / that bandwidth). Run it with PHASESERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 for what an AVX2-only CPU runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from phaseserve import kernels
from bench.bench_model import measure_bandwidth, weight_bytes
from bench.bench_quant import QuantBench, model_folder
from phaseserve.wire import ScheduledChunk, SeqStart

CONTEXT = 128


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--activation-quant", default="int8", choices=("none", "int8", "auto"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def best(fn, n: int = 20) -> float:
        fn()
        out = float("inf")
        for _ in range(n):
            t = clock()
            fn()
            out = min(out, clock() - t)
        return out

    qb = QuantBench(model_folder(args.model), "auto:" + args.activation_quant, args.threads, args.dtype)
    r, m = qb.runner, qb.runner.model
    cfg, layers = m.cfg, m.layers
    table = list(range(-(-(CONTEXT + 1024) // r.block_size)))  # room for every step the rounds take
    prompt = torch.randint(3, r.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    qb._exec(starts=[SeqStart("s", "g", prompt, qb.params)], chunks=[ScheduledChunk("s", 0, CONTEXT, table)])

    def chunk():
        return [ScheduledChunk("s", len(r.seqs["s"].token_ids) - 1, 1, table)]

    inp, _ = r.packer.pack(chunk())
    g = inp.groups[0]
    # whether decode steps run each layer in one native call (kernels.decode_layer) here
    one_call = m._decode_in_one_call(inp, torch.empty(1, 1, dtype=m.dtype), r.kv)
    dt = m.dtype
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    x_h, x_i, x_2i = torch.randn(1, hidden, dtype=dt), torch.randn(1, inter, dtype=dt), torch.randn(1, 2 * inter, dtype=dt)
    res = torch.randn(1, hidden, dtype=dt)
    qkv = torch.randn(1, layers[0].qkv_heads * cfg.head_dim, dtype=dt)
    q_only = torch.randn(1, cfg.num_heads, cfg.head_dim, dtype=dt)

    def linears():
        for layer in layers:
            layer.qkv(x_h), layer.o(x_h), layer.gate_up(x_h), layer.down(x_i)

    def layer_ops():
        for layer in layers:
            kernels.rms_norm(x_h, layer.input_norm, cfg.rms_norm_eps, res)
            kernels.rms_norm(x_h, layer.post_attn_norm, cfg.rms_norm_eps, res)
            kernels.silu_and_mul(x_2i)

    def rotary():
        for i, layer in enumerate(layers):
            q, k, v = qkv.view(1, layer.qkv_heads, cfg.head_dim).split_with_sizes(layer.head_split, 1)
            kernels.rotary_and_write_kv(inp.positions, q, k, v, m.cos_sin_cache, r.kv.k[i], r.kv.v[i], inp.slot_mapping)

    def attention():
        for i, layer in enumerate(layers):
            kernels.paged_attention(q_only, r.kv.k[i], r.kv.v[i], g.block_tables, g.seq_lens, g.query_start_loc,
                                    layer.scale, g.max_query_len)

    def op_by_op(fn):  # fn with the model's layers run one op at a time (the path before decode_layer)
        def run():
            m._layer_in_one_call = False
            try:
                fn()
            finally:
                m._layer_in_one_call = one_call
        return run

    def one_call_layers():
        for i, layer in enumerate(layers):
            layer.decode(x_h, res, inp, m.cos_sin_cache, r.kv.k[i], r.kv.v[i])

    step = lambda: qb._exec(chunks=chunk())  # noqa: E731
    forward = lambda: m.forward(inp, r.kv, fp32=False)  # noqa: E731
    parts = {f"step (runner.execute){', each layer in one call' if one_call else ''}": step,
             **({"step, layers op by op": op_by_op(step)} if one_call else {}),
             f"forward{', each layer in one call' if one_call else ''}": forward,
             **({"forward, layers op by op": op_by_op(forward),
                 "every layer in one call (DecodeLayers)": lambda: m._decode_layers(
                     x_h, inp.positions, m.cos_sin_cache, r.kv.k, r.kv.v, inp.slot_mapping, g.block_tables,
                     g.seq_lens),
                 "layers in one call each (decode_layer) x layers": one_call_layers} if one_call else {}),
             f"{4 * len(layers)} layer linears": linears, "lm_head": lambda: m.lm_head(x_h),
             "layer ops (2 rms_norm, silu_and_mul) x layers": layer_ops, "rotary + KV write x layers": rotary,
             "attention x layers": attention}
    times = dict.fromkeys(parts, float("inf"))
    wb = weight_bytes(r)  # before the stubs below replace the linears
    bw = 0.0
    with torch.inference_mode():
        for _ in range(args.rounds):
            bw = max(bw, measure_bandwidth())
            for name, fn in parts.items():
                times[name] = min(times[name], best(fn))
        # the forward with every op stubbed out: the Python around the ops
        def stub(shape):
            out = torch.zeros(shape, dtype=dt)
            return lambda *a: out

        for layer in layers:
            layer.qkv, layer.o = stub((1, qkv.shape[1])), stub((1, hidden))
            layer.gate_up, layer.down = stub((1, 2 * inter)), stub((1, hidden))
        m.lm_head = stub((1, r.vocab_size))
        saved = {n: getattr(kernels, n)
                 for n in ("rms_norm", "rotary_and_write_kv", "paged_attention", "silu_and_mul")}
        try:
            m._decode_layers = lambda *a: (x_h, res)
            kernels.rms_norm = lambda *a: (x_h, res)
            kernels.rotary_and_write_kv = lambda pos, q, k, *a: (q, k)
            kernels.paged_attention = lambda q, *a: q
            kernels.silu_and_mul = lambda x: x_i
            stubbed = lambda: m.forward(inp, r.kv, fp32=False)  # noqa: E731
            times["forward, every op stubbed (Python)"] = min(best(stubbed) for _ in range(args.rounds))
            if one_call:
                times["forward, every op stubbed, layers op by op"] = min(best(op_by_op(stubbed))
                                                                          for _ in range(args.rounds))
        finally:
            for n, f in saved.items():
                setattr(kernels, n, f)
    floor = wb / bw
    print(f"{args.threads} thread(s), {clock.__name__}, activations {m.activation_quant}: memory read {bw / 1e9:.1f} GB/s "
          f"(this run), weights a step reads {wb / 1e6:.1f} MB, floor {floor * 1e3:.2f} ms")
    print("| part | ms | / floor |\n| --- | --: | --: |")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.3f} | {t / floor:.2f}x |")
    for name in [n for n in times if n.startswith("step")]:
        print(f"{name}: {times[name] / floor:.2f}x the floor at {bw / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
