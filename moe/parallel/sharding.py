"""Apply a placement to a finished single-device model, as gpt-fast's `apply_tp` or torchtitan's
`apply_moe_ep_tp` do: drop what this rank does not hold, slice the experts, swap in the dispatcher.

Works on a meta-device `Transformer` before loading, so the loader reads exactly this rank's tensors;
parameter names stay global (`layers.17.*` on the rank that holds block 17).
"""

from __future__ import annotations

import torch

from models.mixture import GroupedExperts
from models.transformer import Transformer
from moe.parallel.dispatch import AllToAllDispatcher, SlotTable
from moe.parallel.distributed import DistContext
from moe.parallel.gather import ExchangeDispatcher, StepRows
from moe.parallel.placement import Placement


def apply_placement(model: Transformer, placement: Placement, rank: int) -> None:
    """Layer placement: keep the embedding, blocks (attention, norms, router) and head this rank owns."""
    if rank != placement.embed_rank:
        model.tok_embeddings = None
    if rank != placement.head_rank:
        model.norm, model.output = None, None
    for name, block in model.layers.items():
        if placement.block_ranks[int(name)] != rank:
            block.attention_norm = block.attention = block.ffn_norm = None
            block.feed_forward.gate = None
    apply_expert_placement(model, placement, rank)


def apply_expert_placement(model: Transformer, placement: Placement, rank: int,
                           device: torch.device | str = "meta") -> None:
    """Keep only this rank's experts of every block (new, uninitialised, on `device`)."""
    cfg = model.cfg
    for name, block in model.layers.items():
        held = placement.local_experts(int(name), rank)
        with torch.device(device):
            block.feed_forward.experts = GroupedExperts(cfg.dim, cfg.hidden_dim, held)


def use_all_to_all(model: Transformer, placement: Placement, dist: DistContext, step: StepRows | None = None) -> None:
    """Route every block's token copies to the ranks holding their experts: always by all-to-all (training),
    or, given the engine's `step`, by gathering when a step is small (`moe.parallel.gather`)."""
    for name, block in model.layers.items():
        table = SlotTable(placement.expert_ranks[int(name)], placement.world_size).to(dist.device)
        block.feed_forward.dispatcher = (AllToAllDispatcher(table, dist) if step is None
                                         else ExchangeDispatcher(table, dist, step))
