"""Decode's side-by-side products: same results as one after another, thread settings restored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import cpu_threads
from models.moe import GroupedExperts


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@torch.inference_mode()
def test_side_by_side_is_bit_identical_and_restores_threads(two_threads):
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(64, 96, list(range(6)))
    for p in experts.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(7, 64, generator=g)
    counts = torch.tensor([2, 0, 1, 3, 0, 1])
    head = torch.randn(5000, 64, generator=g)
    plain = experts(x, counts), F.linear(x[:2], head)
    with cpu_threads.side_by_side(torch.device("cpu")):
        assert torch.get_num_threads() == 1  # intra-op threads off; the pool does the parallel work
        side = experts(x, counts), cpu_threads.linear(x[:2], head)
    assert torch.get_num_threads() == 2
    assert torch.equal(plain[0], side[0]) and torch.equal(plain[1], side[1])


def test_jobs_come_back_in_order(two_threads):
    jobs = [lambda i=i: torch.full((1,), float(i)) for i in range(5)]
    with torch.inference_mode(), cpu_threads.side_by_side(torch.device("cpu")):
        out = cpu_threads.run_side_by_side(jobs)
    assert [int(t) for t in out] == [0, 1, 2, 3, 4]


def test_threads_are_restored_when_the_body_raises(two_threads):
    with pytest.raises(RuntimeError), cpu_threads.side_by_side(torch.device("cpu")):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
