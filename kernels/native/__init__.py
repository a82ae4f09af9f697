"""Native CPU ops: C++ files in this folder, compiled on first use with torch.utils.cpp_extension.

`load(name)` compiles `kernels/native/<name>.cpp` into torch's extension cache (reused by later
processes while the source is unchanged) and returns `torch.ops.phaseserve_<name>`, the namespace its
`STABLE_TORCH_LIBRARY(phaseserve_<name>, m)` (or `TORCH_LIBRARY`) block registers; or None, with a log
line saying why, where native ops cannot run: PHASESERVE_NATIVE=0, not Linux on x86-64, a CPU below the
level the file needs (REQUIRES; checked before anything is compiled), no C++ compiler, or a failed build.

Hot functions carry `__attribute__((target(...)))` and the CPU is checked at run time: the build never
uses -march=native, so one cache serves every CPU of the architecture. Only kernels/__init__.py (the
dispatch point) decides what runs where; it asks here whether an op is available.
"""

from __future__ import annotations

import hashlib

import os
import platform
import shutil
import threading
import time
from pathlib import Path

import structlog
import torch

from kernels import cpu_isa

log = structlog.get_logger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SHARED_HEADERS = sorted(Path(__file__).resolve().parent.glob("*.h"))  # included by the ops
ENV_SWITCH = "PHASESERVE_NATIVE"
CFLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-Wno-unused-function"]

# the CPU level (kernels/cpu_isa.py) each op's file is written for; its `supported()` op checks the same
REQUIRES = {
    "attention_f32": "avx2",
    "bf16_gemm": "avx512-bf16",
    "decode_attention": "avx512-bf16",
    "extend_attention": "avx512-bf16",
    "layer_ops": "avx512-bf16",
    "layer_ops_f32": "avx2",
    "quant_gemm": "avx512-bf16",
    "quant_gemm_f32": "avx2",
}

_loaded: dict[str, object | None] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """False when PHASESERVE_NATIVE is 0/false/off/no: every op then takes the torch path."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def names() -> list[str]:
    """Every native op this folder builds (its .cpp files), for callers that compile them all ahead of use
    (the Docker image)."""
    return sorted(p.stem for p in SOURCE_DIR.glob("*.cpp"))


def load(name: str):
    """torch.ops.phaseserve_<name> with kernels/native/<name>.cpp compiled and loaded, or None where it
    cannot run here (logged once). Cached per process; thread-safe."""
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]


def _unsupported_platform() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"native ops are built for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found; install g++ or set CXX)"
    return None


def _unsupported_cpu(name: str) -> str | None:
    required = REQUIRES[name]
    if cpu_isa.supports(required):
        return None
    capped = f", capped by {cpu_isa.ENV_CAP}" if cpu_isa.cap() is not None else ""
    return f"needs {required}; this CPU runs {cpu_isa.level()}{capped}"


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja wheel's binary sits in the venv's bin, which is not on
    PATH when the venv's python is run without activating it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _header_flag() -> str:
    """A define carrying the shared headers' hash: torch rebuilds an op when its flags change, not when a
    header it includes does."""
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in SHARED_HEADERS)).hexdigest()[:16]
    return f"-DPHASESERVE_NATIVE_HEADERS={digest}"


def _load(name: str):
    source = SOURCE_DIR / f"{name}.cpp"
    if not source.is_file():
        raise ValueError(f"no native op source {source}")
    reason = _unsupported_platform() or _unsupported_cpu(name)
    if reason is not None:
        log.warning("native op unavailable, torch path runs", op=name, reason=reason)
        return None
    from torch.utils import cpp_extension  # imported here: it is slow to import and only needed once

    module = f"phaseserve_{name}"
    _put_ninja_on_path()
    build_dir = Path(cpp_extension._get_build_directory(module, verbose=False))
    built = build_dir / f"{module}.so"
    newest = max([source.stat().st_mtime] + [h.stat().st_mtime for h in SHARED_HEADERS])
    fresh = not built.is_file() or built.stat().st_mtime < newest
    t0 = time.perf_counter()
    if fresh:
        log.info("compiling native op (first use; cached for later runs)", op=name, cache=str(build_dir))
    try:
        cpp_extension.load(name=module, sources=[str(source)], extra_cflags=CFLAGS + [_header_flag()],
                           is_python_module=False, verbose=False)
    except Exception as exc:  # a missing header, a compiler error, ninja: the torch path still works
        log.warning("native op failed to build, torch path runs", op=name, error=str(exc).strip()[-2000:])
        return None
    if fresh:
        log.info("native op compiled", op=name, seconds=round(time.perf_counter() - t0, 1))
    ops = getattr(torch.ops, module)
    if hasattr(ops, "supported") and not ops.supported():
        log.warning("native op unavailable, torch path runs", op=name,
                    reason=f"this CPU lacks the instructions it needs ({REQUIRES[name]})")
        return None
    return ops
