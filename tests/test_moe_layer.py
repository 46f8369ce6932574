"""The grouped expert path against a naive per-expert oracle; router and grouping index math by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.mixture import (
    Dispatched,
    GroupedExperts,
    MoEFeedForward,
    group_by_expert,
    stable_ranks,
    weighted_sum,
)
from models.router import Router
from tests.checkpoints import tiny_config


def naive_moe(x_TD, weights_TK, ids_TK, experts: GroupedExperts):
    """Token by token, copy by copy: the definition of the layer."""
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for j in range(ids_TK.shape[1]):
            e = ids_TK[t, j]
            h = F.silu(experts.w1[e] @ x_TD[t]) * (experts.w3[e] @ x_TD[t])
            out[t] += weights_TK[t, j] * (experts.w2[e] @ h)
    return out


def filled_layer(cfg, seed=0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer


@pytest.mark.parametrize("experts,k", [(4, 2), (8, 3), (3, 1), (5, 5)])
def test_grouped_path_equals_naive_loop(experts, k):
    layer = filled_layer(tiny_config(n_experts=experts, top_k=k))
    x = torch.randn(37, 64)
    with torch.no_grad():
        weights, ids = layer.gate(x)
        assert torch.allclose(layer(x), naive_moe(x, weights, ids, layer.experts), atol=1e-5)


def test_router_matches_mixtral_softmax_then_renormalise():
    router = Router(64, 8, 2)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(20, 64)
    weights, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, want_ids = torch.topk(probs, 2, dim=-1)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True), atol=1e-6)
    assert weights.dtype == torch.float32


def test_grouping_by_hand():
    ids = torch.tensor([[2, 0], [1, 2], [0, 2]])  # copies: 0:e2 1:e0 2:e1 3:e2 4:e0 5:e2
    g = group_by_expert(ids, 4)
    assert g.order_N.tolist() == [1, 4, 2, 0, 3, 5]
    assert g.token_N.tolist() == [0, 2, 1, 0, 1, 2]
    assert g.counts_E.tolist() == [2, 1, 3, 0]


def test_ranks_by_comparison_are_the_stable_sort():
    gen = torch.Generator().manual_seed(0)
    for n, experts in ((1, 8), (2, 8), (6, 4), (16, 8), (64, 3)):  # 64 copies of 3 ids: many ties
        ids = torch.randint(0, experts, (n,), generator=gen)
        order, rank = stable_ranks(ids)
        assert torch.equal(order, torch.sort(ids, stable=True).indices), ids
        assert torch.equal(order[rank], torch.arange(n))  # rank is order's inverse


def test_a_compiled_grouping_equals_the_sorted_one():
    ids = torch.tensor([[2, 0], [1, 2], [0, 2]])
    want = group_by_expert(ids, 4)
    got = torch.compile(lambda i: group_by_expert(i, 4), fullgraph=True, backend="eager")(ids)
    assert got.rank_N is not None and want.rank_N is None  # compiled: comparisons, no sort
    assert torch.equal(got.order_N, want.order_N) and torch.equal(got.token_N, want.token_N)
    assert torch.equal(got.counts_E, want.counts_E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_gathered_weighted_sum_has_the_scattered_bits(dtype, top_k):
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(5)])  # 5 tokens
    g = group_by_expert(ids, 8)
    _, rank = stable_ranks(ids.reshape(-1))
    y = (torch.randn(ids.numel(), 32, generator=gen) * 100).to(dtype)
    meta = Dispatched(g.token_N, torch.rand(ids.numel(), generator=gen), 5)
    scattered = weighted_sum(y, meta)
    assert torch.equal(weighted_sum(y, meta, rank), scattered)
    assert not torch.equal(weighted_sum(y, meta, rank.flip(0)), scattered)  # the gather follows the ranks


def test_round_robin_routing_gives_exact_counts():
    layer = filled_layer(tiny_config(n_experts=4, top_k=2))
    layer.gate.round_robin = True
    with torch.no_grad():
        layer(torch.randn(10, 64))
    assert layer.load_counts[0].tolist() == [5, 5, 5, 5]
    assert layer.load_counts.sum().item() == 10 * 2


def test_experts_without_tokens_do_not_run():
    layer = filled_layer(tiny_config(n_experts=4, top_k=1))
    layer.gate.round_robin = True  # 2 tokens -> experts 0 and 1 only
    with torch.no_grad():
        layer.experts.w1[2:] = float("nan")  # would poison the output if experts 2, 3 ran
        out = layer(torch.randn(2, 64))
    assert torch.isfinite(out).all()


def test_all_to_all_dispatcher_in_one_process_equals_the_local_one():
    """The distributed context's one-process stand-in runs the cross-rank dispatcher without spawning ranks:
    with one rank it must give the local dispatcher's answer exactly."""
    from moe.parallel.dispatch import AllToAllDispatcher, SlotTable
    from moe.parallel.distributed import single_process

    layer = filled_layer(tiny_config(n_experts=4, top_k=2))
    x = torch.randn(23, 64)
    with torch.no_grad():
        want = layer(x)
        layer.dispatcher = AllToAllDispatcher(SlotTable(((0,), (0,), (0,), (0,)), world_size=1), single_process())
        got = layer(x)
        weights, ids = layer.gate(x)
        rows, counts, meta = layer.dispatcher.dispatch(x, weights, ids)
    assert torch.equal(got, want)
    assert counts == torch.bincount(ids.reshape(-1), minlength=4).tolist()  # rows per local expert, on the host
    assert meta.sent_R == meta.received_R == [23 * 2] and rows.shape == (46, 64)
