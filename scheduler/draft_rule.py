"""How many tokens a worker may speculate for each decode of a step: the adaptive rule, and the measured
acceptance it decides from. Pure: no I/O (docs/speculative.md says the rule and why it holds).

A verified draft costs what a token of a prefill chunk costs (1 + c / K budget units, and one more chunk on
the prefill path for a sequence's first draft), and brings a token only if it and every draft before it are
kept. With a per-draft acceptance a and the fraction f of verifications that had any draft, draft j of a
sequence is worth f * a^j expected tokens. Decoding alone, a step of T units brings N tokens (one per
decode). The rule adds drafts, best worth-per-cost first, while a draft's worth per unit beats the step's
N / T as it stands: each one then raises the step's expected tokens per unit of time, and the first that
would lower it stops the step. So speculation runs where a step's fixed cost dominates (few decodes, long
weights read: a draft is nearly free) and stops by itself when the batch is compute-bound (N / T near one
token's cost) or acceptance is low.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# acceptance before a sequence has been measured: half its drafts kept, weighing as PRIOR_TRIALS verifications
PRIOR_ACCEPTANCE = 0.5
PRIOR_TRIALS = 2.0
# each draft judged makes the counts before it weigh this much less: the estimate follows the latest ~10
DECAY = 0.9
# a step without speculation pulls a sequence's estimate this much toward the prior, so one that stopped
# for low acceptance is tried again after a while (its text may have turned repetitive)
RECOVERY = 0.98


@dataclass
class Acceptance:
    """One sequence's measured acceptance: per draft kept, and how often its worker had a draft at all."""

    kept: float = 0.0  # decayed drafts kept
    trials: float = 0.0  # decayed drafts judged: those kept, plus one for a run that ended on a rejection
    verifies: float = 0.0  # decayed verifications allowed
    proposed: float = 0.0  # decayed verifications that had a draft

    @property
    def rate(self) -> float:
        """Probability a draft is kept given the drafts before it were."""
        return (self.kept + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)

    @property
    def fill(self) -> float:
        """Fraction of verifications with a draft to verify."""
        return (self.proposed + 1.0) / (self.verifies + 1.0)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification the plan allowed: `drafted` proposed, `accepted` of them kept."""
        trials = accepted + (accepted < drafted)
        fade = DECAY ** max(trials, 1)  # per draft judged: a long kept run weighs as much as its drafts
        self.kept = self.kept * fade + accepted
        self.trials = self.trials * fade + trials
        self.verifies = self.verifies * DECAY + 1
        self.proposed = self.proposed * DECAY + (drafted > 0)

    def rest(self) -> None:
        """A step in which it decoded without speculation."""
        self.kept *= RECOVERY
        self.trials *= RECOVERY
        self.verifies *= RECOVERY
        self.proposed *= RECOVERY


# what a verification costs beyond its tokens before it is measured, in token-units: a sequence's drafts run
# as a chunk on the prefill path, one more attention call per layer than in the batched decode call
PRIOR_VERIFY_UNITS = 1.0
VERIFY_FADE = 0.95  # per step measured: the estimates follow the last ~20 steps


@dataclass
class VerifyCost:
    """The extra cost of a verification, learned from measured steps: a step's time beyond what the learned
    step costs predict for what it ran, in steps with verifications against steps without (whose residual is
    the prediction's own bias), per verification."""

    with_sum: float = 0.0  # faded sums over steps with verifications: residual seconds, steps, verifications
    with_steps: float = 0.0
    with_count: float = 0.0
    without_sum: float = 0.0  # faded sums over steps without: residual seconds, steps
    without_steps: float = 0.0
    token_s: float = 0.0  # the cost model's unit when last observed

    def observe(self, residual_s: float, verifications: int, token_s: float) -> None:
        self.token_s = token_s
        if verifications:
            self.with_sum = self.with_sum * VERIFY_FADE + residual_s
            self.with_steps = self.with_steps * VERIFY_FADE + 1
            self.with_count = self.with_count * VERIFY_FADE + verifications
        else:
            self.without_sum = self.without_sum * VERIFY_FADE + residual_s
            self.without_steps = self.without_steps * VERIFY_FADE + 1

    @property
    def units(self) -> float:
        """Token-units a verification adds beyond its tokens (the prior until some were measured)."""
        if self.with_count < 2 or self.token_s <= 0:
            return PRIOR_VERIFY_UNITS
        # residual = bias + verifications * cost: the bias from steps without any
        bias = self.without_sum / self.without_steps if self.without_steps >= 2 else 0.0
        per_verify = (self.with_sum - bias * self.with_steps) / self.with_count
        return max(per_verify / self.token_s, 0.0)


@dataclass(frozen=True)
class DraftCandidate:
    """A decode of this step that may speculate."""

    key: object
    position: int  # the decode's position: draft j sits at position + j
    max_drafts: int  # what its blocks, max_tokens and max_model_len allow
    rate: float  # Acceptance.rate
    fill: float  # Acceptance.fill


def token_units(position: int, horizon: float) -> float:
    """Budget units of one token at `position` (it attends to position + 1 keys)."""
    return 1.0 + (position + 1) / horizon if horizon > 0 else 1.0


def choose_drafts(candidates: list[DraftCandidate], *, step_units: float, step_tokens: float,
                  chunk_units: float, horizon: float, budget_units: float) -> dict[object, int]:
    """Drafts per candidate (only those > 0) for a step that would cost `step_units` (its fixed cost
    included) and bring `step_tokens` without speculation; drafts together cost at most `budget_units`."""
    heap: list[tuple[float, int, int]] = []  # (-worth per unit, candidate index, draft number)
    for i, c in enumerate(candidates):
        if c.max_drafts > 0 and c.rate > 0 and c.fill > 0:
            cost = token_units(c.position + 1, horizon) + chunk_units
            heapq.heappush(heap, (-c.fill * c.rate / cost, i, 1))
    chosen: dict[object, int] = {}
    units, tokens = step_units, step_tokens
    while heap and units > 0:
        neg, i, j = heapq.heappop(heap)
        c = candidates[i]
        cost = token_units(c.position + j, horizon) + (chunk_units if j == 1 else 0.0)
        worth = c.fill * c.rate ** j
        if worth / cost <= tokens / units or cost > budget_units:
            if cost > budget_units:
                continue  # a cheaper draft of another sequence may still fit
            break  # the best draft left lowers tokens per unit of step time: so would every other
        budget_units -= cost
        units += cost
        tokens += worth
        chosen[c.key] = j
        if j < c.max_drafts:
            nxt = token_units(c.position + j + 1, horizon)
            heapq.heappush(heap, (-c.fill * c.rate ** (j + 1) / nxt, i, j + 1))
    return chosen


def fixed_drafts(candidates: list[DraftCandidate]) -> dict[object, int]:
    """Adaptive off: every candidate gets all it may have."""
    return {c.key: c.max_drafts for c in candidates if c.max_drafts > 0}


