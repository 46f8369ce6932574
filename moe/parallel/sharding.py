"""Apply a placement to a finished single-device model, as gpt-fast's `apply_tp` or torchtitan's
`apply_moe_ep_tp` do: drop what this rank does not hold, slice what it holds a part of, swap in the dispatchers.

Works on a meta-device `Transformer` before loading, so the loader reads exactly this rank's tensors (or slices,
`moe.parallel.tensor`); parameter names stay global (`layers.17.*` on the rank that holds block 17).
"""

from __future__ import annotations

import torch

from models.mixture import GroupedExperts
from models.transformer import Transformer
from moe.parallel.dispatch import AllToAllDispatcher, SlotTable
from moe.parallel.distributed import DistContext
from moe.parallel.gather import ExchangeDispatcher, StepRows
from moe.parallel.placement import Placement
from moe.parallel.tensor import (
    TensorDispatcher,
    VocabSlice,
    reduce_attention_output,
    split_attention,
    split_embedding,
    split_experts,
    split_shared,
)


def apply_placement(model: Transformer, placement: Placement, rank: int) -> None:
    """Keep the embedding, attention (whole or this rank's heads), norms, routers and head this rank runs."""
    if not placement.replicated:  # replicated attention: every rank runs the whole dense model on its rows
        if rank not in placement.embed_ranks:
            model.tok_embeddings = None
        elif len(placement.embed_ranks) > 1:
            split_embedding(model, placement.embed_ranks, rank)
        if rank != placement.head_rank:
            model.norm, model.output = None, None
    for name, block in model.layers.items():
        s = placement.strategy(int(name))
        if rank not in s.attention_ranks:
            block.attention_norm = block.attention = None
        elif s.attention == "tensor":
            split_attention(model, name, s.attention_ranks, rank)
        # The router and its norm run where the block's tokens enter its experts: on every rank of a group that
        # splits them locally, else on the rank that brings the tokens to the exchange.
        group = s.expert_groups[0] if s.local_tensor_experts else ()
        if not (rank in group or rank == s.leader or s.attention == "replicated"):
            block.ffn_norm = block.feed_forward.gate = None
            block.feed_forward.shared = block.feed_forward.shared_gate = None
        block.feed_forward.counts_load = rank == (group[0] if group else s.leader) or s.attention == "replicated"
        if rank in group and block.feed_forward.shared is not None and not block.feed_forward.dense:
            split_shared(model, name, group, rank)
    apply_expert_placement(model, placement, rank)


def apply_expert_placement(model: Transformer, placement: Placement, rank: int,
                           device: torch.device | str = "meta") -> None:
    """Keep only this rank's experts of every block (new, uninitialised, on `device`), or its slices of them."""
    cfg = model.cfg
    for name, block in model.layers.items():
        i = int(name)
        if block.feed_forward.dense:
            continue  # no routed experts: its MLP runs where the block's tokens are
        held = placement.local_experts(i, rank)
        s = placement.strategy(i)
        group = next((g for g in s.expert_groups if rank in g), None)
        if group is not None:  # experts split by `tensor` over this rank's group
            split_experts(model, name, group, rank, held, device)
        else:
            with torch.device(device):
                block.feed_forward.experts = GroupedExperts.of(cfg, held)


def connect_ranks(model: Transformer, placement: Placement, dist: DistContext, step: StepRows | None = None) -> None:
    """Collective (makes the process groups of tensor-parallel groups). Each block's attention output summed over
    its tensor group; its experts reached by an all-reduce over the group that splits them, or by the exchange:
    always by all-to-all (training), or, given the engine's `step`, by gathering when a step is small
    (`moe.parallel.gather`)."""
    strategies = [placement.strategy(int(name)) for name in model.layers]
    dist.make_groups([s.attention_ranks for s in strategies if s.attention == "tensor"]
                     + [s.expert_groups[0] for s in strategies if s.local_tensor_experts])
    if isinstance(model.tok_embeddings, VocabSlice):
        model.tok_embeddings.dist = dist
    for (name, block), s in zip(model.layers.items(), strategies, strict=True):
        if s.attention == "tensor" and dist.rank in s.attention_ranks:
            reduce_attention_output(model, name, s.attention_ranks, dist)
        block.feed_forward.counts_received = True
        if s.experts == "layer" or block.feed_forward.dense:  # the experts (or a dense MLP) where the tokens are
            continue
        if s.local_tensor_experts:
            block.feed_forward.dispatcher = TensorDispatcher(model.cfg.n_experts, s.expert_groups[0], dist)
            continue
        table = SlotTable(placement.expert_ranks[int(name)], placement.world_size, split=s.experts == "tensor")
        table = table.to(dist.device)
        block.feed_forward.dispatcher = (AllToAllDispatcher(table, dist) if step is None
                                         else ExchangeDispatcher(table, dist, step))
