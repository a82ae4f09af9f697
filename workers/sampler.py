"""From a step's logits to one token per sampling row: penalties, then kernels.sample.

Randomness: kernels.sample takes Exponential(1) noise. For a row with a `seed`
the noise is a pure function of (seed, output offset), so a seeded request
draws the same tokens alone, in any batch, and after a recompute restart.
Rows without a seed share one batched draw.

Logprobs come from the raw model distribution (before penalties, logit_bias
and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseserve import kernels
from phaseserve.params import SamplingParams

_MASK64 = (1 << 64) - 1


def seed_for(seed: int, offset: int) -> int:
    """A well-mixed 63-bit generator seed for output `offset` of a request seeded with `seed`
    (splitmix64 finalizer, so nearby (seed, offset) pairs give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + offset * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    offset: int  # index of the token being sampled in the sequence's output
    token_ids: list[int]  # prompt + outputs so far (not copied: only penalties read it)
    prompt_len: int
    stop_ids: frozenset[int]  # eos + stop_token_ids: masked while min_tokens is not reached
    # stop_ids as a tensor (stop_id_tensor), built once per sequence by its owner, not on every step
    stop_tensor: torch.Tensor | None = None
    # params.logit_bias as (ids, values) tensors (logit_bias_tensors), likewise built once per sequence
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # a constrained sequence: bool [V], True where its grammar forbids the token (phaseserve.grammar)
    disallowed: torch.Tensor | None = None

    def stop_id_tensor(self, vocab_size: int) -> torch.Tensor:
        return self.stop_tensor if self.stop_tensor is not None else stop_id_tensor(self.stop_ids, vocab_size)

    def bias_tensors(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bias if self.bias is not None else logit_bias_tensors(self.params.logit_bias, vocab_size)


def stop_id_tensor(stop_ids: frozenset[int], vocab_size: int) -> torch.Tensor:
    """The in-vocabulary ids of a stop set as an int64 tensor (what the min_tokens mask indexes with)."""
    return torch.tensor(sorted(t for t in stop_ids if 0 <= t < vocab_size), dtype=torch.int64)


def logit_bias_tensors(logit_bias: dict[int, float], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias's in-vocabulary entries as (int64 ids, fp32 values) tensors (what the sampler adds)."""
    items = sorted((t, b) for t, b in logit_bias.items() if 0 <= t < vocab_size)
    return (torch.tensor([t for t, _ in items], dtype=torch.int64),
            torch.tensor([b for _, b in items], dtype=torch.float32))


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[list | None]  # per row: None, or [chosen_logprob, [[id, logprob], ...top-N]]


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def _penalize(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Repetition (prompt + output tokens, vLLM/HF rule), frequency and presence (output tokens)
        penalties, logit_bias, the grammar's mask and min_tokens masking, for the rows that ask for them: fp32
        logits then (a copy), else `logits` itself (any dtype)."""
        idx = [i for i, r in enumerate(rows)
               if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty != 0.0
               or r.params.presence_penalty != 0.0]
        if idx:
            V = logits.shape[1]
            sub = [rows[i] for i in idx]
            out_counts = _counts([r.token_ids[r.prompt_len:] for r in sub], V, logits.device)
            prompt_seen = _counts([r.token_ids[:r.prompt_len] for r in sub], V, logits.device) > 0
            dev = logits.device
            rep = torch.tensor([r.params.repetition_penalty for r in sub], device=dev).unsqueeze(1)
            freq = torch.tensor([r.params.frequency_penalty for r in sub], device=dev).unsqueeze(1)
            pres = torch.tensor([r.params.presence_penalty for r in sub], device=dev).unsqueeze(1)
            sel = torch.tensor(idx, device=dev)
            logits = logits.float()
            x = logits[sel]
            seen = prompt_seen | (out_counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - freq * out_counts - pres * (out_counts > 0).float()
            logits = logits.index_copy(0, sel, x)
        biased = [(i, r.bias_tensors(self.vocab_size)) for i, r in enumerate(rows) if r.params.logit_bias]
        if biased:
            ri = torch.repeat_interleave(torch.tensor([i for i, _ in biased]),
                                         torch.tensor([len(ids) for _, (ids, _) in biased]))
            dev = logits.device
            ti, values = torch.cat([ids for _, (ids, _) in biased]), torch.cat([v for _, (_, v) in biased])
            # not in place: `logits` may still be the raw tensor the logprobs are taken from
            logits = logits.float().index_put((ri.to(dev), ti.to(dev)), values.to(dev), accumulate=True)
        constrained = [i for i, r in enumerate(rows) if r.disallowed is not None]
        if constrained:  # after the penalties, before temperature and top-k/p: the grammar has the last word
            dev = logits.device
            if not (idx or biased):  # still the caller's tensor (logprobs read it): mask a float copy
                logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            if len(constrained) == len(rows):  # in place, one pass
                logits.masked_fill_(torch.stack([r.disallowed for r in rows]).to(dev), float("-inf"))
            else:
                sel = torch.tensor(constrained, device=dev)
                forbid = torch.stack([rows[i].disallowed for i in constrained]).to(dev)
                logits[sel] = logits[sel].masked_fill_(forbid, float("-inf"))
        masked = [(i, r.stop_id_tensor(self.vocab_size)) for i, r in enumerate(rows)
                  if r.offset < r.params.min_tokens and r.stop_ids]
        masked = [(i, ids) for i, ids in masked if len(ids)]
        if masked:
            ti = torch.cat([ids for _, ids in masked])
            ri = torch.repeat_interleave(torch.tensor([i for i, _ in masked]),
                                         torch.tensor([len(ids) for _, ids in masked]))
            dev = logits.device
            logits = logits.float().index_put((ri.to(dev), ti.to(dev)), torch.tensor(float("-inf"), device=dev))
        return logits

    def _noise(self, rows: list[SampleRow], V: int, device) -> torch.Tensor:
        """Exponential(1) noise [len(rows), V] as -log(U): several times faster than Tensor.exponential_ on
        CPU. U in [0, 1) never gives 0 noise, so p / noise is never
        0 / 0; U == 0 gives inf noise, a token that cannot win that draw (p = 2^-24 each)."""
        noise = torch.empty(len(rows), V)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            torch.rand(len(rows), V, generator=self.generator, out=noise)
        elif unseeded:
            noise[unseeded] = torch.rand(len(unseeded), V, generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed(seed_for(r.params.seed, r.offset))
                noise[i].uniform_(generator=g)
        return noise.log_().neg_().to(device)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        """logits [B, V] in fp32 or the model's dtype (bf16 logits upcast to fp32 exactly, so every result
        is the one of their fp32 copy)."""
        B, V = logits.shape
        dev = logits.device
        raw = logits
        logits = self._penalize(logits, rows)
        p = [r.params for r in rows]
        if all(x.greedy for x in p):
            # greedy rows need neither noise nor the sort in sample(); the argmax of bf16 logits is the
            # argmax of their fp32 copy, without making that copy
            tokens = kernels.argmax(logits)
        else:
            # 0 selects the kernels' greedy path (a tiny temperature would overflow the logits to NaN)
            temperature = torch.tensor([0.0 if x.greedy else x.temperature for x in p], dtype=torch.float32,
                                       device=dev)
            top_k = torch.tensor([x.top_k for x in p], dtype=torch.int64, device=dev)
            top_p = torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev)
            min_p = torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev)
            tokens = kernels.sample(logits.float(), temperature, top_k, top_p, min_p, self._noise(rows, V, dev))
        token_list = tokens.tolist()
        return SampleOutput(token_list, self._logprobs(raw, rows, tokens, token_list))

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor, token_list: list[int]):
        out: list[list | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return out
        sel = torch.tensor(want, device=raw.device)
        lp = torch.log_softmax(raw[sel].float(), dim=-1)
        chosen = lp.gather(1, tokens[sel].unsqueeze(1)).squeeze(1).tolist()
        n_top = max(rows[i].params.logprobs for i in want)
        top_v, top_i = (lp.topk(n_top, dim=-1) if n_top else (lp[:, :0], lp[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            out[i] = [chosen[j], [[top_i[j][m], top_v[j][m]] for m in range(n)]]
        return out


def _counts(seqs: list[list[int]], V: int, device) -> torch.Tensor:
    """[len(seqs), V] float counts of each token id per row, by one scatter_add over a padded id tensor."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), V + 1, device=device)
    if width:
        ids = torch.full((len(seqs), width), V, dtype=torch.int64)  # pad id V lands in a dropped column
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :V]
