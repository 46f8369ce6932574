"""Mixture-of-experts feed-forward with three seams: router, dispatcher, experts.

Shapes: T tokens, D model dim, F expert hidden dim, E experts (global), El experts held here, K top-k,
N = T*K token copies.

- `Router` (`models.router`): gate logits -> top-k expert ids and fp32 weights, by the family's kind.
- `LocalDispatcher`: `dispatch` groups the N copies by expert; `combine` weights and sums the results.
  Expert parallelism (`moe.parallel.dispatch`) swaps in a dispatcher that also exchanges the grouped
  copies between ranks; neither the router nor the experts change.
- `GroupedExperts`: stacked SwiGLU weights `w1 [El, F, D]`, `w2 [El, D, F]`, `w3 [El, F, D]` for the
  global experts `expert_ids`; sees only copies already grouped by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import weights
from models.basic import Linear
from models.config import ModelConfig
from models.kernels import choice as kc
from models.kernels import native
from models.kernels.choice import KernelChoice
from models.router import Router, routing_checksum


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, expert_ids: list[int]) -> None:
        super().__init__()
        self.expert_ids = list(expert_ids)  # global id of each stacked expert, in order
        n = len(self.expert_ids)
        self.w1 = nn.Parameter(torch.empty(n, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden_dim, dim))
        # Inference: per stacked expert, (w1 and w3 fused, w2) in their fastest format (models.weights).
        self.kernels: list[tuple[weights.LinearWeight, weights.LinearWeight]] | None = None
        # Plain inference weights also stay stacked, w13 [El, 2F, D] and w2 [El, D, F] (the experts' kernels are
        # views of them), for grouped products of all local experts at once: on CPU the streaming kernel
        # (`choice.native`; int8 stacks with their scales [El, 2F] and [El, D]), on CUDA `torch._grouped_mm` with the
        # offsets on the device (`offsets_on_device`: bf16, never run there). Neither reads counts on the host.
        self.stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.choice: KernelChoice | None = None  # inference: which products run (`KernelChoice.product`)
        self.offsets_on_device = False

    def forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor | list[int]) -> torch.Tensor:
        """x_ND holds counts_El[0] copies for stacked expert 0, then counts_El[1] for expert 1, ...
        A dispatcher that already read the counts on the host passes them as a list."""
        path = self.choice.product(x_ND.shape[0], native.EXPERT_MAX_ROWS) if self.choice else None
        if self.stacks is not None and path in (kc.NATIVE_DECODE, kc.NATIVE_PROMPT):
            # dtype given: a rank holding none of the block's experts gets [] from the all-to-all (torch: float)
            counts = torch.as_tensor(counts_El, dtype=torch.long, device=x_ND.device)
            return self.streamed_forward(x_ND, counts, native.grouped if path == kc.NATIVE_DECODE
                                         else native.prompt_grouped)
        if self.offsets_on_device and self.stacks is not None and isinstance(counts_El, torch.Tensor):
            return self.grouped(x_ND, counts_El)
        # One host sync per layer (none if the dispatcher read them): the counts decide which experts run.
        counts = counts_El.tolist() if isinstance(counts_El, torch.Tensor) else counts_El
        training = torch.is_grad_enabled() and self.w1.requires_grad
        # unbind: one view per expert, whose backward stacks the gradients once (indexing would zero-fill)
        stacks = list(zip(self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0), strict=True)) if training else None
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue  # an expert that got no token does not run
            x = x_ND[start:start + n]
            if self.kernels is not None:
                outs.append(fused_swiglu(x, *self.kernels[e]))
            else:  # index only the experts that run
                outs.append(swiglu(x, *(stacks[e] if stacks else (self.w1[e], self.w2[e], self.w3[e]))))
            start += n
        # Concatenating (not writing into slices of a buffer) keeps the backward pass free of zero-filled copies.
        return torch.cat(outs) if outs else x_ND.new_empty((0, self.w2.shape[1]))

    def prepare_weights(self, choice: KernelChoice) -> None:
        """For inference: each expert's w1/w3 fused and w2, in their fastest format; the stacks keep shapes."""
        if self.kernels is not None or self.w1.is_meta:
            return
        self.choice = choice
        fmt = weights.format_for(self.w1, choice)
        w1, w2, w3 = self.w1.detach(), self.w2.detach(), self.w3.detach()
        experts = range(len(self.expert_ids))
        if fmt in (weights.Dense, weights.Streamed):  # stacked once, [El, 2F, D]; each expert's kernel is a view
            self.stacks = (torch.cat([w1, w3], dim=1), w2)
            # One expert at a time (`forward`, where prompts do not run the prompt kernel: bf16 on a CPU with bf16
            # instructions), its rows take the streaming kernel up to the grouped call's limit, as they would in it:
            # a block whose copies a gathered step on N ranks runs one by one (its rows padded past that limit)
            # gives 1 rank's bits, where oneDNN's products from 9 rows on did not.
            limit = native.EXPERT_MAX_ROWS
            self.kernels = [(fmt(self.stacks[0][e], choice, limit), fmt(w2[e], choice, limit)) for e in experts]
            self.offsets_on_device = grouped_mm_runs(w1)
        elif fmt is weights.Int8 and choice.native:  # quantized as stacks, likewise
            E, F, D = w1.shape
            q13, s13 = weights.quantize_each((torch.cat([w1[e], w3[e]]) for e in experts), (E, 2 * F, D), w1.device)
            q2, s2 = weights.quantize_each(w2, w2.shape, w2.device)
            self.stacks, self.scales = (q13, q2), (s13, s2)
            self.kernels = [(weights.Int8(q13[e], s13[e], w1.dtype, choice),
                             weights.Int8(q2[e], s2[e], w1.dtype, choice)) for e in experts]
        elif fmt is weights.Int8:
            self.kernels = [(weights.Int8.of(torch.cat([w1[e], w3[e]]), choice), weights.Int8.of(w2[e], choice))
                            for e in experts]
        else:  # converted expert by expert: one expert's w1/w3 copy at a time on top of the stacks
            self.kernels = [(fmt(torch.cat([w1[e], w3[e]]), choice), fmt(w2[e], choice)) for e in experts]
        for name in ("w1", "w2", "w3"):
            setattr(self, name, weights.shape_only(getattr(self, name)))

    def streamed_forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor, product) -> torch.Tensor:
        """All local experts in two calls of the native decode kernel (`product`; prompts: `native.prompt_grouped`;
        int8: the same bits per row), which reads the counts itself and only the weights of experts that got rows.
        Rows past the last group come out as zeros."""
        (w13, w2), (s13, s2) = self.stacks, self.scales or (None, None)
        h = product(x_ND, w13, counts_El, s13)
        hidden = w2.shape[2]
        return product(F.silu(h[:, :hidden]).mul_(h[:, hidden:]), w2, counts_El, s2)

    def grouped(self, x_ND: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        """All local experts in two grouped products whose group offsets stay on the device. Rows past the
        last offset (copies for no expert here, sorted last by the gathering dispatcher) come out as zeros."""
        w13, w2 = self.stacks
        offsets = counts_El.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x_ND, w13.transpose(1, 2), offs=offsets)
        hidden = w2.shape[2]
        y = torch._grouped_mm(F.silu(h[:, :hidden]) * h[:, hidden:], w2.transpose(1, 2), offs=offsets)
        computed = torch.arange(x_ND.shape[0], device=x_ND.device) < offsets[-1]
        return torch.where(computed[:, None], y, 0)  # rows _grouped_mm did not write hold whatever memory held

    def dense(self, name: str) -> torch.Tensor:
        """Stacked weight `name` ("w1", "w2", "w3") as a plain tensor (converted back if converted)."""
        if self.kernels is None:
            return getattr(self, name).detach()
        hidden = self.w1.shape[1]
        if name == "w2":
            return torch.stack([w2.dense() for _, w2 in self.kernels])
        rows = slice(0, hidden) if name == "w1" else slice(hidden, 2 * hidden)
        return torch.stack([w13.dense()[rows] for w13, _ in self.kernels])

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.kernels is not None:
            for name in ("w1", "w2", "w3"):
                destination[prefix + name] = self.dense(name)


class DenseMLP(nn.Module):
    """w2(silu(w1 x) * w3 x) with plain linear layers: a shared expert, or a dense layer's feed-forward."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, hidden_dim), Linear(hidden_dim, dim), Linear(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_mm_runs(w: torch.Tensor) -> bool:
    """`torch._grouped_mm` runs these stacked experts: bf16 on a CUDA GPU that the installed torch has the grouped
    product for (Hopper, compute capability 9.0, and later). Elsewhere experts run one by one (never run on CUDA)."""
    if w.device.type != "cuda" or w.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(w.device) >= (9, 0)


def fused_swiglu(x: torch.Tensor, w13: weights.LinearWeight, w2: weights.LinearWeight) -> torch.Tensor:
    """swiglu with w1 and w3 stacked in one weight: one product for both (inference only)."""
    h = w13(x)
    hidden = h.shape[-1] // 2
    return w2(F.silu(h[:, :hidden]).mul_(h[:, hidden:]))


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """(silu(x w1^T) * x w3^T) w2^T; without autograd the activation is computed in place (fewer temporaries)."""
    h = F.linear(x, w1)
    if torch.is_grad_enabled() and (x.requires_grad or h.requires_grad):
        return F.linear(F.silu(h) * F.linear(x, w3), w2)
    return F.linear(F.silu(h, inplace=True).mul_(F.linear(x, w3)), w2)


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


def weighted_sum(y_ND: torch.Tensor, meta: Dispatched, rank_N: torch.Tensor | None = None) -> torch.Tensor:
    """Weight each expert result by its router weight and sum the K copies of every token. `rank_N` (the grouped
    row of each token's k-th copy, `Grouping.rank_N`) turns the scatter into a gather."""
    weighted = (y_ND * meta.weight_N[:, None]).to(y_ND.dtype)  # weights are fp32; cast like the reference
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


@dataclass
class LocalDispatched(Dispatched):
    rank_N: torch.Tensor | None  # `Grouping.rank_N`


class LocalDispatcher:
    """All experts are on this device: group the copies by expert, and sum them back per token."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                 ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """(rows grouped by expert [N, D], rows per expert [E], metadata for combine)."""
        g = group_by_expert(ids_TK, self.n_experts)
        meta = LocalDispatched(g.token_N, weights_TK.reshape(-1)[g.order_N], x_TD.shape[0], g.rank_N)
        return x_TD[g.token_N], g.counts_E, meta

    def combine(self, y_ND: torch.Tensor, meta: LocalDispatched) -> torch.Tensor:
        return weighted_sum(y_ND, meta, meta.rank_N)


class MoEFeedForward(nn.Module):
    """router -> dispatcher.dispatch -> experts -> dispatcher.combine. Expert parallelism swaps the
    dispatcher (`moe.parallel.dispatch`) and slices the experts; the router never changes."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, dense: bool = False) -> None:
        """`dense`: a dense layer among MoE ones (`ModelConfig.dense_layers`): no router and no routed experts, its
        MLP where a shared expert would be (`shared`), run where the block's tokens are, never exchanged."""
        super().__init__()
        self.n_experts, self.dense = cfg.n_experts, dense
        self.gate = None if dense else Router(cfg.dim, cfg.n_experts, cfg.top_k, cfg.router, cfg.norm_topk_prob,
                                              cfg.router_jitter)
        ids = [] if dense else expert_ids or list(range(cfg.n_experts))
        self.experts = GroupedExperts(cfg.dim, cfg.hidden_dim, ids)
        self.dispatcher = LocalDispatcher(cfg.n_experts)
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
        self.shared_gate = Linear(cfg.dim, 1) if cfg.shared_hidden_dim and cfg.shared_gate and not dense else None

    def forward(self, x_TD: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        if self.dense:
            return self.shared(x_TD)
        weights_TK, ids_TK = self.gate(x_TD, self.counts_load)
        if self.checks_routing:
            self.route_check.add_(routing_checksum(ids_TK))
        if self.counts_load:
            self.load_counts[int(decoding)] += count_per_id(ids_TK.reshape(-1), self.n_experts)  # on device, no sync
        out_TD = self.run_experts(x_TD, weights_TK, ids_TK)
        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        return out_TD

    def run_experts(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        """The routed tokens through their experts, wherever those live. A rank with no tokens of its own
        calls this with empty tensors to take part in the exchanges."""
        rows_ND, counts_El, meta = self.dispatcher.dispatch(x_TD, weights_TK, ids_TK)
        if self.counts_received:  # rows per local expert: on device, or on the host after an all-to-all
            # add_, not +=: `+=` also stores the attribute, which dynamo replays outside a compiled step's graph
            self.received_rows.add_(counts_El.sum() if isinstance(counts_El, torch.Tensor) else sum(counts_El))
        y_ND = self.experts(rows_ND, counts_El)
        return self.dispatcher.combine(y_ND, meta)
