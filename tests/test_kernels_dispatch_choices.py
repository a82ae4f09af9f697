"""kernels/dispatch/choices.py: the one cache of the dispatch's choices. A choice resolves once per key and is
read after that; pin and pinned fix it (pinned puts back what was there, or nothing); reset forgets every
choice; and the dispatch's own choices live there (CHOICES.reset makes an op family decide afresh)."""

import torch

from phaseserve import kernels
from phaseserve.kernels.dispatch.choices import CHOICES, Choice, DispatchChoices
from phaseserve.kernels.dispatch.layer_ops import LAYER_OPS


def counting_choice(calls: list) -> Choice:
    def resolve(key):
        calls.append(key)
        return f"ops for {key}"

    return Choice("counted", resolve)


def test_a_choice_resolves_once_per_key():
    calls, choices = [], DispatchChoices()
    choice = counting_choice(calls)
    assert choices.get(choice, "a") == "ops for a" and choices.get(choice, "a") == "ops for a"
    assert choices.get(choice, "b") == "ops for b"
    assert calls == ["a", "b"]
    choices.reset()
    assert choices.get(choice, "a") == "ops for a" and calls == ["a", "b", "a"]


def test_two_choices_with_the_same_key_are_kept_apart():
    calls, choices = [], DispatchChoices()
    first, second = counting_choice(calls), counting_choice(calls)
    choices.pin(first, None, "pinned")
    assert choices.get(first) == "pinned" and choices.get(second) == "ops for None" and calls == [None]


def test_pinned_puts_back_what_was_there_or_nothing():
    calls, choices = [], DispatchChoices()
    choice = counting_choice(calls)
    with choices.pinned(choice, "a", None):  # None: torch
        assert choices.get(choice, "a") is None
    assert choices.get(choice, "a") == "ops for a" and calls == ["a"]  # resolved afresh: it was never resolved
    with choices.pinned(choice, "a", "other"):
        assert choices.get(choice, "a") == "other"
    assert choices.get(choice, "a") == "ops for a" and calls == ["a"]  # the resolved one back, not re-resolved


def test_the_dispatch_reads_its_choices_from_the_one_cache(fresh_dispatch):
    x = torch.randn(3, 64)
    weight = torch.randn(64)
    fresh_dispatch.pin(LAYER_OPS, torch.float32, None)  # torch, whatever this CPU runs
    out, _ = kernels.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, kernels.reference.rms_norm(x, weight, 1e-5)[0])
    assert CHOICES.get(LAYER_OPS, torch.float32) is None
    CHOICES.reset()
    # a dtype no native layer op takes: decided as torch, and kept
    assert CHOICES.get(LAYER_OPS, torch.float16) is None
