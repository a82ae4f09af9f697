"""What a setting is and how its values are read: the Setting record and the argparse value parsers
(sizes, booleans, the ITL target, LoRA modules, the speculative config). The table of every setting is
phaseserve/settings.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from phaseserve.itl_target import ItlTarget, parse_itl_target
from phaseserve.lora import parse_lora_module
from phaseserve.speculative_config import SpeculativeConfig, parse_speculative_config


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    for unit, mult in units.items():
        if s.lower().endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s))


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def parse_itl_target_arg(text: str | ItlTarget) -> ItlTarget:
    try:
        return parse_itl_target(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def lora_module_arg(text: str) -> str:
    """One --lora-modules value, checked (`name=path` or vLLM's JSON form) and kept as given."""
    try:
        parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_speculative_config_arg(text: str) -> SpeculativeConfig | None:
    try:
        return parse_speculative_config(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name; flag is --name-with-dashes
    env: str
    default: Any
    type: Callable[[str], Any]
    help: str
    services: tuple[str, ...]  # which services read it: gateway, scheduler, worker, up, bench
    choices: tuple | None = None
    # `up` hands it to its children in their environment, not on their command lines (which every local
    # user can read in /proc/<pid>/cmdline)
    secret: bool = False
    # takes several values (vLLM's `--lora-modules a=PATH b=PATH`, or the flag repeated; whitespace-separated
    # in the environment variable): a list
    repeatable: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")
