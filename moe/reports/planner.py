"""Plan a placement from measured expert loads: balance each block's load over ranks, optionally
replicating the hottest experts (as DeepSeek's EPLB does). Pure functions of a `[blocks, experts]` tensor.
"""

from __future__ import annotations

import math

import torch

from moe.parallel.placement import Placement
from moe.reports.expert_load import imbalance, rank_loads


def plan_block(loads_E: list[float], world_size: int, replicas: int) -> tuple[tuple[int, ...], ...]:
    """Ranks of each expert for one block.

    The `replicas` hottest experts get one extra replica each (on another rank), their load split evenly;
    then replicas go, heaviest first, to the least-loaded rank that has a free slot and does not already
    hold that expert (greedy LPT). Slots per rank are capped at ceil(replicas total / ranks) so memory
    stays balanced too.
    """
    E = len(loads_E)
    replicas = min(replicas, E, max(world_size - 1, 0) * E)
    hottest = sorted(range(E), key=lambda e: -loads_E[e])[:replicas]
    copies = {e: 2 if e in hottest else 1 for e in range(E)}
    items = sorted(((loads_E[e] / copies[e], e) for e in range(E) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    capacity = math.ceil(len(items) / world_size)
    load, slots = [0.0] * world_size, [0] * world_size
    holders: dict[int, list[int]] = {e: [] for e in range(E)}
    for share, e in items:
        candidates = [r for r in range(world_size) if slots[r] < capacity and r not in holders[e]]
        r = min(candidates, key=lambda r: (load[r], slots[r], r))
        holders[e].append(r)
        load[r] += share
        slots[r] += 1
    return tuple(tuple(sorted(holders[e])) for e in range(E))


def plan_placement(counts_LE: torch.Tensor, world_size: int, replicas: int = 0,
                   base: Placement | None = None, dense: tuple[int, ...] = ()) -> Placement:
    """Keep the block owners and strategies of `base` (default: balanced ranges); re-place the experts of every
    block whose experts are placed whole (experts split by `tensor` stay with their groups; `dense` blocks have
    none to place)."""
    L, E = counts_LE.shape
    base = base if base is not None and base.world_size == world_size else Placement.default(L, E, world_size)
    whole = set(base.whole_experts) - set(dense)
    experts = tuple(plan_block([float(x) for x in counts_LE[i].tolist()], world_size, replicas) if i in whole
                    else base.expert_ranks[i] for i in range(L))
    return Placement(world_size, base.embed_rank, base.block_ranks, base.head_rank, experts, base.blocks)


def predicted_imbalance(counts_LE: torch.Tensor, placement: Placement, dense: tuple[int, ...] = ()) -> float:
    """Mean over the blocks with experts of max/mean rank load: each block's exchange waits for its busiest rank."""
    per_block = rank_loads(counts_LE, placement)
    rows = [row for i, row in enumerate(per_block) if i not in dense]
    return sum(imbalance(row)["max_over_mean"] for row in rows) / max(len(rows), 1)
