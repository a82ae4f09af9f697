"""The dispatch's one cache: every implementation choice it makes, resolved once per process and key (a dtype,
a shape, a packed weight's class, or nothing) and logged then.

Each kind of decision is a `Choice` with the function that resolves it; `CHOICES` holds what each resolved
to. Tests and benchmarks that compare implementations `pin` a choice (None: torch) and `reset` them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from phaseserve.kernels import native

log = structlog.get_logger("kernels")


@dataclass(frozen=True, eq=False)  # hashed by identity: a choice is one of the module-level constants below
class Choice:
    """One kind of decision the dispatch makes: `resolve(key)` gives what serves `key` (the loaded native ops,
    an overload of them, a number), or None where torch runs."""

    name: str
    resolve: Callable[[Any], Any]


class DispatchChoices:
    """What every `Choice` resolved to, per key: the first call for a key resolves it, later calls read it."""

    def __init__(self) -> None:
        self._resolved: dict[tuple[Choice, Any], Any] = {}

    def get(self, choice: Choice, key: Any = None) -> Any:
        try:  # the hot path: every op call of every layer reads its choice here
            return self._resolved[choice, key]
        except KeyError:
            value = self._resolved[choice, key] = choice.resolve(key)
            return value

    def pin(self, choice: Choice, key: Any, value: Any) -> None:
        """Fix `choice` for `key` to `value` (None: torch) instead of resolving it."""
        self._resolved[choice, key] = value

    @contextlib.contextmanager
    def pinned(self, choice: Choice, key: Any, value: Any) -> Iterator[None]:
        """`pin` within the block, then the choice as it was (resolved afresh where it was not yet)."""
        missing = object()
        before = self._resolved.get((choice, key), missing)
        self.pin(choice, key, value)
        try:
            yield
        finally:
            if before is missing:
                self._resolved.pop((choice, key), None)
            else:
                self._resolved[choice, key] = before

    def reset(self) -> None:
        """Forget every choice: each resolves again on its next use (tests changing the CPU level or the
        native switch)."""
        self._resolved.clear()


CHOICES = DispatchChoices()


def implementation(source: str | None) -> str:
    """What a log line calls the implementation: "native <the CPU level the file needs>", or "torch"."""
    return "torch" if source is None else f"native {native.REQUIRES[source]}"


def load_native(source: str | None, event: str, *, why_not: str | None = None, fallback: str = "torch",
                wrap: Callable[[Any], Any] | None = None, **fields) -> Any:
    """The loaded native ops of kernels/native/<source>.cpp (passed through `wrap`, when given), or None
    (torch), with the one log line saying which implementation runs. `why_not`, when set, says why no native
    op can serve the call, and nothing is loaded."""
    ops, reason = None, why_not
    if why_not is None:
        ops = native.load(source)
        if ops is None:
            reason = ("turned off (PHASESERVE_NATIVE=0)" if not native.enabled()
                      else "native op unavailable (see the log line above)")
    log.info(event, implementation=implementation(source) if ops is not None else fallback, reason=reason,
             **fields)
    return None if ops is None else wrap(ops) if wrap else ops


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_vector_floats(_key: None) -> int:
    return {"AVX512": 32, "AVX2": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


TORCH_VECTOR_FLOATS = Choice("torch's vector floats", _torch_vector_floats)


def torch_vector_floats() -> int:
    """Floats per step of torch's vectorized CPU loops (two vectors of the capability its kernels run at): its
    fp32 silu computes exp with Sleef inside those steps and with the C library's expf past the last whole
    one, and layer_ops_f32's silu_and_mul does the same to stay bit-identical."""
    return CHOICES.get(TORCH_VECTOR_FLOATS)


def triton_ops():
    """kernels/triton_ops.py, imported on first use: CPU-only installs never load triton."""
    from phaseserve.kernels import triton_ops as ops

    return ops
