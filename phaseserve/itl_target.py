"""The ITL target setting (`--itl-target`): its value type and parser, shared by the settings table and the
scheduler's step budget (scheduler/budget.py; docs/architecture.md, "The step budget"; scheduler/step_cost.py
learns the costs it bounds)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ItlTarget:
    """The bound on a step's predicted time while streams decode: `ratio` times the predicted pure-decode
    step at the step's batch, or `ms` milliseconds; neither: off."""

    ratio: float | None = None
    ms: float | None = None

    @property
    def is_off(self) -> bool:
        return self.ratio is None and self.ms is None

    def __str__(self) -> str:
        if self.ratio is not None:
            return f"{self.ratio:g}x"
        if self.ms is not None:
            return f"{self.ms:g}ms"
        return "off"


_TARGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(x|ms)\s*$", re.IGNORECASE)


def parse_itl_target(text: str | ItlTarget) -> ItlTarget:
    """'1.5x' (ratio > 1), '80ms' (> 0) or 'off'; a clear error otherwise."""
    if isinstance(text, ItlTarget):
        return text
    s = str(text).strip().lower()
    if s in ("off", "none", "0"):
        return ItlTarget()
    m = _TARGET.match(s)
    if not m:
        raise ValueError(f"ITL target {text!r}: expected a ratio like 1.5x, milliseconds like 80ms, or off")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "x":
        if not value > 1.0:
            raise ValueError(f"ITL target {text!r}: a ratio must be > 1 (1x would leave no time for prefill)")
        return ItlTarget(ratio=value)
    if not value > 0:
        raise ValueError(f"ITL target {text!r}: milliseconds must be > 0")
    return ItlTarget(ms=value)
