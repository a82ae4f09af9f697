"""Building a native op (kernels/native/__init__.py, build): what a dead or concurrent builder leaves behind
never blocks the next load. Each test builds a tiny op of its own (a few seconds) in its own cache root."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phaseserve.kernels import native

pytestmark = pytest.mark.skipif(native._unsupported_platform() is not None,
                                reason=f"no native build here: {native._unsupported_platform()}")

SOURCE = textwrap.dedent("""
    #include <torch/csrc/stable/library.h>
    #include <cstdint>
    namespace { int64_t answer() { return 42; } }
    STABLE_TORCH_LIBRARY(phaseserve_build_probe, m) { m.def("answer() -> int"); }
    STABLE_TORCH_LIBRARY_IMPL(phaseserve_build_probe, CompositeExplicitAutograd, m) {
      m.impl("answer", TORCH_BOX(&answer));
    }
""")

# builds the probe op into ROOT and prints what its op answers
LOAD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from phaseserve.kernels import native
    library, compiled = native.build("phaseserve_build_probe", Path(sys.argv[1]), root=Path(sys.argv[2]))
    torch.ops.load_library(str(library))
    print(torch.ops.phaseserve_build_probe.answer(), compiled, library)
""")
LOAD_TIMEOUT_S = 240  # a hang (waiting on a lock nobody holds) fails here instead of stalling the suite


def _load(source: Path, root: Path) -> tuple[str, bool, Path]:
    out = subprocess.run([sys.executable, "-c", LOAD, str(source), str(root)], capture_output=True, text=True,
                         timeout=LOAD_TIMEOUT_S, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    answer, compiled, library = out.stdout.split()
    return answer, compiled == "True", Path(library)


@pytest.fixture
def probe(tmp_path) -> tuple[Path, Path]:
    source = tmp_path / "build_probe.cpp"
    source.write_text(SOURCE)
    return source, tmp_path / "cache"


def test_a_stale_lock_and_a_dead_builders_directory_do_not_block_a_load(probe):
    source, root = probe
    # what dead builders leave: a private build directory with torch's lock file and half the objects in it,
    # and torch's own shared lock file where cpp_extension.load used to build
    dead = root / f"{native._BUILDING}phaseserve_build_probe-dead"
    dead.mkdir(parents=True)
    (dead / "lock").write_text("")
    (dead / "build_probe.o").write_bytes(b"\0" * 64)
    (root.parent / "phaseserve_build_probe").mkdir()
    (root.parent / "phaseserve_build_probe" / "lock").write_text("")
    answer, compiled, library = _load(source, root)
    assert answer == "42" and compiled and library.parent.parent == root
    old = time.time() - native.ABANDONED_BUILD_S - 60
    os.utime(dead, (old, old))
    assert _load(source, root)[:2] == ("42", False)  # cached: loaded, not built again
    source.write_text(SOURCE + "\n// changed\n")
    answer, compiled, changed = _load(source, root)
    assert answer == "42" and compiled and changed != library  # a new source is a new directory
    assert not dead.exists()  # an abandoned build directory is removed by a later build


def test_a_builder_killed_mid_compile_leaves_a_state_the_next_load_builds_from(probe):
    source, root = probe
    builder = subprocess.Popen([sys.executable, "-c", LOAD, str(source), str(root)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True,
                               cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    try:
        # the compiler runs once ninja's build file is written in the builder's private directory
        while not list(root.glob(f"{native._BUILDING}*/build.ninja")):
            assert builder.poll() is None, "the builder exited before compiling"
            assert time.monotonic() < deadline, "the builder never started compiling"
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        os.killpg(builder.pid, signal.SIGKILL)  # the builder, ninja and the compiler
        builder.wait()
    assert not list(root.glob("phaseserve_build_probe-*")), "killed mid-compile, yet a finished build exists"
    answer, compiled, _ = _load(source, root)
    assert answer == "42" and compiled


def test_concurrent_builders_each_load_and_one_build_is_kept(probe):
    source, root = probe
    cmd = [sys.executable, "-c", LOAD, str(source), str(root)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for _ in range(2)]
    outs = [p.communicate(timeout=LOAD_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.split()[0] for out, _ in outs} == {"42"}
    assert len(list(root.glob("phaseserve_build_probe-*"))) == 1 and not list(root.glob(f"{native._BUILDING}*"))


# the probe op as if it were one of kernels/native's: compiled in the background, then loaded
PREBUILD = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    from phaseserve.kernels import native
    native.SOURCE_DIR, native.SHARED_HEADERS = Path(sys.argv[1]).parent, []
    native.REQUIRES["build_probe"] = "baseline"
    calls, build = [], native.build
    def recorded(*args, **kwargs):
        library, compiled = build(*args, **kwargs)
        calls.append((threading.current_thread().name, compiled))
        return library, compiled
    native.build = recorded
    native.prebuild(["build_probe"])
    print(native.load("build_probe").answer(), calls)
""")


def test_load_waits_for_the_background_build_instead_of_building_again(probe, tmp_path):
    source, root = probe
    out = subprocess.run([sys.executable, "-c", PREBUILD, str(source)], capture_output=True, text=True,
                         timeout=LOAD_TIMEOUT_S, cwd=Path(__file__).resolve().parents[1],
                         env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions")))
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]  # after the log lines
    assert last == "42 [('build-build_probe', True), ('MainThread', False)]", out.stdout
