"""Which host a process runs on, as the KV handoff sees it: workers on one host hand KV over through
shared memory, others through Redis (scheduler/handoff_routing.py, `set_kv_transports`).

The hostname alone is not a host: processes in separate network namespaces of one machine (`ip netns`,
the multi-host tests, pods sharing a node) report the same hostname, yet each is reachable only over
its own network, which is what "another host" means to an operator. So the default identity is the
hostname plus the network namespace the process runs in; `--host-id` overrides it (say, containers on
host networking that each have their own /dev/shm).
"""

from __future__ import annotations

import os
import socket


def network_namespace() -> str:
    """The kernel's id of this process's network namespace (`net:[4026531833]` -> `4026531833`); empty
    where /proc does not say (not Linux)."""
    try:
        return os.readlink("/proc/self/ns/net").removeprefix("net:[").removesuffix("]")
    except OSError:
        return ""


def default_host_id() -> str:
    """`<hostname>/net:<namespace id>`, or the hostname alone where the namespace is unknown."""
    netns = network_namespace()
    return f"{socket.gethostname()}/net:{netns}" if netns else socket.gethostname()
