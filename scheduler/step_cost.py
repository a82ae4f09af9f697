"""A worker's step time learned from its measured steps, and the operator's ITL target. No I/O.

Model: a step of `tokens` tokens (decodes + prefill chunk tokens) whose queries attend to `keys` keys in
all (a token at position p attends to p + 1 keys) takes

    t = overhead_s + token_s * tokens + key_s * keys + prefill_chunk_s * prefill_chunks

seconds: the weights read once a step (and the step's fixed costs), the linear layers' work per token,
attention's per key, and what each prefill chunk adds beyond its tokens (its own attention call and
masks: a step carrying one costs more than its tokens say). It maps onto the policy's budget units
(scheduler/budget.py): one unit is `token_s` seconds and the attention horizon K is
token_s / key_s, so a chunk's `chunk_cost` times `token_s` is its predicted time (plus `prefill_chunk_s`
for a prefill chunk), and the fixed part is `overhead_s / token_s` units.

`StepCostModel` fits the four coefficients to the last `window` steps by weighted least squares, the
weights decaying with age (half-life `half_life` steps) so it follows a machine whose speed changes,
and reweighted twice by Huber's rule so a step slowed by something else (another process, a page fault)
barely moves it. A weak prior (a few pseudo-steps at `prior`) settles what the data cannot tell apart
(at a constant batch the fixed cost and the per-token cost are one number); no coefficient goes below 0.
It skips a worker's first `warmup` steps (lazy initialisation), fits from `min_samples` on (until then
`costs` is None and the policy uses its token budget alone), and refits every `refit_every` steps (every 4
in the first 4 x `refit_every`; a few small numpy solves), so the per-step cost is mostly a ring-buffer
write.

`ItlTarget` is the operator's bound (`--itl-target`): a ratio of the predicted pure-decode step at the
current batch (`1.3x`, the default) or milliseconds (`80ms`); `off` turns it off. The service keeps a second
`StepCostModel` of a worker's decode-only steps alone for that ratio's baseline (scheduler/budget.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from phaseserve.itl_target import ItlTarget, parse_itl_target  # noqa: F401 -- the setting's type, re-exported

# Huber's constant (in robust standard deviations) and the IRLS passes
HUBER_K = 1.5
IRLS_PASSES = 2
NUM_COEFS = 4  # overhead, per token, per key, per prefill chunk
MIN_HORIZON = 8  # keys: a fit whose attention costs as much as the linears below this is not believed
RATIO_SMOOTHING = 0.02  # of the prediction-error averages (about the last 50 steps)


@dataclass(frozen=True)
class StepCosts:
    """The fitted coefficients: seconds a step, per token, per attended key."""

    overhead_s: float
    token_s: float
    key_s: float
    prefill_chunk_s: float = 0.0

    def predict(self, tokens: float, keys: float, prefill_chunks: int = 0) -> float:
        return self.overhead_s + self.token_s * tokens + self.key_s * keys + self.prefill_chunk_s * prefill_chunks

    @property
    def horizon(self) -> float:
        """K in budget units (a key costs 1 / K of a token); 0 when attention is free (1 unit a token)."""
        if self.key_s <= 0 or self.token_s <= 0:
            return 0.0
        return self.token_s / self.key_s

    @property
    def is_plausible(self) -> bool:
        """A step has a fixed cost and a token costs time, and attention equals the linears only past
        MIN_HORIZON keys: a fit that puts everything on one column (the data at one batch cannot tell them
        apart) would make the policy's units absurd."""
        return (self.overhead_s > 0 and self.token_s > 0
                and (self.key_s == 0 or self.token_s / self.key_s >= MIN_HORIZON))

    @property
    def overhead_units(self) -> float:
        return self.overhead_s / self.token_s

    @property
    def prefill_chunk_units(self) -> float:
        return self.prefill_chunk_s / self.token_s


# Before any step is measured: a prior of a small CPU model's step (a fixed cost plus a cost a token), with
# attention equal to the linears at a context of 2,048. Only its shape matters once there is data (it
# weighs as PRIOR_WEIGHT steps).
DEFAULT_PRIOR = StepCosts(overhead_s=5e-3, token_s=2e-4, key_s=2e-4 / 2048)
PRIOR_WEIGHT = 2.0


class StepCostModel:
    """Online robust fit of `StepCosts` to measured (tokens, keys, seconds) of one worker's steps."""

    def __init__(self, prior: StepCosts = DEFAULT_PRIOR, *, window: int = 512, half_life: float = 256.0,
                 refit_every: int = 32, min_samples: int = 48, warmup: int = 8):
        if window < 4 or half_life <= 0 or refit_every < 1 or min_samples < 1 or warmup < 0:
            raise ValueError("StepCostModel: window >= 4, half_life > 0, refit_every >= 1, min_samples >= 1, "
                             "warmup >= 0")
        self.prior = prior
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        # a worker's first steps run lazy initialisation (allocations, kernel selection) and cost many
        # times a later one: fitted, they make the first costs absurd and hold prefill back
        self._warmup_left = warmup
        self._decay = 0.5 ** (1.0 / half_life)
        self._x = np.zeros((window, NUM_COEFS))
        self._y = np.zeros(window)
        self._n = 0  # samples seen (the ring holds min(n, window))
        self._since_fit = 0
        self._costs: StepCosts | None = None
        # how well the fit predicts (measured / predicted, moving averages): steps that carry prefill,
        # and decode-only steps (one token a chunk)
        self.prefill_ratio = self.decode_ratio = 1.0

    @property
    def num_samples(self) -> int:
        return self._n

    @property
    def costs(self) -> StepCosts | None:
        """The current fit; None until `min_samples` steps are measured (the policy then uses its token
        budget alone)."""
        return self._costs

    def expected_bound(self, tokens: int, keys: int, prefill_chunks: int = 0) -> float | None:
        """What a step like this is expected to take, for its deadline: its predicted time, or while no fit
        is plausible (a worker whose steps all look alike: the columns cannot be told apart, yet its steps
        are known) the longest step measured in the window. None until `min_samples` steps are measured: a
        worker warming up has no bound yet."""
        if self._n < self.min_samples:
            return None
        if self._costs is None:
            return float(self._y[:min(self._n, self.window)].max())
        return self._costs.predict(tokens, keys, prefill_chunks)

    def observe(self, tokens: int, keys: int, seconds: float, prefill_chunks: int = 0) -> None:
        if not (seconds > 0 and math.isfinite(seconds)) or tokens <= 0:
            return  # a failed or empty step says nothing about the cost of work
        if self._warmup_left:
            self._warmup_left -= 1
            return
        if self._costs is not None:
            ratio = seconds / max(self._costs.predict(tokens, keys, prefill_chunks), 1e-9)
            if prefill_chunks:
                self.prefill_ratio += RATIO_SMOOTHING * (ratio - self.prefill_ratio)
            else:
                self.decode_ratio += RATIO_SMOOTHING * (ratio - self.decode_ratio)
        i = self._n % self.window
        self._x[i] = (1.0, tokens, keys, prefill_chunks)
        self._y[i] = seconds
        self._n += 1
        self._since_fit += 1
        # early on every few steps: the first fit sees the warm-up steps, and the costs matter from the start
        every = self.refit_every if self._n >= 4 * self.refit_every else min(4, self.refit_every)
        # at the cadence even while no fit is plausible: steps that all look alike (decode-only steps at one
        # batch) stay implausible, and refitting each of them would put the fit on every result's path
        if self._n == self.min_samples or (self._n > self.min_samples and self._since_fit >= every):
            fit = self.fit()
            self._since_fit = 0
            if fit.is_plausible:  # else keep the last plausible fit (or none: the token budget alone)
                self._costs = fit

    def fit(self) -> StepCosts:
        m = min(self._n, self.window)
        newest = (self._n - 1) % self.window
        age = (newest - np.arange(m)) % self.window if m == self.window else (m - 1 - np.arange(m))
        # columns scaled to a typical step's size: well-conditioned normal equations, and the prior's
        # pseudo-steps weigh alike
        scale = np.array([1.0, max(1.0, float(np.median(self._x[:m, 1]))),
                          max(1.0, float(np.median(self._x[:m, 2]))), 1.0])
        x, y = self._x[:m] / scale, self._y[:m]
        w = self._decay ** age
        p = self.prior
        prior_coef = np.array([p.overhead_s, p.token_s, p.key_s, p.prefill_chunk_s]) * scale
        robust = np.ones(m)
        coef = prior_coef
        for _ in range(IRLS_PASSES + 1):
            wr = w * robust
            # the prior as pseudo-steps on the diagonal: one per coefficient, at its prior value
            gram = (x * wr[:, None]).T @ x + PRIOR_WEIGHT * np.eye(NUM_COEFS)
            rhs = (x * wr[:, None]).T @ y + PRIOR_WEIGHT * prior_coef
            coef = _nonnegative_solve(gram, rhs)
            resid = np.abs(y - x @ coef)
            sigma = 1.4826 * float(np.median(resid)) + 1e-12
            robust = np.minimum(1.0, HUBER_K * sigma / np.maximum(resid, 1e-15))
        coef = coef / scale
        return StepCosts(*(float(v) for v in coef))


def _nonnegative_solve(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """The least-squares solution from its normal equations with every coefficient >= 0: drop the most
    negative one and solve again (an active set over four coefficients; at most four small solves)."""
    free = list(range(len(rhs)))
    coef = np.zeros(len(rhs))
    while free:
        sol = np.linalg.solve(gram[np.ix_(free, free)], rhs[free])
        if (sol >= 0).all():
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef


def step_deadline(expected_s: float | None, *, floor_s: float, factor: float, fallback_s: float) -> float:
    """Seconds a step may take once due before its worker counts as frozen: `factor` times what it is
    expected to take (StepCostModel.expected_bound), never below `floor_s` (a slow step on a busy machine is
    not a frozen one) nor above `fallback_s` (the fixed --step-timeout). Until the worker's costs are
    learned (its first steps, which may still compile or warm up) and with factor 0, `fallback_s`."""
    if expected_s is None or factor <= 0:
        return fallback_s
    return min(fallback_s, max(floor_s, factor * expected_s))
