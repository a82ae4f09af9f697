"""Tokens/s and TTFT / ITL percentiles over the last minute, from the gateway's own Prometheus histograms.

Nothing is recorded per token for this: the histograms and the token counter that /metrics exports are
sampled (cumulative) every so often, and the last minute is the difference between the newest sample and
the oldest one still inside the window. A percentile is read from the bucket counts by linear interpolation
inside the bucket, as Prometheus' histogram_quantile does, so it is as fine as the buckets are.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class Cumulative:
    """One sample of the cumulative counts: per-bucket (not cumulative over buckets) counts, +Inf last."""

    at: float  # monotonic seconds
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    tokens: float


def bucket_counts(histogram) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(upper bounds, count per bucket) of a prometheus_client histogram (a labelled child works too)."""
    bounds, cumulative = [], []
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bounds.append(float(s.labels["le"]))
                cumulative.append(s.value)
    counts = [c - p for c, p in zip(cumulative, [0.0] + cumulative[:-1])]
    return tuple(bounds), tuple(counts)


def counter_value(counter) -> float:
    """A prometheus_client counter's total (a labelled child works too)."""
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


def quantile(bounds: tuple[float, ...], counts: tuple[float, ...], q: float) -> float | None:
    """The q-quantile of observations counted per bucket (None: no observation). The +Inf bucket answers
    with the highest finite bound, as histogram_quantile does."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound, n in zip(bounds, counts):
        if n > 0 and below + n >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / n
        below += n
        if not math.isinf(bound):
            lower = bound
    return lower


class LatencyWindow:
    """Samples of the cumulative counts, the last WINDOW_S seconds of them (and one older, as the baseline)."""

    def __init__(self, ttft_bounds: tuple[float, ...], itl_bounds: tuple[float, ...], window_s: float = WINDOW_S):
        self.ttft_bounds, self.itl_bounds, self.window_s = ttft_bounds, itl_bounds, window_s
        self.samples: deque[Cumulative] = deque()

    def add(self, sample: Cumulative) -> None:
        self.samples.append(sample)
        # keep one sample at or before the window's start: the baseline the differences are taken from
        while len(self.samples) > 2 and self.samples[1].at <= sample.at - self.window_s:
            self.samples.popleft()

    def summary(self) -> dict:
        """{"window_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "requests"}; a
        percentile is None with nothing observed in the window."""
        if len(self.samples) < 2:
            return {"window_s": 0.0, "tokens_per_s": None, "ttft_p50_s": None, "ttft_p99_s": None,
                    "itl_p50_s": None, "itl_p99_s": None, "requests": 0}
        old, new = self.samples[0], self.samples[-1]
        span = new.at - old.at
        ttft = tuple(b - a for a, b in zip(old.ttft, new.ttft))
        itl = tuple(b - a for a, b in zip(old.itl, new.itl))
        return {"window_s": round(span, 3), "tokens_per_s": (new.tokens - old.tokens) / span if span > 0 else None,
                "ttft_p50_s": quantile(self.ttft_bounds, ttft, 0.5),
                "ttft_p99_s": quantile(self.ttft_bounds, ttft, 0.99),
                "itl_p50_s": quantile(self.itl_bounds, itl, 0.5), "itl_p99_s": quantile(self.itl_bounds, itl, 0.99),
                "requests": int(sum(ttft))}
