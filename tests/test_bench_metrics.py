"""The benchmark's summary metrics follow `vllm bench serve`'s definitions exactly."""

import numpy as np
import pytest

from phaseserve.stack.benchmark.loadgen import arrival_delays
from phaseserve.stack.benchmark.metrics import RequestResult, calculate_metrics, parse_goodput


def req(ttft, latency, n_out, itl, prompt_len=10, success=True):
    return RequestResult(success=success, prompt_len=prompt_len, output_tokens=n_out, ttft=ttft,
                         latency=latency, itl=itl)


def test_tpot_itl_e2e_and_throughput_definitions():
    results = [
        req(0.100, 0.500, 5, [0.1, 0.1, 0.1, 0.1]),        # TPOT (0.5-0.1)/4 = 0.1
        req(0.200, 0.800, 4, [0.3, 0.2, 0.1]),             # TPOT 0.6/3 = 0.2
        req(0.050, 0.050, 1, []),                          # one token: no TPOT sample
        req(9.0, 9.0, 0, [], prompt_len=99, success=False),  # failed: counted nowhere but `failed`
    ]
    m = calculate_metrics(results, duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(20.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)  # mean of 100 and 200; the 1-token request is left out
    assert m["mean_ttft_ms"] == pytest.approx((100 + 200 + 50) / 3)
    itls = [0.1] * 4 + [0.3, 0.2, 0.1]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls) * 1000)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99) * 1000)
    assert m["median_e2el_ms"] == pytest.approx(500.0)
    assert m["p90_e2el_ms"] == pytest.approx(np.percentile([500, 800, 50], 90))
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = [req(0.1, 0.5, 5, []), req(0.3, 0.5, 5, []), req(0.1, 2.1, 5, []), req(0.1, 0.1, 1, [])]
    # TPOTs: 0.1, 0.05, 0.5, 0 (one token counts as 0 for goodput, as in vLLM)
    m = calculate_metrics(results, 1.0, goodput=parse_goodput(["ttft:200", "tpot:150"]))
    assert m["request_goodput"] == pytest.approx(2.0)  # the 1st and the 4th
    m = calculate_metrics(results, 1.0, goodput={"e2el": 500.0})
    assert m["request_goodput"] == pytest.approx(3.0)


def test_no_successful_request_reports_zeros_like_vllm():
    m = calculate_metrics([req(0, 0, 0, [], success=False)], 1.0)
    assert m["completed"] == 0 and m["p99_ttft_ms"] == 0.0 and m["output_throughput"] == 0.0


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:abc", "tpot:-1"])
def test_bad_goodput_spec_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_poisson_arrivals_have_the_requested_rate_and_are_seeded():
    d = arrival_delays(4000, request_rate=20.0, burstiness=1.0, seed=3)
    assert d.mean() == pytest.approx(1 / 20, rel=0.05)
    assert d.std() == pytest.approx(1 / 20, rel=0.08)  # exponential: std == mean
    assert np.array_equal(d, arrival_delays(4000, 20.0, 1.0, seed=3))
    assert not arrival_delays(5, float("inf"), 1.0, 0).any()
    with pytest.raises(ValueError):
        arrival_delays(5, 0.0, 1.0, 0)
