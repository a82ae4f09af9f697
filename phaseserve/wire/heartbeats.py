"""Heartbeats, stored with a TTL: a worker's WorkerInfo (`worker:<id>`) and a gateway's GatewayInfo
(`gateway:<id>`). The key expiring is the process's death; phaseserve/live_workers.py reads the workers'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from phaseserve.wire.codec import Message, sent_if_set


@dataclass
class WorkerInfo(Message):
    """A worker's heartbeat: who it is and what it can hold. Stored with a TTL."""

    KIND: ClassVar[str] = "worker"
    worker_id: str
    role: str  # "mixed" | "prefill" | "decode"
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    pid: int = 0
    # when this life of the worker began: its process start, or (set anew by its relay) the moment its model
    # moved again after stalling past the step deadline. A new value = a new life: the scheduler retires
    # the old one (its plans are void) and adopts the worker afresh
    started_at: float = 0.0
    # context length at which a token's attention costs as much as its linear layers: the scheduler's
    # prefill cost model (0 = unknown / off, as in messages from older workers)
    attention_horizon: int = 0
    # the host it runs on (phaseserve/host_identity.py: hostname and network namespace, or --host-id): workers
    # on one host hand KV over through shared memory, others through Redis
    host: str = ""
    # the worker got SIGTERM and is leaving: the scheduler places nothing new on it, moves its waiting
    # sequences elsewhere, lets its running ones finish (up to its --drain-timeout), then answers with a
    # `drained` StepPlan (docs/architecture.md, "Workers joining and leaving")
    draining: bool = False
    # what it computes with, for people (the gateway's /health and /metrics): the activations' dtype, the
    # CPU level it runs at (kernels/cpu_isa.py; "" on CUDA), and which implementation runs each op family
    # ({"attention": "native avx512-bf16" | "native avx2" | "torch" | "triton", ...}); empty from older workers
    dtype: str = ""
    cpu_level: str = ""
    kernels: dict[str, str] = field(default_factory=dict)
    # the model's vocabulary (embedding rows): the scheduler refuses a prompt with a token id outside
    # [0, vocab_size) before it reaches a batch (0 = unknown, as from older workers: not checked)
    vocab_size: int = 0
    # speculative decoding (--speculative-config): the most tokens it verifies a step per sequence (0: off),
    # and whether the scheduler chooses fewer by acceptance and step cost (docs/speculative.md)
    speculative_tokens: int = sent_if_set(0)
    speculative_fixed: bool = sent_if_set(False)
    # the CPU threads its model runs with (torch's; 0: unknown, or CUDA), for people (the live view)
    threads: int = sent_if_set(0)
    # how many LoRA adapters it keeps loaded (--max-loras; docs/lora.md): the scheduler, which sends it every
    # sequence's adapter, follows which ones it holds and routes a sequence to a worker holding its own
    max_loras: int = sent_if_set(0)


@dataclass
class GatewayInfo(Message):
    """A gateway's heartbeat (Keys.gateway_heartbeat, stored with a TTL of `lease_ttl` seconds)."""

    KIND: ClassVar[str] = "gateway"
    gateway_id: str
    pid: int = 0
    started_at: float = 0.0
    lease_ttl: float = 5.0  # its client leases (Keys.client_lease) live this long unless refreshed
    resume_grace: float = 10.0  # how long a request without a client may wait for a resume
