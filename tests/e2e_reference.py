"""What the in-process engine (no Redis, no HTTP) generates: the reference the service must equal."""

from __future__ import annotations

import re
import urllib.request

from phaseserve.params import SamplingParams

_engines: dict[tuple, object] = {}


def engine_texts(model_dir, prompts: list[str], max_tokens: int, **engine_kwargs) -> list[str]:
    """Greedy completions of `prompts` by phaseserve.stack.engine.Engine on the same model."""
    from phaseserve.stack.engine import Engine

    key = (str(model_dir), tuple(sorted(engine_kwargs.items())))
    if key not in _engines:
        _engines[key] = Engine(str(model_dir), **engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [c.text for c in _engines[key].generate(prompts, params)]


def metric(base_url: str, name: str) -> float:
    """One sample of the gateway's Prometheus /metrics, by (suffix of) its name."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^\w*{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"no metric {name!r} in /metrics:\n{text[:3000]}")
    return float(m.group(1))


def prompts(n: int) -> list[str]:
    """n different short prompts (different lengths too, so prefill chunks differ)."""
    subjects = ["The quick brown fox", "Hello world!", "Once upon a time", "Paged attention keeps",
                "A small language model", "The lazy dog", "Numbers like 0123", "There was a CPU"]
    return [f"{subjects[i % len(subjects)]}{' and more' * (i // len(subjects))}" for i in range(n)]
