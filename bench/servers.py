"""Start and stop the servers a side-by-side run compares: vLLM (its own virtualenv) and `phaseserve up`.

Each server runs in its own session (process group), so stopping it ends every process it spawned
and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import structlog

log = structlog.get_logger("bench.servers")

# where the separate vLLM virtualenv's `vllm` is: --vllm-bin, else this variable (bench/setup_vllm.sh says it)
VLLM_ENV = "PHASESERVE_BENCH_VLLM"
DEFAULT_VLLM = os.environ.get(VLLM_ENV)
# How vLLM's CPU backend uses the cores (measured on this 2-core machine, see bench/README.md):
# "auto" is vLLM's default (one core reserved for its API server/scheduler, OMP threads on the rest),
# "all" puts the OMP threads on every core, "nobind" leaves threads and placement to torch.
VLLM_THREAD_MODES = ("auto", "all", "nobind")


def vllm_thread_env(mode: str) -> dict[str, str]:
    n = os.cpu_count() or 1
    if mode == "auto":
        return {}
    if mode == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if mode == "nobind":
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    raise ValueError(f"vLLM thread mode must be one of {', '.join(VLLM_THREAD_MODES)}, not {mode!r}")


class ServerProcess:
    """A server command run in its own process group, its output in `log_path`."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None,
                 unset: tuple[str, ...] = ()):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, Path(log_path)
        self.env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900.0) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting server", name=self.name, cmd=" ".join(self.cmd), log=str(self.log_path))
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was "
                                   f"healthy; end of {self.log_path}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        log.info("server healthy", name=self.name, seconds=round(time.monotonic() - t0, 1))
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy within {timeout:.0f}s (log: {self.log_path})")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # the leader first, so it shuts its children down in order (phaseserve's embedded Redis last)
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("server ignored SIGTERM; killing its process group", name=self.name)
        try:  # whatever of the group is left (start_new_session: the group id is the leader's pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        log.info("server stopped", name=self.name, exit_code=self.proc.returncode)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def max_model_len(model_dir: Path, cap: int = 4096) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(cfg.get("max_position_embeddings") or cap), cap)


def vllm_server(model_dir: Path, port: int, name: str, log_path: Path, vllm_bin: str | None = DEFAULT_VLLM,
                threads: str = "auto", kv_cache_gib: int = 2, model_len: int | None = None,
                dtype: str = "bfloat16", extra: list[str] | None = None, log_stats: bool = False) -> ServerProcess:
    if not vllm_bin:
        raise FileNotFoundError(f"where is vLLM? pass --vllm-bin PATH/bin/vllm or set {VLLM_ENV}; "
                                "`bash bench/setup_vllm.sh VENV_DIR` installs vLLM's CPU build into VENV_DIR")
    if not Path(vllm_bin).exists():
        raise FileNotFoundError(f"no vLLM at {vllm_bin}: run `bash bench/setup_vllm.sh VENV_DIR` (or fix --vllm-bin / "
                                f"{VLLM_ENV})")
    cmd = [vllm_bin, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", name, "--dtype", dtype,
           "--max-model-len", str(model_len or max_model_len(model_dir)),
           *([] if log_stats else ["--disable-log-stats"]), *(extra or [])]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **vllm_thread_env(threads)}
    # vLLM runs from its own virtualenv: a PYTHONPATH pointing at this checkout would shadow its imports
    # (transformers probes for a `kernels` package and finds phaseserve's)
    return ServerProcess("vllm", cmd, port, log_path, env, unset=("PYTHONPATH",))


def phaseserve_server(model_dir: Path, port: int, name: str, log_path: Path, model_len: int | None = None,
                      extra: list[str] | None = None) -> ServerProcess:
    exe = Path(sys.executable).with_name("phaseserve")  # the launcher of this same environment
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "phaseserve.stack.cli"]
    cmd = base + ["up", "--model", str(model_dir), "--port", str(port), "--served-model-name", name,
                  "--max-model-len", str(model_len or max_model_len(model_dir)), *(extra or [])]
    return ServerProcess("phaseserve", cmd, port, log_path)
