"""The sampler as a function of logits: filters, penalties, per-row streams, packed log-probabilities."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from moe.generation import Sampler, SamplingParams, left_pad
from moe.generation.sampler import unpack_logprobs


def sample(logits: torch.Tensor, prompts=None, **params) -> torch.Tensor:
    rows = [SamplingParams(**params)] * logits.shape[0]
    return Sampler(rows, prompts or [[0]] * logits.shape[0], logits.shape[1], logits.device)(logits)[:, 0]


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    assert sample(logits, temperature=0).tolist() == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, temperature=5.0, top_k=1).tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_covering_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two only
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    draws = {sample(logits, temperature=1.0, top_p=0.6, seed=s).item() for s in range(200)}
    assert draws == {0, 1}


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {sample(logits, temperature=1.0, min_p=0.25, seed=s).item() for s in range(300)}
    assert draws == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = torch.tensor([sample(probs.log()[None], temperature=1.0, seed=s).item() for s in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert (freq - probs).abs().max() < 0.03


def test_a_rows_draw_depends_only_on_its_seed():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    rows = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9)]
    together = Sampler(rows, [[0]] * 3, 40, logits.device)(logits)[:, 0]
    alone = [Sampler([rows[b]], [[0]], 40, logits.device)(logits[b:b + 1])[0, 0] for b in range(3)]
    assert together.tolist() == [int(t) for t in alone]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.5, 1.0]])
    sampler = Sampler([SamplingParams(repetition_penalty=2.0)], [[0, 1]], 4, logits.device)
    assert sampler.penalise(logits).tolist() == [[1.0, -2.0, 1.5, 1.0]]
    assert sample(logits, prompts=[[0]], repetition_penalty=2.0).item() == 2


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 3)
    sampler = Sampler([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[2, 2]], 3, logits.device)
    sampler.update(torch.tensor([1]))
    sampler.update(torch.tensor([1]))
    assert sampler.penalise(logits).tolist() == [[0.0, -1.0, 0.0]]


def test_logprobs_are_the_raw_distributions():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    packed = Sampler([SamplingParams(logprobs=2, temperature=0, repetition_penalty=3.0)], [[1]], 4,
                     logits.device)(logits)[0].tolist()
    chosen, top = unpack_logprobs(packed[1:], 2)
    want = logits.log_softmax(-1)[0]
    assert packed[0] == 2  # the penalty moved the choice, not the reported distribution
    assert chosen == pytest.approx(want[2].item()) and [i for i, _ in top] == [1, 2]
    assert [v for _, v in top] == pytest.approx([want[1].item(), want[2].item()])


def test_left_pad_aligns_prompts_to_the_right():
    tokens, pad = left_pad([[5, 6, 7], [8]])
    assert tokens.tolist() == [[5, 6, 7], [0, 0, 8]] and pad.tolist() == [0, 2]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(min_p=1.5), dict(repetition_penalty=0), dict(presence_penalty=3),
                                 dict(frequency_penalty=-2.5), dict(seed=-1), dict(stop=[""]), dict(stop=[3]),
                                 dict(stop_token_ids=[-1]), dict(logprobs=21), dict(temperature=float("nan")),
                                 dict(ignore_eos=1), dict(max_tokens=0), dict(max_tokens=5, max_new_tokens=6),
                                 dict(seed="1")])
def test_bad_sampling_parameters_are_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_vllm_spellings_top_k_off_and_max_tokens():
    assert SamplingParams(top_k=-1).top_k == 0
    params = SamplingParams(temperature=0.8, max_tokens=32)
    assert params.max_new_tokens == 32 and params.seed is None  # vLLM's: a fresh seed
    assert dataclasses.replace(params, seed=1).max_new_tokens == 32
    assert pickle.loads(pickle.dumps(dataclasses.replace(params, max_new_tokens=5))).max_new_tokens == 5
