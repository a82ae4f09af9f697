"""Which workers the scheduler holds, pure: a worker joins with a heartbeat and gets a policy of its own for
its blocks, and leaves when its heartbeat lapses or shows a new life. (Fencing a joining worker's stream
with the scheduler's epoch is I/O: scheduler/worker_refresh.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from phaseserve.wire import WorkerInfo
from phaseserve.scheduler.lora_routing import AdapterRecency
from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
from phaseserve.scheduler.step_cost import ItlTarget
from phaseserve.scheduler.worker_slot import WorkerSlot

log = structlog.get_logger("phaseserve.scheduler.cluster")

# step ids of one adoption of a worker start at (adoption number) * this: a late result of an earlier
# adoption (or of a scheduler before us, whose epoch differs anyway) matches no open step
STEP_IDS_PER_ADOPTION = 1_000_000_000


@dataclass
class PolicyLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    attention_horizon: int | None = None  # None: each worker's own (WorkerInfo); 0: cost model off
    long_prefill_threshold: int = 256  # see SchedulerConfig; 0: no cap
    # how prefill workers hand KV to decode workers: "auto" (shared memory between workers on one host,
    # else Redis), "shm" or "redis"
    kv_transport: str = "auto"
    itl_target: ItlTarget = field(default_factory=ItlTarget)  # see SchedulerConfig; off: no bound
    itl_patience_s: float = 15.0  # see SchedulerConfig
    tenant_wait_s: float = 0.1  # see SchedulerConfig
    enable_prefix_caching: bool = True  # see SchedulerConfig


def policy_config(limits: PolicyLimits, info: WorkerInfo) -> SchedulerConfig:
    """A worker's policy: the scheduler's limits over the worker's own cache shape and model."""
    return SchedulerConfig(
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
        max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
        enable_chunked_prefill=limits.enable_chunked_prefill,
        attention_horizon=info.attention_horizon if limits.attention_horizon is None else limits.attention_horizon,
        long_prefill_threshold=limits.long_prefill_threshold,
        itl_target=limits.itl_target, itl_patience_s=limits.itl_patience_s, tenant_wait_s=limits.tenant_wait_s,
        vocab_size=info.vocab_size,
        enable_prefix_caching=limits.enable_prefix_caching,
        speculative_tokens=info.speculative_tokens, speculative_adaptive=not info.speculative_fixed,
    )


class Membership:
    """The live workers by id, one WorkerSlot each."""

    def __init__(self, limits: PolicyLimits):
        self.limits = limits
        self.workers: dict[str, WorkerSlot] = {}
        self.adoptions = 0

    def add(self, info: WorkerInfo, epoch: int) -> WorkerSlot:
        """A worker joined (its stream already fenced by the service): a policy of its own for its blocks."""
        cfg = policy_config(self.limits, info)
        self.adoptions += 1
        policy = WorkerPolicy(cfg, info.worker_id, first_step_id=self.adoptions * STEP_IDS_PER_ADOPTION,
                              transfer_prefix=f"{epoch}-{self.adoptions}")
        slot = self.workers[info.worker_id] = WorkerSlot(info, policy, loras=AdapterRecency(info.max_loras))
        log.info("worker joined", worker_id=info.worker_id, model=info.model, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len,
                 attention_horizon=cfg.attention_horizon)
        return slot

    def lapsed(self, live: dict[str, WorkerInfo]) -> list[tuple[str, str]]:
        """(worker id, why) of every worker whose heartbeat lapsed, or that started a new life."""
        gone = []
        for wid, slot in self.workers.items():
            info = live.get(wid)
            if info is None or info.started_at != slot.info.started_at:
                # a new started_at: a new process, or a model that moved again after stalling past the step
                # deadline (its relay starts a new life); the old life's plans are void either way
                gone.append((wid, "heartbeat expired" if info is None else "new life (restarted or stalled)"))
        return gone

    def remove(self, wid: str) -> WorkerSlot:
        return self.workers.pop(wid)

    def staying(self) -> list[WorkerSlot]:
        """The workers not draining: the ones new sequences may go to."""
        return [s for s in self.workers.values() if not s.draining]

    def slots(self) -> list[WorkerSlot]:
        return list(self.workers.values())
