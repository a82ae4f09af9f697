"""One worker policy's settings, and why a request can never be admitted under them. No I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from phaseserve.kv_admission import DEFAULT_WATERMARK
from phaseserve.scheduler.step_cost import ItlTarget


class AdmissionError(ValueError):
    """A request that can never be admitted as given: its prompt + max_tokens does not fit the worker's
    max_model_len or KV cache, or its prompt holds a token id outside the model's vocabulary. Bad input,
    not a scheduler fault (the service tells the gateway so)."""


def out_of_vocab(token_ids: list[int], vocab_size: int) -> str | None:
    """Why `token_ids` cannot be fed to a model of `vocab_size` tokens, or None (vocab_size 0: unknown)."""
    if vocab_size <= 0:
        return None
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if not bad:
        return None
    return f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048  # must equal the worker's: the scheduler plans no decode past it
    enable_chunked_prefill: bool = True
    watermark: float = DEFAULT_WATERMARK  # fraction of blocks kept free when admitting
    # K: a token attending to c keys costs 1 + c / K budget units (0 = off: 1 unit a token); the worker
    # estimates K from its model's shape (WorkerInfo.attention_horizon)
    attention_horizon: int = 0
    # T: the prefill chunks of prompts longer than T tokens take at most T budget units of a step
    # together (0 = no cap); docs/architecture.md, "The step budget"
    long_prefill_threshold: int = 256
    # the bound on a step's predicted time while streams decode (docs/architecture.md, "The step budget");
    # it applies once the service has learned the worker's step costs (WorkerPolicy.step_costs)
    itl_target: ItlTarget = field(default_factory=ItlTarget)
    # the most predicted step time the ITL target may hold a long prompt's prefill back, from its start: past
    # it the prompt prefills under max_num_batched_tokens and the long cap alone. A quarter of the gateway's
    # default progress timeout: beside few decodes the target's room is a few tokens a step, and long prompts
    # queued behind one another would otherwise go that timeout without a chunk
    itl_patience_s: float = 15.0
    # tenants: for this much predicted step time after a tenant's streams stop decoding (a chat between its
    # turns, an agent between its calls), steps with no decode keep the ITL target's bound of one stream
    # while another tenant has work, so the next turn does not wait behind that tenant's long prefill steps
    # planned in the pause (scheduler/tenant_planner.py). 0: off
    paused_stream_s: float = 0.1
    # tenants: once two tenants have used the worker, long prompts' chunks keep a step with no decode within
    # this much predicted time and are not pipelined behind another plan, so another tenant's new request
    # waits about this at most for work already sent (StepBudget.hold_long_cap). 0: the long cap alone
    tenant_wait_s: float = 0.1
    # token ids a prompt may hold: [0, vocab_size) (WorkerInfo.vocab_size); 0 = unknown, not checked
    vocab_size: int = 0
    # share the cached KV blocks of prompts' common prefixes (scheduler/kv_cache_manager.py)
    enable_prefix_caching: bool = True
    # speculative decoding: the most drafts a decode may verify (the worker's WorkerInfo.speculative_tokens;
    # 0 = off), and whether the policy chooses fewer per step by acceptance and step cost
    speculative_tokens: int = 0
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence's decode must fit in one step, or decode-first cannot hold
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if not isinstance(self.attention_horizon, int) or self.attention_horizon < 0:
            raise ValueError(f"SchedulerConfig.attention_horizon must be an integer >= 0, got "
                             f"{self.attention_horizon!r}")
        if not isinstance(self.long_prefill_threshold, int) or self.long_prefill_threshold < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_threshold!r}")
        for name in ("itl_patience_s", "paused_stream_s", "tenant_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SchedulerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"SchedulerConfig.watermark must be in [0, 1), got {self.watermark!r}")
