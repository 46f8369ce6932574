"""Expert parallelism: the dispatcher that sends token copies to the ranks holding their experts.

Shapes: T tokens at this rank, K top-k, N = T*K copies, D model dim, R ranks, M = most expert slots
any rank holds in this block. A *slot* is one replica of one expert on one rank; its global id is
`rank * M + local index`, so sorting copies by slot groups them by destination rank, then by expert.

Per block and step, on every rank, in the same order (invariant 2): one all-to-all of slot counts,
one of token rows out, one of results back. A rank with no tokens sends zero rows but still takes part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.moe import GroupedExperts, Grouping, combine


class SlotTable:
    """Where each expert of one block lives: its replicas as global slot ids."""

    def __init__(self, expert_ranks: tuple[tuple[int, ...], ...], world_size: int) -> None:
        local = [[e for e, ranks in enumerate(expert_ranks) if r in ranks] for r in range(world_size)]
        self.slots_per_rank = max(1, max(len(x) for x in local))
        self.n_replicas = torch.tensor([len(ranks) for ranks in expert_ranks])
        table = torch.full((len(expert_ranks), int(self.n_replicas.max())), -1, dtype=torch.long)
        for e, ranks in enumerate(expert_ranks):
            for j, r in enumerate(ranks):
                table[e, j] = r * self.slots_per_rank + local[r].index(e)
        self.slot_of = table  # [E, max replicas]
        self.replicated = bool((self.n_replicas > 1).any())
        self.seen = torch.zeros(len(expert_ranks), dtype=torch.long)  # copies routed so far, per expert

    def to(self, device: torch.device) -> SlotTable:
        self.n_replicas, self.slot_of, self.seen = (t.to(device) for t in (self.n_replicas, self.slot_of, self.seen))
        return self

    def slots(self, ids_N: torch.Tensor) -> torch.Tensor:
        """Slot of each copy. A replicated expert's copies go round-robin over its replicas, continuing
        from where the previous call stopped, so over a run its load splits evenly (within one copy)."""
        if not self.replicated:
            return self.slot_of[ids_N, 0]
        order = torch.sort(ids_N, stable=True).indices
        sorted_ids = ids_N[order]
        counts = torch.bincount(ids_N, minlength=self.slot_of.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        ordinal = torch.empty_like(ids_N)
        ordinal[order] = torch.arange(ids_N.numel(), device=ids_N.device) - starts[sorted_ids] + self.seen[sorted_ids]
        self.seen += counts
        return self.slot_of[ids_N, ordinal % self.n_replicas[ids_N]]


def chunk_order(counts_RM: torch.Tensor) -> torch.Tensor:
    """Rows arrive grouped (source rank, slot); return the permutation that groups them (slot, source rank)."""
    R, M = counts_RM.shape
    chunk = torch.repeat_interleave(torch.arange(R * M, device=counts_RM.device), counts_RM.reshape(-1))
    key = (chunk % M) * R + chunk // M
    return torch.sort(key, stable=True).indices


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


class _Exchange(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all back: rows return to where they came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        return _all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits), None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Variable-size all-to-all of rows; differentiable when gradients are needed (training)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exchange.apply(x, out_splits, in_splits)
    return _all_to_all(x, out_splits, in_splits)


class AllToAllDispatcher:
    """Group copies by destination slot, exchange, run local experts, exchange back, combine at the sender."""

    def __init__(self, table: SlotTable, world_size: int) -> None:
        self.table, self.world_size = table, world_size
        self.last_split_sizes: tuple[list[int], list[int]] = ([], [])  # (sent, received) rows, for inspection
        self.received_rows = 0  # token copies this rank's experts computed, for measured load reports

    def __call__(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                 experts: GroupedExperts, n_experts: int, counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """`counts_E` (copies per expert) is unused here: the exchange needs copies per slot."""
        R, M = self.world_size, self.table.slots_per_rank
        slot_N = self.table.slots(ids_TK.reshape(-1))
        order = torch.sort(slot_N, stable=True).indices
        # Grouped by slot rather than by expert: counts_E holds copies per slot here.
        grouping = Grouping(order_N=order, token_N=order // max(ids_TK.shape[1], 1),
                            counts_E=torch.bincount(slot_N, minlength=R * M))
        send_RM = grouping.counts_E.view(R, M)
        recv_RM = torch.empty_like(send_RM)
        dist.all_to_all_single(recv_RM, send_RM)
        # One host sync per block: the split sizes of the row exchange.
        sizes = torch.stack([send_RM.sum(1), recv_RM.sum(1)]).tolist()
        in_splits, out_splits = sizes
        self.last_split_sizes = (in_splits, out_splits)
        self.received_rows += sum(out_splits)
        rows = exchange(x_TD[grouping.token_N], out_splits, in_splits)  # [received, D], by (source, slot)
        perm = chunk_order(recv_RM)
        y = experts(rows[perm], recv_RM.sum(0)[: len(experts.expert_ids)])  # grouped by local expert
        y_back = y[torch.argsort(perm)]  # back to (source, slot) order
        returned = exchange(y_back, in_splits, out_splits)  # [sent, D], in this rank's send order
        return combine(returned, weights_TK, grouping, x_TD.shape[0])
