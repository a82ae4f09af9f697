"""The in-process engine: the scheduler policy and the model runner in one process, no Redis.

The same `scheduler.policy.WorkerPolicy` and `workers.runner.ModelRunner` that the
services run, wired by a plain loop: schedule -> execute -> update. It is the
reference the service is tested and benchmarked against.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from phaseserve.params import SamplingParams
from phaseserve.wire import GrammarSpec, LoraRef, SubmitRequest
from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
from phaseserve.workers.runner import ModelRunner

log = structlog.get_logger(__name__)

_RUNNER_SETTINGS = ("dtype", "device", "block_size", "num_blocks", "kv_cache_memory_bytes", "max_model_len", "seed",
                    "num_threads", "quantization", "activation_quant", "speculative", "max_loras",
                    "max_lora_rank")
_SCHEDULER_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "watermark",
                       "attention_horizon", "long_prefill_threshold", "enable_prefix_caching")


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None  # per token [chosen_logprob, [[id, logprob], ...]] when asked for
    error: str | None = None
    offsets: list[int] = field(default_factory=list, repr=False)


class Engine:
    """`Engine(model_dir, **settings)`: runner settings (dtype, device, block_size, num_blocks,
    kv_cache_memory_bytes, max_model_len, seed, num_threads, quantization, activation_quant, speculative: a SpeculativeConfig, its
    dict or JSON, max_loras, max_lora_rank) and scheduler settings (max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
    watermark, long_prefill_threshold, enable_prefix_caching, attention_horizon: None or absent = the runner's
    estimate for the model, 0 = every token costs 1 budget unit)."""

    def __init__(self, model_dir: str | Path, **settings):
        unknown = set(settings) - set(_RUNNER_SETTINGS) - set(_SCHEDULER_SETTINGS)
        if unknown:
            raise TypeError(f"unknown Engine settings: {', '.join(sorted(unknown))}")
        self.runner = ModelRunner(model_dir, **{k: v for k, v in settings.items() if k in _RUNNER_SETTINGS})
        r = self.runner
        policy = {k: v for k, v in settings.items() if k in _SCHEDULER_SETTINGS}
        if policy.get("attention_horizon") is None:
            policy["attention_horizon"] = r.attention_horizon  # as the service does with WorkerInfo's
        spec = r.speculative
        self.scheduler = WorkerPolicy(SchedulerConfig(
            num_blocks=r.num_blocks, block_size=r.block_size, max_model_len=r.max_model_len,
            speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_adaptive=spec.adaptive if spec else True, **policy))
        self.tokenizer = None
        tok_path = Path(model_dir) / "tokenizer.json"
        if tok_path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tok_path))
        self._ids = itertools.count()
        self.num_steps = 0

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer.json in the model folder; pass token ids instead")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def generate(self, prompts: list[list[int]] | list[str],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 grammars: list[GrammarSpec | None] | None = None,
                 loras: list[LoraRef | None] | None = None) -> list[Completion]:
        """`grammars`: each prompt's structured-output constraint (phaseserve.grammar builds them), or None.
        `loras`: each prompt's LoRA adapter (None: the base model)."""
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.runner.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_model_len is {self.runner.max_model_len}")
            if max(p) >= self.runner.vocab_size or min(p) < 0:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.runner.vocab_size})")
        request_ids = [f"engine-{next(self._ids)}" for _ in ids]
        results = {rid: Completion([], "", None) for rid in request_ids}
        now = time.time()
        added = []
        try:
            for rid, p, sp, g, lora in zip(request_ids, ids, params, grammars or [None] * len(ids),
                                           loras or [None] * len(ids)):
                self.scheduler.add_request(SubmitRequest(rid, "local", p, sp.validate(), arrival_time=now,
                                                         grammar=g, lora=lora))
                added.append(rid)
        except Exception:
            for rid in added:  # all or nothing: no half-submitted batch left in the queue
                self.scheduler.cancel(rid)
            raise

        while self.scheduler.has_unfinished():
            plan = self.scheduler.schedule()
            if plan is None:
                raise RuntimeError("scheduler has unfinished sequences but planned nothing "
                                   "(a prompt too large for the KV cache?)")
            result = self.runner.execute(plan)
            self.num_steps += 1
            for ev in result.events:
                c = results.get(ev.seq_id)
                if c is None or ev.offset != len(c.token_ids):
                    continue  # the scheduler drops the same events (stale or duplicated)
                c.token_ids.extend(ev.token_ids)
                c.offsets.append(ev.offset)
                if ev.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + ev.logprobs
                if ev.finish_reason is not None:
                    c.finish_reason, c.error = ev.finish_reason, ev.error
            self.scheduler.update(result)
        tail = self.scheduler.schedule()  # send the last releases so the runner forgets finished sequences
        if tail is not None:
            self.scheduler.update(self.runner.execute(tail))  # settles the step, so none stays in flight
        out = [results[rid] for rid in request_ids]
        for c in out:
            c.text = self.decode(c.token_ids)
        return out
