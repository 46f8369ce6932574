"""Mixture-of-experts feed-forward with three seams: router, dispatcher, experts.

Shapes: T tokens, D model dim, F expert hidden dim, E experts (global), El experts held here, K top-k,
N = T*K token copies.

- `Router` (`models.router`): gate logits -> top-k expert ids and fp32 weights, by the family's kind.
- `LocalDispatcher`: `dispatch` groups the N copies by expert; `combine` weights and sums the results.
  Expert parallelism (`moe.parallel.dispatch`) swaps in a dispatcher that also exchanges the grouped
  copies between ranks; neither the router nor the experts change.
- `GroupedExperts` (`models.experts`): the stacked experts held here; sees only copies already grouped by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.basic import Linear, hooked
from models.config import ModelConfig
from models.experts import DenseMLP, GroupedExperts
from models.kernels import decode_block, native
from models.router import Router, routing_checksum

__all__ = ["GroupedExperts", "MoEFeedForward", "LocalDispatcher", "weighted_sum"]


@dataclass
class Grouping:
    """How the N = T*K token copies are ordered by expert."""

    order_N: torch.Tensor  # position in the flattened [T*K] copies of each grouped row
    token_N: torch.Tensor  # token index of each grouped row
    counts_E: torch.Tensor  # copies per expert (global ids)
    rank_N: torch.Tensor | None = None  # grouped row of each of the [T*K] copies (order_N's inverse), where made


FEW_COPIES = 64  # a compiled step with at most this many copies groups them by comparisons, not a sort


def count_per_id(ids_N: torch.Tensor, n: int) -> torch.Tensor:
    """[n] occurrences of each id: a fixed-size scatter_add, so no host sync (bincount's output size needs
    one on CUDA). A compiled step with few ids compares them with every id instead: elementwise, so inductor fuses
    it with its neighbours, where a scatter is a library call (two per block and step)."""
    if torch.compiler.is_compiling() and ids_N.numel() <= FEW_COPIES:
        return (ids_N[:, None] == torch.arange(n, device=ids_N.device)[None, :]).sum(0)
    return torch.zeros(n, dtype=torch.long, device=ids_N.device).scatter_add_(0, ids_N, torch.ones_like(ids_N))


def stable_ranks(ids_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, rank) of a stable sort of a few ids, from N x N comparisons: elementwise operations that a compiled
    step fuses into one loop, where a sort is a library call per block (10 us for a decode step's 2 copies)."""
    i = torch.arange(ids_N.numel(), device=ids_N.device)
    before = (ids_N[None, :] < ids_N[:, None]) | ((ids_N[None, :] == ids_N[:, None]) & (i[None, :] < i[:, None]))
    rank = before.sum(1)  # copies that a stable sort puts ahead of each copy
    order = ((rank[None, :] == i[:, None]) * i[None, :]).sum(1)  # the copy that lands at each position
    return order, rank


def group_by_expert(ids_TK: torch.Tensor, n_experts: int) -> Grouping:
    flat_ids = ids_TK.reshape(-1)
    counts = count_per_id(flat_ids, n_experts)
    if torch.compiler.is_compiling() and flat_ids.numel() <= FEW_COPIES:
        order, rank = stable_ranks(flat_ids)
    else:  # stable: copies of one expert stay in token order, so results are deterministic
        order, rank = torch.sort(flat_ids, stable=True).indices, None
    return Grouping(order_N=order, token_N=order // ids_TK.shape[1], counts_E=counts, rank_N=rank)


@dataclass
class Dispatched:
    """What `combine` needs to undo a `dispatch`: which token and router weight each sent row carries.

    A dispatcher that exchanges rows between ranks keeps its own extra state (split sizes, arrival order)
    in a subclass; the fields here mean the same on every path.
    """

    token_N: torch.Tensor  # token index of each row, in the order rows were sent
    weight_N: torch.Tensor  # router weight (fp32) of each row, same order
    n_tokens: int  # T: rows of the combined output


def weigh(y_ND: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
    """Each expert result times its router weight (fp32), cast back like the reference."""
    return (y_ND * weight_N[:, None]).to(y_ND.dtype)


def weighted_sum(y_ND: torch.Tensor, meta: Dispatched, rank_N: torch.Tensor | None = None) -> torch.Tensor:
    """Weight each expert result by its router weight and sum the K copies of every token. `rank_N` (the grouped
    row of each token's k-th copy, `Grouping.rank_N`) turns the scatter into a gather."""
    weighted = weigh(y_ND, meta.weight_N)
    if rank_N is not None:  # a compiled step's few copies: no zeroed output, no atomic adds
        copies = weighted[rank_N].view(meta.n_tokens, -1, y_ND.shape[1])  # [T, K, D]
        out_TD = copies[:, 0]
        for k in range(1, copies.shape[1]):  # rounded after each add, as the scatter below rounds
            out_TD = out_TD + copies[:, k]
        return out_TD
    out_TD = torch.zeros(meta.n_tokens, y_ND.shape[1], dtype=y_ND.dtype, device=y_ND.device)
    # With top-k <= 2 all three give the same bits (a token's sum is 0 + a + b); with more copies the order of the
    # roundings may differ. On CPU index_add_ is 9x faster (1024 rows of 512 into 512 tokens: 0.15 against 1.4
    # ms); a compiled step's C++ wrapper has only index_put_, and on CUDA index_add_'s atomics have no fixed order.
    if torch.compiler.is_compiling() or y_ND.device.type != "cpu":
        return out_TD.index_put_((meta.token_N,), weighted, accumulate=True)
    return out_TD.index_add_(0, meta.token_N, weighted)


def sum_in_expert_order(copies_TKD: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Each token's K weighted copies added as one rank's grouped sum adds them (`combine`, CPU index_add_): in the
    order of their expert ids, in fp32 from zero, rounded once to their dtype. What ranks that hand each other the
    copies unsummed add to give one rank's bits."""
    order_TK = torch.argsort(ids_TK, dim=1, stable=True)
    ordered = copies_TKD.gather(1, order_TK[:, :, None].expand_as(copies_TKD))
    total = torch.zeros(copies_TKD.shape[0], copies_TKD.shape[2], dtype=torch.float32, device=copies_TKD.device)
    for k in range(ordered.shape[1]):
        total = total + ordered[:, k].float()
    return total.to(copies_TKD.dtype)


@dataclass
class LocalDispatched(Dispatched):
    rank_N: torch.Tensor | None  # `Grouping.rank_N`


class LocalDispatcher:
    """All experts are on this device: group the copies by expert, and sum them back per token."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.native = False  # an inference model on native kernels: grouping and sum one op each, same bits

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                 ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """(rows grouped by expert [N, D], rows per expert [E], metadata for combine)."""
        if native.glue_runs(self.native):
            rows_ND, counts_E, token_N, weight_N = native.group_by_expert(x_TD, weights_TK, ids_TK, self.n_experts)
            return rows_ND, counts_E, LocalDispatched(token_N, weight_N, x_TD.shape[0], None)
        g = group_by_expert(ids_TK, self.n_experts)
        meta = LocalDispatched(g.token_N, weights_TK.reshape(-1)[g.order_N], x_TD.shape[0], g.rank_N)
        return x_TD[g.token_N], g.counts_E, meta

    def combine(self, y_ND: torch.Tensor, meta: LocalDispatched) -> torch.Tensor:
        if native.glue_runs(self.native) and meta.rank_N is None:
            return native.combine(y_ND, meta.weight_N, meta.token_N, meta.n_tokens)
        return weighted_sum(y_ND, meta, meta.rank_N)

    def combine_with(self, y_ND: torch.Tensor, meta: Dispatched, partial_TD: torch.Tensor) -> torch.Tensor:
        """`combine` with a partial result of this rank's added before any sum over ranks (a shared expert split
        like the routed ones, `moe.parallel.tensor.split_shared`)."""
        return self.combine(y_ND, meta) + partial_TD


class MoEFeedForward(nn.Module):
    """router -> dispatcher.dispatch -> experts -> dispatcher.combine. Expert parallelism swaps the
    dispatcher (`moe.parallel.dispatch`) and slices the experts; the router never changes."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, dense: bool = False) -> None:
        """`dense`: a dense layer among MoE ones (`ModelConfig.dense_layers`): no router and no routed experts, its
        MLP where a shared expert would be (`shared`), run where the block's tokens are, never exchanged."""
        super().__init__()
        self.n_experts, self.top_k, self.dense = cfg.n_experts, cfg.top_k, dense
        self.gate = None if dense else Router(cfg.dim, cfg.n_experts, cfg.top_k, cfg.router, cfg.norm_topk_prob,
                                              cfg.router_jitter, cfg.router_bias, (cfg.n_group, cfg.topk_group),
                                              cfg.routed_scaling, cfg.score_bias)
        ids = [] if dense else expert_ids or list(range(cfg.n_experts))
        self.experts = GroupedExperts.of(cfg, ids)
        self.dispatcher = LocalDispatcher(cfg.n_experts)
        self.native = False  # `prepare_weights`
        # Token copies routed to each expert: row 0 prefill, row 1 decode. Counted on device, read on demand.
        self.register_buffer("load_counts", torch.zeros(2, cfg.n_experts, dtype=torch.long), persistent=False)
        # False on all but one of the ranks that route the same tokens (tensor parallelism, redundant attention):
        # neither the copies nor the entropy are counted there.
        self.counts_load = True
        # Copies this rank's experts computed (or their slice of), for measured load reports where the experts are
        # spread (`counts_received`, set by `moe.parallel.sharding`). A buffer updated in place, on device: a
        # compiled step updates it inside its graph, as it does `load_counts`.
        self.register_buffer("received_rows", torch.zeros((), dtype=torch.long), persistent=False)
        self.counts_received = False
        # Where several ranks route the same tokens (an expert group that splits every expert, replicated attention
        # running every sequence on every rank), each keeps a checksum of the experts it chose, which the ranks
        # compare once per request (`moe.parallel.agreement`): a few elementwise ops per block and step, on device.
        self.register_buffer("route_check", torch.zeros((), dtype=torch.long), persistent=False)
        self.checks_routing = False
        # A shared expert (Qwen2-MoE): a dense branch every token takes, beside the routed experts, run where the
        # router runs (the block's attention ranks), never through the exchange; optionally gated per token.
        width = (cfg.dense_hidden_dim or cfg.hidden_dim) if dense else cfg.shared_hidden_dim
        self.shared = DenseMLP(cfg.dim, width) if width else None
        self.shared_partial = False  # the shared expert holds a slice of its width: summed with the routed experts
        self.shared_gate = Linear(cfg.dim, 1) if cfg.shared_hidden_dim and cfg.shared_gate and not dense else None

    def prepare_weights(self, choice) -> None:
        """An inference model on native kernels counts, groups and sums its copies in one op each."""
        self.native = self.dispatcher.native = choice.native

    def decode_reads(self) -> list[tuple]:
        """The routed experts' reads at a batch-1 decode step (`models.weights.decode_reads`): top-k of them."""
        return [] if self.dense else self.experts.expert_reads(self.top_k)

    def forward(self, x_TD: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        if self.dense:
            return self.shared(x_TD)
        if self.in_one_op(x_TD):
            return decode_block.routed_experts(x_TD, *self.op_arguments(decoding))
        weights_TK, ids_TK = self.gate(x_TD, self.counts_load)
        if self.checks_routing:
            self.route_check.add_(routing_checksum(ids_TK))
        if self.counts_load and native.glue_runs(self.native):
            native.count_ids(self.load_counts, int(decoding), ids_TK)
        elif self.counts_load:
            self.load_counts[int(decoding)] += count_per_id(ids_TK.reshape(-1), self.n_experts)  # on device, no sync
        shared_TD = None
        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
        if self.shared_partial:  # a slice of the shared expert's width: its part joins the routed experts' sum
            return self.run_experts(x_TD, weights_TK, ids_TK, shared_TD)
        out_TD = self.run_experts(x_TD, weights_TK, ids_TK)
        return out_TD if shared_TD is None else out_TD + shared_TD

    def in_one_op(self, x: torch.Tensor) -> bool:
        """The routed experts of these tokens (x [..., D]) run as one native op (`decode_block.routed_experts`): all
        of them held here, no shared expert, nothing counted or checked beyond the load, and a router and experts
        that take the op's path (`Router.in_one_op`, `GroupedExperts.streams`)."""
        return (not self.dense and self.shared is None and type(self.dispatcher) is LocalDispatcher
                and not hooked(self.gate, self.experts)
                and not self.checks_routing and not self.counts_received and self.gate.in_one_op(x, self.counts_load)
                and self.experts.streams(x.numel() // x.shape[-1] * self.top_k))

    def add_to(self, h: torch.Tensor, norm: nn.Module, decoding: bool) -> torch.Tensor | None:
        """h + this feed-forward of norm(h) as one op (`decode_block.add_routed_experts`) where `one_op_operands`
        has them; None elsewhere."""
        operands = self.one_op_operands(h, norm, decoding)
        return None if operands is None else decode_block.add_routed_experts(h, *operands)

    def one_op_operands(self, h: torch.Tensor, norm: nn.Module, decoding: bool) -> tuple | None:
        """`decode_block.add_routed_experts`' arguments besides h where the routed experts run as one op
        (`in_one_op`) and the norm natively; None elsewhere, and where a module the op stands in for has a hook."""
        if hooked(self, norm) or not (norm.runs_natively(h) and self.in_one_op(h)):
            return None
        return norm.operands, *self.op_arguments(decoding)

    def op_arguments(self, decoding: bool) -> tuple:
        """`decode_block.routed_experts`' arguments after the tokens."""
        gate, experts = self.gate, self.experts
        return (gate.gate.weight, experts.stacks, experts.scales or (None, None), self.top_k, gate.route_kind,
                gate.renormalise, self.load_counts if self.counts_load else None, int(decoding))

    def run_experts(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                    partial_TD: torch.Tensor | None = None) -> torch.Tensor:
        """The routed tokens through their experts, wherever those live (`partial_TD`: this rank's part of a split
        shared expert, added before the sum over the group). A rank with no tokens of its own calls this with empty
        tensors to take part in the exchanges."""
        rows_ND, counts_El, meta = self.dispatcher.dispatch(x_TD, weights_TK, ids_TK)
        if self.counts_received:  # rows per local expert: on device, or on the host after an all-to-all
            # add_, not +=: `+=` also stores the attribute, which dynamo replays outside a compiled step's graph
            self.received_rows.add_(counts_El.sum() if isinstance(counts_El, torch.Tensor) else sum(counts_El))
        y_ND = self.experts(rows_ND, counts_El)
        if partial_TD is not None:
            return self.dispatcher.combine_with(y_ND, meta, partial_TD)
        return self.dispatcher.combine(y_ND, meta)
