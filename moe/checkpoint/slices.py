"""Whole tensors from the slices that tensor-parallel ranks hold, for a save that writes an ordinary checkpoint.

Each split parameter (`model.slices`, see `moe.parallel.tensor`) is reassembled on one of the ranks holding a
slice of it, chosen round-robin over the parameters so that no rank gathers much more than its own share; the
others send their slices to it point to point. A slice several ranks hold alike (a KV head replicated over a
group) is sent once.
"""

from __future__ import annotations

import torch

from moe.checkpoint.formats import is_stacked_expert
from moe.parallel.distributed import DistContext

Key = tuple[str, tuple[int, ...]]  # (parameter, the global ids of its stacked experts; () for other parameters)


def reassemble(model: torch.nn.Module, ctx: DistContext, dense) -> dict[str, torch.Tensor]:
    """Collective. {parameter: whole tensor (CPU)} for the split parameters this rank writes. `dense(model, name)`
    gives this rank's slice of a parameter as a plain CPU tensor."""
    slices = getattr(model, "slices", {})
    mine = {(name, _expert_ids(model, name)): part for name, part in slices.items()}
    holders: dict[Key, dict[tuple[int, int], int]] = {}  # (start, stop) -> the lowest rank holding that slice
    for rank, theirs in enumerate(ctx.all_gather_object(mine)):
        for key, (_, start, stop) in theirs.items():
            holders.setdefault(key, {}).setdefault((start, stop), rank)
    out = {}
    for n, key in enumerate(sorted(holders)):  # the same order on every rank
        sources = sorted(holders[key].items())  # by start
        writer = sources[n % len(sources)][1]
        if ctx.rank not in [r for _, r in sources]:  # the writer is one of them
            continue
        name = key[0]
        local = dense(model, name)
        if ctx.rank != writer:
            ctx.send(local.to(ctx.device), writer)
            continue
        dim = slices[name][0] + (1 if is_stacked_expert(name) else 0)  # a stacked tensor's dim 0 is the expert
        parts = []
        for (start, stop), rank in sources:
            if rank == ctx.rank:
                parts.append(local)
            else:
                shape = list(local.shape)
                shape[dim] = stop - start
                parts.append(ctx.recv(tuple(shape), local.dtype, rank).cpu())
        out[name] = torch.cat(parts, dim=dim)
    return out


def _expert_ids(model: torch.nn.Module, name: str) -> tuple[int, ...]:
    if not is_stacked_expert(name):
        return ()
    return tuple(model.get_submodule(name.rsplit(".", 1)[0]).expert_ids)
