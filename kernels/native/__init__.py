"""Native CPU ops: C++ files in this folder, compiled on first use with torch.utils.cpp_extension.

`load(name)` compiles `kernels/native/<name>.cpp` (once per source, headers, flags and torch version: `build`
keeps each build in a directory of its own, made atomically, under <TORCH_EXTENSIONS_DIR>/phaseserve), loads
it and returns `torch.ops.phaseserve_<name>`, the namespace its `STABLE_TORCH_LIBRARY(phaseserve_<name>, m)`
(or `TORCH_LIBRARY`) block registers; or None, with a log line saying why, where native ops cannot run:
PHASESERVE_NATIVE=0, not Linux on x86-64, a CPU below the level the file needs (REQUIRES; checked before
anything is compiled), no C++ compiler, or a failed build.

Hot functions carry `__attribute__((target(...)))` and the CPU is checked at run time: the build never
uses -march=native, so one cache serves every CPU of the architecture. Only kernels/__init__.py (the
dispatch point) decides what runs where; it asks here whether an op is available.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import structlog
import torch

from phaseserve.kernels import cpu_isa

log = structlog.get_logger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SHARED_HEADERS = sorted(Path(__file__).resolve().parent.glob("*.h"))  # included by the ops
ENV_SWITCH = "PHASESERVE_NATIVE"
CFLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-Wno-unused-function"]

# each op's file: the CPU level (kernels/cpu_isa.py) it is written for (its `supported()` op checks the
# same), and the op family it serves (what a worker reports in WorkerInfo.kernels)
OP_FILES = {
    "attention_f32": ("avx2", "attention"),
    "bf16_gemm": ("avx512-bf16", "linear"),
    "decode_attention": ("avx512-bf16", "attention"),
    "decode_layer_f32": ("avx2", "layer_ops"),  # a decode step's whole layer: the float32 ops above in one call
    "extend_attention": ("avx512-bf16", "attention"),
    "layer_ops": ("avx512-bf16", "layer_ops"),
    "layer_ops_f32": ("avx2", "layer_ops"),
    "lora": ("avx2", "lora"),  # float32 and bf16 activations alike (ANY_DTYPE)
    "quant_gemm": ("avx512-bf16", "quant_linear"),
    "quant_gemm_f32": ("avx2", "quant_linear"),
    "quant_gemm_i8": ("avx2", "quant_linear"),  # float32 activations quantized to int8 in the op
}
REQUIRES = {name: level for name, (level, _family) in OP_FILES.items()}
FAMILY = {name: family for name, (_level, family) in OP_FILES.items()}
FAMILIES = ("attention", "layer_ops", "linear", "quant_linear")

# the activations each level's ops take: the AVX512-BF16 ones bf16, the AVX2 ones float32
LEVEL_DTYPE = {"avx512-bf16": torch.bfloat16, "avx2": torch.float32}
ANY_DTYPE = {"lora"}  # the ops that take both, whatever their level

_loaded: dict[str, object | None] = {}
_lock = threading.Lock()
_prebuilds: dict[str, threading.Thread] = {}  # op name -> its background build (prebuild)


def enabled() -> bool:
    """False when PHASESERVE_NATIVE is 0/false/off/no: every op then takes the torch path."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def names() -> list[str]:
    """Every native op this folder builds (its .cpp files)."""
    return sorted(p.stem for p in SOURCE_DIR.glob("*.cpp"))


def runnable(dtype: torch.dtype | None = None) -> list[str]:
    """The native ops this process may run here: native ops on, a supported platform with a compiler, and a
    CPU at or above each op's level; with `dtype`, only the ops taking activations of that dtype. What an
    image compiles ahead of use (`python -m phaseserve.kernels.native`), and a worker while it loads its model."""
    if not enabled() or _unsupported_platform() is not None:
        return []
    return [name for name in names() if _unsupported_cpu(name) is None
            and (dtype is None or name in ANY_DTYPE or LEVEL_DTYPE.get(REQUIRES[name]) == dtype)]


def prebuild(ops: list[str]) -> None:
    """Start compiling these ops in the background, side by side (a compiler process each), while the caller
    does other work (loading its model): a first start waits for the slowest build, not for their sum.
    `load` waits for an op's build before loading it, and meets (and logs) a failed one itself."""
    with _lock:
        for name in ops:
            if name not in _prebuilds and name not in _loaded:
                _prebuilds[name] = threading.Thread(target=_build_in_background, args=(name,), daemon=True,
                                                    name=f"build-{name}")
                _prebuilds[name].start()


def finish_prebuilds() -> None:
    """Wait for every background build `prebuild` started: a worker announces itself only after, so no
    compiler competes with its first steps for the CPU (an op its warm-up did not load is still built and
    cached for the steps that will)."""
    with _lock:
        threads = list(_prebuilds.values())
    for thread in threads:
        thread.join()


def _build_in_background(name: str) -> None:
    t0 = time.perf_counter()
    try:
        library, compiled = build(f"phaseserve_{name}", SOURCE_DIR / f"{name}.cpp", headers=SHARED_HEADERS,
                                  cflags=CFLAGS)
    except Exception:  # load() builds again and logs why
        return
    if compiled:
        log.info("native op compiled (cached for later runs)", op=name, cache=str(library.parent),
                 seconds=round(time.perf_counter() - t0, 1))


def load(name: str):
    """torch.ops.phaseserve_<name> with kernels/native/<name>.cpp compiled and loaded, or None where it
    cannot run here (logged once). Cached per process; thread-safe."""
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]


def implementations(families=FAMILIES, dtype: torch.dtype | None = None) -> dict[str, str]:
    """Which implementation runs each op family in this process (for activations of `dtype`: the ops of
    that dtype's level, LEVEL_DTYPE): "native <level>" (the level its op file needs) for a family whose
    native op was loaded, else "torch". The dispatch point loads an op only where it runs it, so ask after
    the model ran a step (the worker's warm-up)."""
    with _lock:
        native = {}
        for name, ops in _loaded.items():
            if ops is not None and name in FAMILY and (dtype is None or LEVEL_DTYPE.get(REQUIRES[name]) == dtype):
                native.setdefault(FAMILY[name], set()).add(f"native {REQUIRES[name]}")
    return {family: ", ".join(sorted(native[family])) if family in native else "torch" for family in families}


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


def cache_root() -> Path:
    """Where built ops are kept: <TORCH_EXTENSIONS_DIR, or torch's default extension root>/phaseserve."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / "phaseserve"


def build_key(source: Path, headers: list[Path], cflags: list[str]) -> str:
    """A hash of everything the built library depends on: the source, the headers it may include, the flags,
    the compiler, torch's and Python's versions. Another key is another directory: nothing is rebuilt in place."""
    h = hashlib.sha256()
    for part in [source.read_bytes(), *(p.read_bytes() for p in headers), " ".join(cflags).encode(),
                 os.environ.get("CXX", "c++").encode(), torch.__version__.encode(), platform.python_version().encode(),
                 platform.machine().encode()]:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:20]


def build(module: str, source: Path, *, headers: list[Path] = (), cflags: list[str] = (),
          root: Path | None = None) -> tuple[Path, bool]:
    """The path of `module`.so built from `source`, and whether this call compiled it.

    Atomic: each builder compiles in a private temporary directory, then renames it to
    <root>/<module>-<build key>; a library is only ever read from such a finished directory. Nothing is shared
    while compiling (no lock file): concurrent builders each build, the first rename wins and the others
    discard theirs; a builder that dies leaves only its temporary directory, which blocks nobody and which a
    later build removes once it is old."""
    from torch.utils import cpp_extension  # imported here: it is slow to import and only needed to build

    root = cache_root() if root is None else root
    headers, cflags = list(headers), list(cflags)
    final = root / f"{module}-{build_key(source, headers, cflags)}"
    library = final / f"{module}.so"
    if library.is_file():
        return library, False
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(root)
    _put_ninja_on_path()
    private = Path(tempfile.mkdtemp(prefix=f"{_BUILDING}{module}-", dir=root))
    private.chmod(0o755)  # mkdtemp makes it private to us; the finished cache is read by every user's workers
    try:
        cpp_extension._write_ninja_file_and_build_library(  # build only: loading is ours, from `final`
            name=module, sources=[str(source)], extra_cflags=cflags, extra_cuda_cflags=[], extra_sycl_cflags=[],
            extra_ldflags=[], extra_include_paths=[], build_directory=str(private), verbose=False,
            with_cuda=False, with_sycl=False)
        try:
            private.rename(final)
        except OSError:  # another builder's rename won: theirs is the same library
            if not library.is_file():
                raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return library, True


_BUILDING = ".building-"  # prefix of a builder's private directory
ABANDONED_BUILD_S = 3600.0  # a private build directory this old belongs to a builder that died


def _remove_abandoned_builds(root: Path) -> None:
    now = time.time()
    for path in root.glob(f"{_BUILDING}*"):
        try:
            if now - path.stat().st_mtime > ABANDONED_BUILD_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _load(name: str):
    source = SOURCE_DIR / f"{name}.cpp"
    if not source.is_file():
        raise ValueError(f"no native op source {source}")
    reason = _unsupported_platform() or _unsupported_cpu(name)
    if reason is not None:
        log.warning("native op unavailable, torch path runs", op=name, reason=reason)
        return None
    module = f"phaseserve_{name}"
    if name in _prebuilds:
        _prebuilds[name].join()  # then build() below finds its library
    t0 = time.perf_counter()
    try:
        library, compiled = build(module, source, headers=SHARED_HEADERS, cflags=CFLAGS)
        torch.ops.load_library(str(library))
    except Exception as exc:  # a missing header, a compiler error, ninja: the torch path still works
        log.warning("native op failed to build, torch path runs", op=name, error=str(exc).strip()[-2000:])
        return None
    if compiled:
        log.info("native op compiled (cached for later runs)", op=name, cache=str(library.parent),
                 seconds=round(time.perf_counter() - t0, 1))
    ops = getattr(torch.ops, module)
    if hasattr(ops, "supported") and not ops.supported():
        log.warning("native op unavailable, torch path runs", op=name,
                    reason=f"this CPU lacks the instructions it needs ({REQUIRES[name]})")
        return None
    return ops
