"""Compile every Triton kernel (kernels/triton_ops.py and the files it exports from) to a cubin for a given
NVIDIA architecture, without a GPU or driver (ptxas ships with triton).

The interpreter runs kernels as Python and accepts code a GPU compile rejects
(tl.dot shapes, loop-carried types, control flow); this catches that. Each
public op is called on small CPU tensors with its kernel launches intercepted,
so the compiled signatures are exactly the ones real calls produce.

    python scripts/compile_triton_kernels.py --arch 80 [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from phaseserve.kernels import triton_attention, triton_ops, triton_sampling  # noqa: E402

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8"}


class _Capture:
    """Stands in for a kernel: records the launch instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn = fn
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def capture_launches() -> list:
    launches: list = []
    originals = {(module, n): k for module in (triton_ops, triton_attention, triton_sampling)
                 for n, k in vars(module).items() if isinstance(k, triton.runtime.jit.JITFunction)
                 and n.endswith("_kernel")}
    for (module, name), fn in originals.items():
        setattr(module, name, _Capture(fn, launches))
    try:
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            x = torch.randn(5, 48, dtype=dt)
            triton_ops.rms_norm(x, torch.randn(48, dtype=dt), 1e-6)
            triton_ops.rms_norm(x, torch.randn(48, dtype=torch.float32), 1e-6, x)
            q = torch.randn(6, 4, 128, dtype=dt)
            k = torch.randn(6, 2, 128, dtype=dt)
            triton_ops.rotary_embedding(torch.arange(6), q, k, torch.randn(10, 64))
            triton_ops.silu_and_mul(torch.randn(4, 200, dtype=dt))
            cache = torch.zeros(8, 16, 2, 128, dtype=dt)
            triton_ops.write_kv_cache(k, k, cache, cache, torch.arange(6))
            bt = torch.zeros(3, 2, dtype=torch.int32)
            seq_lens = torch.tensor([5, 9, 1], dtype=torch.int32)
            qsl = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
            triton_ops.paged_attention(q, cache, cache, bt, seq_lens, qsl, 0.1, 4)  # mixed
            triton_ops.paged_attention(q[:3], cache, cache, bt, seq_lens,
                                       torch.tensor([0, 1, 2, 3], dtype=torch.int32), 0.1, 1)  # decode
        from phaseserve.kernels.quant import quantize
        for kind in ("int8", "int4"):
            qw = quantize(torch.randn(80, 64), kind)
            for dt in (torch.float16, torch.bfloat16, torch.float32):
                triton_ops.quant_linear(torch.randn(5, 64, dtype=dt), qw)
        triton_ops.sample(torch.randn(3, 5000), torch.ones(3), torch.zeros(3, dtype=torch.int32),
                          torch.ones(3), torch.zeros(3), torch.ones(3, 5000))
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    return launches


def signature(fn, args, kwargs):
    sig, constexprs, options = {}, {}, {}
    for name, a in zip(fn.arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = _PTR[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            if a == 1:  # the JIT specializes integer arguments equal to 1 into constants
                sig[name], constexprs[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: unsupported argument {name}={a!r}")
    for name, v in kwargs.items():
        if name in fn.arg_names:
            sig[name], constexprs[name] = "constexpr", v
        else:
            options[name] = v  # num_warps, num_stages
    return sig, constexprs, options


def compile_all(arch: int) -> list[str]:
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    lines, seen = [], set()
    for fn, args, kwargs in capture_launches():
        sig, constexprs, options = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        compiled = triton.compile(src, target=target, options=backend.parse_options(options).__dict__)
        meta = {k: v for k, v in constexprs.items() if k.isupper()}
        lines.append(f"sm_{arch} {fn.__name__} {meta} cubin={len(compiled.asm['cubin'])}B "
                     f"shared={compiled.metadata.shared}B {time.perf_counter() - t0:.1f}s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 80 (default) or 90")
    for arch in parser.parse_args().arch or [80]:
        for line in compile_all(arch):
            print(line, flush=True)


if __name__ == "__main__":
    main()
