"""Expert parallelism: the dispatcher that sends token copies to the ranks holding their experts.

Shapes: T tokens at this rank, K top-k, N = T*K copies, D model dim, R ranks, M = most expert slots
any rank holds in this block. A *slot* is one replica of one expert on one rank; its global id is
`rank * M + local index`, so sorting copies by slot groups them by destination rank, then by expert.

Per block and step, on every rank, in the same order (invariant "lock-step collectives"): one all-to-all
of slot counts, one of token rows out (`dispatch`), one of results back (`combine`). A rank with no tokens
sends zero rows but still takes part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.mixture import Dispatched, count_per_id, weighted_sum
from moe.parallel.distributed import DistContext


class SlotTable:
    """Where each expert of one block lives: its replicas as global slot ids."""

    def __init__(self, expert_ranks: tuple[tuple[int, ...], ...], world_size: int, split: bool = False) -> None:
        """`split`: the ranks of an expert each hold a slice of it (experts by `tensor`) and every one of them
        computes every copy; otherwise they are replicas and each copy goes to one of them."""
        local = [[e for e, ranks in enumerate(expert_ranks) if r in ranks] for r in range(world_size)]
        self.slots_per_rank = max(1, max(len(x) for x in local))
        self.n_replicas = torch.tensor([len(ranks) for ranks in expert_ranks])
        table = torch.full((len(expert_ranks), int(self.n_replicas.max())), -1, dtype=torch.long)
        for e, ranks in enumerate(expert_ranks):
            for j, r in enumerate(ranks):
                table[e, j] = r * self.slots_per_rank + local[r].index(e)
        self.slot_of = table  # [E, max replicas]
        self.local = local  # global ids of the experts each rank holds, in slot order
        self.split = split
        self.replicated = not split and bool((self.n_replicas > 1).any())
        self.seen = torch.zeros(len(expert_ranks), dtype=torch.long)  # copies routed so far, per expert

    def to(self, device: torch.device) -> SlotTable:
        self.n_replicas, self.slot_of, self.seen = (t.to(device) for t in (self.n_replicas, self.slot_of, self.seen))
        return self

    def route(self, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(router weight, slot) of every copy [T, J]: J = K, or K x group size when experts are split (a copy
        per slice, each with the full router weight: the slices' results sum to the expert's)."""
        T, K = ids_TK.shape
        if self.split:
            g = self.slot_of.shape[1]
            return weights_TK[..., None].expand(T, K, g).reshape(T, K * g), self.slot_of[ids_TK].reshape(T, K * g)
        return weights_TK, self.slots(ids_TK.reshape(-1)).view(T, K)

    def slots(self, ids_N: torch.Tensor) -> torch.Tensor:
        """Slot of each copy. A replicated expert's copies go round-robin over its replicas, continuing
        from where the previous call stopped, so over a run its load splits evenly (within one copy)."""
        if not self.replicated:
            return self.slot_of[ids_N, 0]
        order = torch.sort(ids_N, stable=True).indices
        sorted_ids = ids_N[order]
        counts = count_per_id(ids_N, self.slot_of.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        ordinal = torch.empty_like(ids_N)
        ordinal[order] = torch.arange(ids_N.numel(), device=ids_N.device) - starts[sorted_ids] + self.seen[sorted_ids]
        self.seen += counts
        return self.slot_of[ids_N, ordinal % self.n_replicas[ids_N]]


def chunk_order(counts_RM: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Rows arrive grouped (source rank, slot); return the permutation that groups them (slot, source rank).
    `total` (the rows received, known on the host) spares repeat_interleave a host sync for its output size."""
    R, M = counts_RM.shape
    chunk = torch.repeat_interleave(torch.arange(R * M, device=counts_RM.device), counts_RM.reshape(-1),
                                    output_size=total)
    key = (chunk % M) * R + chunk // M
    return torch.sort(key, stable=True).indices


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], dist: DistContext) -> torch.Tensor:
    return dist.all_to_all(x.new_empty((sum(out_splits), *x.shape[1:])), x, out_splits, in_splits)


class _Exchange(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all back: rows return to where they came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], dist: DistContext) -> torch.Tensor:
        ctx.splits, ctx.dist = (out_splits, in_splits), dist
        return _all_to_all(x, out_splits, in_splits, dist)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.dist), None, None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], dist: DistContext) -> torch.Tensor:
    """Variable-size all-to-all of rows; differentiable when gradients are needed (training)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exchange.apply(x, out_splits, in_splits, dist)
    return _all_to_all(x, out_splits, in_splits, dist)


@dataclass
class Exchanged(Dispatched):
    """`Dispatched` plus what the way back needs: rows per peer rank each way, and the arrival order."""

    sent_R: list[int]  # rows this rank sent to each rank (and gets back from it)
    received_R: list[int]  # rows this rank received from each rank (and returns to it)
    by_slot_M: torch.Tensor  # permutation from arrival order (source, slot) to expert order (slot, source)
    # more than 2 copies a token: the sent rows in the order of their experts' ids, in which one rank adds them
    by_expert_N: torch.Tensor | None = None


class AllToAllDispatcher:
    """Send each copy to the rank holding its expert, grouped by slot; bring the results back and sum them."""

    def __init__(self, table: SlotTable, dist: DistContext) -> None:
        self.table, self.dist = table, dist
        self.n_local = len(table.local[dist.rank])
        self.last_split_sizes: tuple[list[int], list[int]] = ([], [])  # (sent, received) rows, for inspection

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                 ids_TK: torch.Tensor) -> tuple[torch.Tensor, list[int], Exchanged]:
        """(rows for this rank's experts grouped by local expert, rows per local expert (host), metadata)."""
        R, M = self.dist.world_size, self.table.slots_per_rank
        weights_TK, slot_TK = self.table.route(weights_TK, ids_TK)
        slot_N = slot_TK.reshape(-1)
        order_N = torch.sort(slot_N, stable=True).indices  # grouped by slot = by destination rank, then expert
        send_RM = count_per_id(slot_N, R * M).view(R, M)
        recv_RM = self.dist.all_to_all(torch.empty_like(send_RM), send_RM)
        # The one host sync of the block: the split sizes of the row exchange, and (from the same read)
        # the rows each local expert receives.
        both = torch.cat([send_RM.sum(1), recv_RM.reshape(-1)]).tolist()
        sent_R, recv_RM_host = both[:R], [both[R + r * M:R + (r + 1) * M] for r in range(R)]
        received_R = [sum(row) for row in recv_RM_host]
        per_expert = [sum(row[m] for row in recv_RM_host) for m in range(self.n_local)]
        self.last_split_sizes = (sent_R, received_R)
        token_N = order_N // max(slot_TK.shape[1], 1)
        rows = exchange(x_TD[token_N], received_R, sent_R, self.dist)  # [received, D], by (source, slot)
        by_slot = chunk_order(recv_RM, sum(received_R))
        meta = Exchanged(token_N, weights_TK.reshape(-1)[order_N], x_TD.shape[0], sent_R, received_R, by_slot)
        # one rank adds a token's copies in its experts' order; slots need not follow it (a placement's), and past
        # two copies the order changes the sum (split experts' slices are partial sums anyway)
        if ids_TK.shape[1] > 2 and not self.table.split:
            meta.by_expert_N = torch.sort(ids_TK.reshape(-1)[order_N], stable=True).indices
        return rows[by_slot], per_expert, meta

    def combine(self, y_ND: torch.Tensor, meta: Exchanged) -> torch.Tensor:
        y_back = y_ND[torch.argsort(meta.by_slot_M)]  # back to (source, slot) order
        returned = exchange(y_back, meta.sent_R, meta.received_R, self.dist)  # [sent, D], in our send order
        if meta.by_expert_N is not None:
            at = meta.by_expert_N
            return weighted_sum(returned[at], Dispatched(meta.token_N[at], meta.weight_N[at], meta.n_tokens))
        return weighted_sum(returned, meta)
