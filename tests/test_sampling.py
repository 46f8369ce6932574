"""Sampling filters as pure functions."""

from __future__ import annotations

import pytest
import torch

from moe.generation import SamplingParams, left_pad, sample


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    assert sample(logits, SamplingParams(temperature=0), torch.Generator()).tolist() == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    got = sample(logits, SamplingParams(temperature=5.0, top_k=1), torch.Generator().manual_seed(1))
    assert got.tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_covering_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two only
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.6), g).item() for _ in range(200)}
    assert draws == {0, 1}


def test_left_pad_aligns_prompts_to_the_right():
    tokens, pad = left_pad([[5, 6, 7], [8]])
    assert tokens.tolist() == [[5, 6, 7], [0, 0, 8]] and pad.tolist() == [0, 2]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
