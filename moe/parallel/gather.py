"""The decode exchange: every size known in advance, two collectives per block, no split sizes on the host.

For a few tokens per step the all-to-all's count exchange, its split sizes read on the host, and its two
variable exchanges cost more than the rows they move. Here (the layout vLLM and DeepSeek use for decode):

1. every rank packs its step rows (hidden state, router weights, the slot of each copy) into `most` rows,
   padding with copies for no slot, and one all-gather gives every rank every rank's rows;
2. each rank runs the copies routed to its own slots, weights them, and sums them per token, all on device;
3. one reduce-scatter sums the partial results over ranks and hands each rank back its own rows. With more than 2
   copies a token the copies cross unsummed instead, each in its own place (K times the bytes), and each token's
   owner adds them in its experts' order, as one rank does: a partial sum of two copies on one rank, added to a
   third's from another, rounds differently (bf16 logits 0.03 apart).

Where every rank already holds every row (replicated attention run redundantly for a batch smaller than the
ranks: `StepRows.everywhere`), step 1 has nothing to move and step 3 is one sum over ranks, in rank order (the
same bits on every rank, so every rank routes the next block alike): one collective per block.

The slot of a copy (which replica computes it) is still chosen by the rank that routed the token, so replicas
split the load as on the all-to-all path. `StepRows` says, before each forward pass, how many rows the
fullest rank brings (the same number on every rank, from shapes every rank knows); `ExchangeDispatcher`
takes this path when that number is small (`GATHER_MAX_ROWS`), or always / never when forced, so every rank
takes the same path at every block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.mixture import Dispatched, group_by_expert, sum_in_expert_order, weigh, weighted_sum
from moe.parallel.dispatch import AllToAllDispatcher, SlotTable
from moe.parallel.distributed import DistContext

EXCHANGES = ("auto", "all-to-all", "gather")
# Up to this many rows on the fullest rank, "auto" gathers: a decode step of up to 16 sequences per rank.
# Prefill keeps the all-to-all, which moves each copy once rather than every row to every rank.
GATHER_MAX_ROWS = 16


class StepRows:
    """The most rows any rank brings to this forward pass's exchanges, set by the engine before the blocks."""

    def __init__(self, exchange: str = "auto") -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: use one of {', '.join(EXCHANGES)}")
        self.exchange = exchange
        self.most = 0
        self.everywhere = False  # every rank holds every row of this forward pass (set by the engine)

    @property
    def gather(self) -> bool:
        return self.exchange == "gather" or (self.exchange == "auto" and self.most <= GATHER_MAX_ROWS)


@dataclass
class Gathered(Dispatched):
    """`Dispatched` over the gathered rows of every rank (`n_tokens` = ranks x most), plus where this rank's are."""

    own_rows: int  # rows this rank brought; its results are rows rank*most .. rank*most+own_rows of the sum
    everywhere: bool = False  # every rank holds every row: the partial sums are summed, not scattered
    # More than 2 copies a token: each copy's place (row x K + k) among the gathered rows' copies, and the experts of
    # this rank's tokens (all rows where `everywhere`), whose order the sum of a token's copies follows
    copy_N: torch.Tensor | None = None
    ids_TK: torch.Tensor | None = None


class ExchangeDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher that gathers instead when `step` says the step is small."""

    def __init__(self, table: SlotTable, dist: DistContext, step: StepRows) -> None:
        super().__init__(table, dist)
        self.step = step

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        if self.step.everywhere:  # every rank routed the same rows alike: nothing to move
            weights_TK, slot_TK = self.table.route(weights_TK, ids_TK)
            return self._mine(x_TD, weights_TK, slot_TK, x_TD.shape[0], ids_TK, everywhere=True)
        if not self.step.gather:
            return super().dispatch(x_TD, weights_TK, ids_TK)
        weights_TK, slot_TK = self.table.route(weights_TK, ids_TK)
        K, D = slot_TK.shape[1], x_TD.shape[1]
        packed = self.dist.all_gather(pack(x_TD, weights_TK, slot_TK, self.step.most))
        return self._mine(*unpack(packed, D, K, x_TD.dtype), own_rows=x_TD.shape[0], ids_TK=ids_TK)

    def _mine(self, x_RD: torch.Tensor, w_RK: torch.Tensor, slot_RK: torch.Tensor, own_rows: int,
              ids_TK: torch.Tensor, everywhere: bool = False):
        """The copies among these rows for this rank's slots, grouped by local slot; every other copy gets slot M,
        sorts last, and weighs nothing."""
        M = self.table.slots_per_rank
        mine = slot_RK // M == self.dist.rank
        local_RK = torch.where(mine, slot_RK % M, M)
        g = group_by_expert(local_RK, M + 1)
        counts = g.counts_E[:self.n_local]
        weight_N = torch.where(mine.reshape(-1), w_RK.reshape(-1), 0.0)[g.order_N]
        # 0 + a + b is one sum in any order, a third copy's is not; split experts' slices are partial sums anyway
        exact = ids_TK.shape[1] > 2 and not self.table.split
        meta = Gathered(g.token_N, weight_N, x_RD.shape[0], own_rows=own_rows, everywhere=everywhere,
                        copy_N=g.order_N if exact else None, ids_TK=ids_TK if exact else None)
        return x_RD[g.token_N], counts, meta

    def combine(self, y_ND: torch.Tensor, meta: Dispatched) -> torch.Tensor:
        if not isinstance(meta, Gathered):
            return super().combine(y_ND, meta)
        if meta.copy_N is not None:
            return self._combine_copies(y_ND, meta)
        n = y_ND.shape[0]  # the experts return only the rows for this rank's slots, which come first
        partial = weighted_sum(y_ND, Dispatched(meta.token_N[:n], meta.weight_N[:n], meta.n_tokens))
        if meta.everywhere:
            return self.dist.sum_in_rank_order(partial)
        return self.dist.reduce_scatter(partial)[:meta.own_rows]

    def _combine_copies(self, y_ND: torch.Tensor, meta: Gathered) -> torch.Tensor:
        """Each weighted copy crosses the ranks unsummed, in its own place (the sum over ranks adds only zeros to
        it, so it is exact), and each token's owner adds its copies in one rank's order: one rank's bits, for K
        times the bytes of partial sums."""
        (n, D), K = y_ND.shape, meta.ids_TK.shape[1]
        copies = y_ND.new_zeros(meta.n_tokens * K, D)
        copies[meta.copy_N[:n]] = weigh(y_ND, meta.weight_N[:n])
        if meta.everywhere:
            summed = self.dist.sum_in_rank_order(copies).view(meta.n_tokens, K, D)
        else:
            summed = self.dist.reduce_scatter(copies.view(meta.n_tokens, K * D))[:meta.own_rows].view(-1, K, D)
        return sum_in_expert_order(summed, meta.ids_TK)


def pack(x_TD: torch.Tensor, weights_TK: torch.Tensor, slot_TK: torch.Tensor, most: int) -> torch.Tensor:
    """One [most, bytes] uint8 tensor of this rank's rows: hidden state, fp32 weights, int32 slots; rows past
    T carry slot -1 (no slot), so they are never computed."""
    T, K = slot_TK.shape
    parts = (x_TD.contiguous(), weights_TK.float().contiguous(), slot_TK.to(torch.int32).contiguous())
    widths = [x_TD.shape[1] * x_TD.element_size(), 4 * K, 4 * K]
    out = torch.empty(most, sum(widths), dtype=torch.uint8, device=x_TD.device)
    out[:T] = torch.cat([p.view(torch.uint8).view(T, w) for p, w in zip(parts, widths, strict=True)], dim=1)
    if most > T:
        out[T:] = 0
        out[T:, -4 * K:] = 255  # int32 -1 in every slot field
    return out


def unpack(rows: torch.Tensor, dim: int, top_k: int, dtype: torch.dtype):
    """The inverse of `pack` for the gathered [ranks x most, bytes] rows: (x, weights, slots)."""
    x_bytes = dim * dtype.itemsize
    x = rows[:, :x_bytes].contiguous().view(dtype)
    w = rows[:, x_bytes:x_bytes + 4 * top_k].contiguous().view(torch.float32)
    slots = rows[:, x_bytes + 4 * top_k:].contiguous().view(torch.int32).long()
    return x, w, slots
