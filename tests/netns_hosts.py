"""Hosts for tests, made of Linux network namespaces on this machine: each host a namespace with its own
address on a bridge in the root namespace (veth pairs), so its processes reach each other over a real
network stack, report a host identity of their own (phaseserve/host_identity.py) and can be cut off
(`cut`: the host's link down) and brought back. Needs root and iproute2's `ip`.

`Hosts(n)` is a context manager; leaving it (even on a failure) stops every process started in a host
and deletes the namespaces, veths and the bridge.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from phaseserve.procs import stop_process

ROOT = Path(__file__).resolve().parent.parent


def unavailable() -> str | None:
    """Why hosts cannot be built here (a reason to skip), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2): apt-get install -y iproute2"
    return None


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Hosts:
    """Namespaces `<tag>h1`..., host i at 10.<a>.<b>.i/24 on bridge `<tag>br`; the root namespace at .254."""

    def __init__(self, count: int, log_dir: Path):
        tag = f"ps{os.getpid() % 100000}"
        self.tag = tag
        self.bridge = f"{tag}br"
        octet = os.getpid() % 250 + 1
        self.subnet = f"10.231.{octet}"
        self.log_dir = Path(log_dir)
        self.count = count
        self.namespaces: list[str] = []
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.forward_rule: list[str] | None = None

    def name(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i}"

    def veth(self, i: int) -> str:
        """The root namespace's end of host i's link: down = host i cut off."""
        return f"{self.tag}v{i}"

    def __enter__(self) -> "Hosts":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            self.allow_forwarding()
            for i in range(1, self.count + 1):
                self.add_host(i)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def allow_forwarding(self) -> None:
        """Where bridged frames pass through iptables (br_netfilter, which Docker loads along with a FORWARD
        policy of DROP), let the hosts' own traffic through; undone on exit."""
        try:
            filtered = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"
        except OSError:
            filtered = False
        if filtered and shutil.which("iptables"):
            self.forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            subprocess.run(["iptables", "-I", *self.forward_rule], check=True, capture_output=True, timeout=30)

    def add_host(self, i: int) -> str:
        """A namespace with loopback and one link to the bridge (a host joining later uses this too)."""
        ns, outside, inside = self.name(i), self.veth(i), f"{self.tag}p{i}"
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", ns)
        ip("-n", ns, "link", "set", inside, "name", "eth0")
        ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("link", "set", outside, "master", self.bridge)
        ip("link", "set", outside, "up")
        return ns

    def run(self, i: int, argv: list[str], log_name: str, env: dict | None = None) -> subprocess.Popen:
        """`ip netns exec <host i> argv...` (it execs argv: the Popen's pid is the program's)."""
        log = open(self.log_dir / log_name, "ab", buffering=0)
        proc = subprocess.Popen(["ip", "netns", "exec", self.name(i), *argv], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def cut(self, i: int) -> None:
        ip("link", "set", self.veth(i), "down")

    def reconnect(self, i: int) -> None:
        ip("link", "set", self.veth(i), "up")

    def log(self, name: str) -> str:
        return (self.log_dir / name).read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        for proc, log in reversed(self.procs):
            try:
                stop_process(proc, 10)
            finally:
                log.close()
        for ns in self.namespaces:  # its end of each veth goes with it, and the pair with that
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        if self.forward_rule:
            subprocess.run(["iptables", "-D", *self.forward_rule], capture_output=True, timeout=30)
