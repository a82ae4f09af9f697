"""Sampling: seeded reproducibility, filters and penalties, logprobs."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.workers.runner import ModelRunner
from phaseserve.workers.sampler import SampleRow, Sampler, logit_bias_tensors, stop_id_tensor

PROMPTS = [[5, 9, 200, 31, 7], list(range(10, 50)), [300, 4]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return ModelRunner(make_model(tmp_path_factory.mktemp("samp"), "llama"), dtype="float32", num_blocks=128)


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, **kw})


def test_seeded_same_alone_in_batch_and_after_recompute(runner):
    params = [sampled(seed=1234), sampled(), sampled(seed=99, top_p=0.9)]
    alone = runner_driver.run(runner, [PROMPTS[0]], params[0])[0].outputs
    again = runner_driver.run(runner, [PROMPTS[0]], params[0], chunk_size=3)[0].outputs
    batch = runner_driver.run(runner, PROMPTS, params)
    assert alone == again == batch[0].outputs
    other_seed = runner_driver.run(runner, [PROMPTS[0]], sampled(seed=1235))[0].outputs
    assert other_seed != alone  # the seed matters (12 draws from a 320-token vocab)
    # a recompute restart: the first 5 outputs come back as output_ids; the rest must follow identically
    (resumed,) = runner_driver.run(runner, [PROMPTS[0]], params[0], output_ids=[alone[:5]])
    assert resumed.outputs == alone
    assert resumed.offsets == list(range(5, 12))


def test_unseeded_rows_differ(runner):
    a = runner_driver.run(runner, [PROMPTS[1]] * 2, sampled(max_tokens=16))
    assert a[0].outputs != a[1].outputs


def test_top_k_1_is_greedy(runner):
    greedy = runner_driver.run(runner, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    topk1 = runner_driver.run(runner, PROMPTS, sampled(max_tokens=10, top_k=1))
    tiny_p = runner_driver.run(runner, PROMPTS, sampled(max_tokens=10, top_p=1e-6))
    assert [s.outputs for s in greedy] == [s.outputs for s in topk1] == [s.outputs for s in tiny_p]


def test_repetition_penalty_changes_a_repeated_greedy_token():
    V = 8
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, -1.0]])
    s = Sampler(V, seed=0)
    row = lambda **kw: SampleRow(SamplingParams(temperature=0, **kw), 1, [1, 7, 1], 2, frozenset())
    assert s(logits, [row()]).token_ids == [1]
    assert s(logits, [row(repetition_penalty=1.5)]).token_ids == [2]  # 3.0 / 1.5 < 2.9
    assert s(logits, [row(frequency_penalty=0.2)]).token_ids == [2]  # token 1 was output once
    assert s(logits, [row(presence_penalty=0.2)]).token_ids == [2]
    # a prompt-only token: repetition penalty applies, frequency does not
    prompt_only = SampleRow(SamplingParams(temperature=0, frequency_penalty=2.0), 0, [1], 1, frozenset())
    assert s(logits, [prompt_only]).token_ids == [1]
    # penalised and plain rows in one batch
    assert s(logits.repeat(2, 1), [row(repetition_penalty=1.5), row()]).token_ids == [2, 1]


def test_min_p_and_top_k_restrict_support():
    V = 6
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01, 0.0 + 1e-9]]))
    s = Sampler(V, seed=0)
    rows = lambda **kw: [SampleRow(SamplingParams(seed=i, **kw), 0, [], 0, frozenset()) for i in range(200)]
    draws = s(logits.repeat(200, 1), rows(min_p=0.5)).token_ids  # keeps p >= 0.25: tokens 0, 1
    assert set(draws) == {0, 1}
    draws = s(logits.repeat(200, 1), rows(top_k=3)).token_ids
    assert set(draws) == {0, 1, 2}
    draws = s(logits.repeat(200, 1), rows()).token_ids
    assert draws.count(0) > draws.count(1) > draws.count(2)


def test_logprobs_match_transformers(tmp_path, runner):
    hf = AutoModelForCausalLM.from_pretrained(make_model(tmp_path, "llama"), dtype=torch.float32).eval()
    (s,) = runner_driver.run(runner, [PROMPTS[1]], sampled(max_tokens=6, logprobs=5, seed=3, temperature=0.7))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPTS[1] + s.outputs])).logits[0].float(), -1)
    for i, (chosen, top) in enumerate(s.logprobs):
        row = ref[len(PROMPTS[1]) - 1 + i]
        assert chosen == pytest.approx(row[s.outputs[i]].item(), abs=1e-4)
        ids = [t for t, _ in top]
        assert ids == row.topk(5).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
    (g,) = runner_driver.run(runner, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, logprobs=0))
    assert all(len(top) == 0 for _, top in g.logprobs)


def test_bf16_logits_sample_exactly_as_their_fp32_copy():
    """The runner hands the sampler the lm_head's bf16 logits: every path (greedy by argmax, penalties,
    min_tokens, seeded and unseeded draws, logprobs) gives what the fp32 copy of those logits gives."""
    V = 1000
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, V, generator=g) * 4).round().bfloat16()  # few values: ties for argmax
    history = list(range(3, 40))
    greedy = dict(temperature=0, max_tokens=50)
    params = [
        SamplingParams(**greedy), SamplingParams(**greedy, logprobs=3),
        SamplingParams(**greedy, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(**greedy, min_tokens=5, stop_token_ids=[int(logits[3].float().argmax())]),
        sampled(seed=11, top_k=50), sampled(seed=12, top_p=0.8, logprobs=2), sampled(min_p=0.1),
    ]
    rows = [SampleRow(p, 2, history, len(history) - 2, frozenset(p.stop_token_ids)) for p in params]
    for batch in (rows[:2], rows[:4], rows):  # all-greedy batches (the argmax path) and a mixed one
        n = len(batch)
        got, want = Sampler(V, seed=0)(logits[:n], batch), Sampler(V, seed=0)(logits[:n].float(), batch)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    # the min_tokens row really had its top token masked, the penalised row still picks a real token
    assert got.token_ids[3] != int(logits[3].float().argmax())


def test_a_tiny_temperature_samples_greedy_not_nan():
    """logits / 1e-35 overflow to inf and their softmax to NaN: below vLLM's 1e-5 a temperature is greedy."""
    V = 1000
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 5
    want = logits.argmax(dim=1).tolist()
    for temperature in (1e-6, 1e-31, 1e-40, 5e-324):
        tiny = SampleRow(sampled(temperature=temperature, seed=1), 0, [], 0, frozenset())
        plain = SampleRow(sampled(seed=2), 0, [], 0, frozenset())
        # alone (the all-greedy path) and beside a sampled row (the sampling kernel's path)
        assert Sampler(V, seed=0)(logits[:1], [tiny]).token_ids == want[:1]
        got = Sampler(V, seed=0)(logits[:2], [tiny, plain]).token_ids
        assert got[0] == want[0], temperature


def _min_tokens_step_seconds(rows: list[SampleRow], logits: torch.Tensor, repeats: int = 15) -> float:
    sampler = Sampler(logits.shape[1], seed=0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler(logits, rows)
        best = min(best, time.perf_counter() - t0)
    return best


def test_a_long_stop_list_costs_a_min_tokens_step_little_beyond_a_plain_one(runner):
    """The min_tokens mask indexes with a tensor each sequence built once (the runner's SequenceState), not a
    list of (row, id) pairs rebuilt on every step; the step's cost is compared with the same step's without
    a stop list, on the same machine."""
    V, B = 32000, 16
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))
    stops = frozenset(range(7, 7 + 1024))  # the gateway's cap of stop_token_ids
    plain = [SampleRow(sampled(seed=i, min_tokens=4), 0, [1, 2], 2, frozenset({2})) for i in range(B)]
    long = [SampleRow(sampled(seed=i, min_tokens=4), 0, [1, 2], 2, stops, stop_id_tensor(stops, V))
            for i in range(B)]
    out = Sampler(V, seed=0)(logits, long).token_ids
    assert not set(out) & stops  # the mask is applied
    base = _min_tokens_step_seconds(plain, logits)
    assert _min_tokens_step_seconds(long, logits) < 2 * base
    # the runner builds each sequence's stop tensor once, when the sequence starts
    (s,) = runner_driver.run(runner, [PROMPTS[0]], sampled(max_tokens=6, min_tokens=4, seed=1,
                                                             stop_token_ids=list(range(0, 300))))
    assert len(s.outputs) >= 4 and not set(s.outputs[:4]) & set(range(300))


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled_leaving_logprobs_raw():
    """+100 makes a token the only choice, -100 takes one out, in greedy, seeded and unseeded rows of one
    batch beside an unbiased row; logprobs stay those of the raw distribution (as OpenAI's and vLLM's)."""
    V = 50
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7)) * 3
    top = logits.argmax(dim=1).tolist()
    forced, s = 17, Sampler(V, seed=0)
    assert forced not in top[:3]

    def row(bias, **kw) -> SampleRow:
        return SampleRow(SamplingParams(logit_bias=bias, logprobs=1, **kw), 0, [], 0, frozenset())

    out = s(logits, [row({forced: 100.0}, temperature=0), row({forced: 100}, seed=3), row({forced: 100.0}),
                     row({})])
    assert out.token_ids[:3] == [forced] * 3
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0][0] == pytest.approx(raw[0, forced].item(), abs=1e-5)
    # banned: greedy moves off its argmax, and 200 sampled draws of the same row never hit it
    assert s(logits[:1], [row({top[0]: -100.0}, temperature=0)]).token_ids != [top[0]]
    draws = s(logits[:1].repeat(200, 1), [row({top[0]: -100.0}, seed=i) for i in range(200)]).token_ids
    assert top[0] not in draws
    # the bias a row carries (built once by its owner) is what the sampler adds; ids past the vocabulary ignored
    ids, values = logit_bias_tensors({forced: 100.0, V + 5: 100.0}, V)
    assert ids.tolist() == [forced] and values.tolist() == [100.0]
    prebuilt = SampleRow(SamplingParams(temperature=0, logit_bias={forced: 100.0}), 0, [], 0, frozenset(),
                         bias=(torch.tensor([3]), torch.tensor([100.0])))
    assert s(logits[:1], [prebuilt]).token_ids == [3]
