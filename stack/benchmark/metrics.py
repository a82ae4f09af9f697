"""Per-request results and the summary metrics, defined exactly as `vllm bench serve` defines them.

Source of the definitions: vllm/benchmarks/serve.py (calculate_metrics) and
vllm/benchmarks/lib/endpoint_request_func.py (vLLM 0.32):
- TTFT: request sent -> first streamed chunk that carries `choices`.
- ITL: the gaps between successive such chunks (a chunk may hold several tokens).
- E2E latency: request sent -> last chunk that carries `choices` (the trailing usage chunk is not a token).
- TPOT: (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  for goodput a request with <= 1 output token counts TPOT as 0.
- output_tokens: the server's `usage.completion_tokens` (stream_options.include_usage); when the
  server sends no usage, we count the chunks that carried `choices` (vLLM re-tokenizes the text instead,
  which overcounts random-token output; one chunk per token is what OpenAI-style servers stream).
- Throughputs divide by the wall time of the whole run; goodput counts requests meeting every SLO.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured (times in seconds, perf_counter clock)."""

    group: str = "main"
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    error: str = ""
    request_id: str = ""  # the server's X-Request-Id (phaseserve: its sequences are "<id>-<n>")
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache supplied, when it says
    generated_text: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("generated_text")
        d["itl"] = [round(x, 6) for x in self.itl]  # microseconds are plenty; keeps result files small
        return d


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}; got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def _stats(name: str, values_s: list[float], percentiles) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0  # vLLM reports 0 for an empty list
    out = {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
        f"max_{name}_ms": float(arr.max()),  # not in vLLM's report; the one stall a p99 can hide
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      goodput: dict[str, float] | None = None,
                      percentiles=DEFAULT_PERCENTILES) -> dict:
    """Summary of `results` over a run of `duration_s` seconds, with vLLM's field names."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in results if r.success]
    output_lens = [r.output_tokens for r in ok]
    total_input = sum(r.prompt_len for r in ok)
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)

    good = len(ok)
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(
            all(per_metric[k][i] <= slo_ms / 1000.0 for k, slo_ms in goodput.items())
            for i in range(len(ok))
        )
    m = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": sum(output_lens),
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (good / duration_s) if goodput else None,
        "output_throughput": sum(output_lens) / duration_s,
        "total_token_throughput": (total_input + sum(output_lens)) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values, percentiles))
    return m


def format_report(title: str, m: dict, percentiles=DEFAULT_PERCENTILES) -> str:
    """A text block like vLLM's console summary."""
    rows = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
    ]
    if m.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    rows += [("Output token throughput (tok/s)", m["output_throughput"]),
             ("Total token throughput (tok/s)", m["total_token_throughput"])]
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    lines = [f"{' ' + title + ' ':=^60}"]
    for k, v in rows:
        lines.append(f"{k + ':':<42}{v:>12.2f}" if isinstance(v, float) else f"{k + ':':<42}{v:>12}")
    for key, label in names.items():
        if f"mean_{key}_ms" not in m:
            continue
        lines.append(f"{' ' + label + ' ':-^60}")
        lines.append(f"{'Mean ' + key.upper() + ' (ms):':<42}{m[f'mean_{key}_ms']:>12.2f}")
        for p in percentiles:
            lines.append(f"{f'P{p:g} ' + key.upper() + ' (ms):':<42}{m[f'p{p:g}_{key}_ms']:>12.2f}")
        if f"max_{key}_ms" in m:
            lines.append(f"{'Max ' + key.upper() + ' (ms):':<42}{m[f'max_{key}_ms']:>12.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
