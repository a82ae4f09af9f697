"""What the runner holds for one sequence between steps: its tokens, how far its KV is written, and what its
sampling needs built once (stop ids, logit bias, its grammar matcher, its LoRA adapter)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phaseserve.params import SamplingParams
from phaseserve.wire import LoraRef, SeqStart
from phaseserve.workers.preparation import Preparation
from phaseserve.workers.sampler import logit_bias_tensors, stop_id_tensor


@dataclass
class SequenceState:
    seq_id: str
    gateway_id: str
    params: SamplingParams
    prompt_len: int
    token_ids: list[int]  # prompt + outputs
    finished: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    stop_tensor: torch.Tensor | None = None  # stop_ids for the sampler's min_tokens mask, built once
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # params.logit_bias for the sampler, built once
    # positions whose KV this worker wrote: a chunk must start here, else a plan between was lost
    num_computed: int = 0
    cached_tokens: int = 0  # prompt positions the scheduler's prefix cache had: told with the first token
    # positions its first chunk reads from cached blocks, checked against the blocks written in this process
    unchecked_cached: int = 0
    # a constrained sequence's matcher, built on a grammar thread (its result a GrammarMatcher once done)
    matcher: Preparation | None = None
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model)

    @classmethod
    def started(cls, s: SeqStart, eos_token_ids: frozenset[int], vocab_size: int,
                matcher: Preparation | None) -> SequenceState:
        """The state a plan's SeqStart opens (its outputs so far count as tokens: a recompute or a handoff)."""
        params = s.params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        return cls(
            s.seq_id, s.gateway_id, params, len(s.prompt_ids), list(s.prompt_ids) + list(s.output_ids),
            stop_ids=stop_ids,
            stop_tensor=stop_id_tensor(stop_ids, vocab_size) if params.min_tokens else None,
            bias=logit_bias_tensors(params.logit_bias, vocab_size) if params.logit_bias else None,
            num_computed=s.num_cached, cached_tokens=s.cached_tokens,
            unchecked_cached=s.num_cached if s.cached_tokens else 0, matcher=matcher, lora=s.lora)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len
