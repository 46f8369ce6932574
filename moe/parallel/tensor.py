"""Tensor parallelism (Megatron's school): a rank of a group keeps a slice of each matrix and every rank of the
group works on every token; one all-reduce sums the slices' partial results.

Applied to a meta-device model before loading, as `moe.parallel.sharding` does for the rest of a plan: the
sliced modules are rebuilt with their local shapes, and `model.slices` says, per parameter, which slice of the
checkpoint's tensor it holds (`name -> (dim, start, stop)`, on the per-expert tensor for stacked experts). The
loader reads only those slices; a save reassembles whole tensors from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.basic import Linear
from models.experts import DenseMLP
from models.mixture import GroupedExperts, LocalDispatcher, weighted_sum
from models.transformer import Transformer
from moe.parallel.distributed import DistContext
from moe.parallel.strategies import balanced_slice, head_slices

Slice = tuple[int, int, int]  # (dim, start, stop) of the checkpoint's tensor


def slices_of(model: torch.nn.Module) -> dict[str, Slice]:
    """The parameters of `model` that hold a slice, and which (empty for a model without tensor parallelism)."""
    return getattr(model, "slices", {})


def split_attention(model: Transformer, block: str, ranks: tuple[int, ...], rank: int) -> None:
    """Keep this rank's query heads (and the KV heads they use): q/k/v by rows (and their biases), the output
    projection by columns; its bias, added once after the sum over the group, only on the group's first rank.
    Per-head q/k norms apply to every head alike and stay whole."""
    cfg, attention = model.cfg, model.layers[block].attention
    if cfg.latent:
        return split_latent_attention(model, block, ranks, rank)
    q, kv = head_slices(cfg.n_heads, cfg.n_kv_heads, len(ranks), ranks.index(rank))
    Dh, bias = cfg.head_dim, cfg.qkv_bias
    with torch.device("meta"):
        attention.wq = Linear(cfg.dim, len(q) * Dh, bias)
        attention.wo = Linear(len(q) * Dh, cfg.dim, cfg.o_bias and rank == ranks[0])
        attention.wk, attention.wv = Linear(cfg.dim, len(kv) * Dh, bias), Linear(cfg.dim, len(kv) * Dh, bias)
        if cfg.sinks:
            attention.sinks = nn.Parameter(torch.empty(len(q)))
    prefix = f"layers.{block}.attention."
    rows = {"wq": (0, q.start * Dh, q.stop * Dh), "wk": (0, kv.start * Dh, kv.stop * Dh),
            "wv": (0, kv.start * Dh, kv.stop * Dh)}
    attention.n_heads, attention.n_kv_heads = len(q), len(kv)
    model.slices = slices_of(model) | {prefix + f"{w}.weight": s for w, s in rows.items()} | {
        prefix + "wo.weight": (1, q.start * Dh, q.stop * Dh)} | (
        {prefix + f"{w}.bias": s for w, s in rows.items()} if bias else {}) | (
        {prefix + "sinks": (0, q.start, q.stop)} if cfg.sinks else {})


def split_latent_attention(model: Transformer, block: str, ranks: tuple[int, ...], rank: int) -> None:
    """Latent attention's heads: q (or q's second projection) and wkv_b by rows, the output projection by columns.
    The latent's projection and norms, and so the cache of latents and rotary keys, are whole on every rank of the
    group: each holds the block's entire cache (it is shared by all heads), and its own heads' queries."""
    cfg, attention = model.cfg, model.layers[block].attention
    q, _ = head_slices(cfg.n_heads, cfg.n_heads, len(ranks), ranks.index(rank))
    qk, kv = cfg.qk_nope_dim + cfg.head_dim, cfg.qk_nope_dim + cfg.v_head_dim
    name = "wq_b" if cfg.q_lora_rank else "wq"
    with torch.device("meta"):
        setattr(attention, name, Linear(cfg.q_lora_rank or cfg.dim, len(q) * qk))
        attention.wkv_b = Linear(cfg.kv_lora_rank, len(q) * kv)
        attention.wo = Linear(len(q) * cfg.v_head_dim, cfg.dim)
    attention.n_heads = len(q)
    prefix = f"layers.{block}.attention."
    model.slices = slices_of(model) | {prefix + f"{name}.weight": (0, q.start * qk, q.stop * qk),
                                       prefix + "wkv_b.weight": (0, q.start * kv, q.stop * kv),
                                       prefix + "wo.weight": (1, q.start * cfg.v_head_dim, q.stop * cfg.v_head_dim)}


def split_experts(model: Transformer, block: str, group: tuple[int, ...], rank: int, held: list[int],
                  device: torch.device | str = "meta") -> None:
    """Keep this rank's slice of the hidden dimension of each expert it holds: w1/w3 rows (and their biases), w2
    columns; w2's bias, added once before the group's sum, only on the group's first rank."""
    cfg = model.cfg
    f = balanced_slice(cfg.hidden_dim, len(group), group.index(rank))  # even: the plan checked it divides
    with torch.device(device):
        model.layers[block].feed_forward.experts = GroupedExperts.of(cfg, held, len(f), rank == group[0])
    prefix = f"layers.{block}.feed_forward.experts."
    rows = (0, f.start, f.stop)
    model.slices = slices_of(model) | {prefix + "w1": rows, prefix + "w3": rows, prefix + "w2": (1, f.start, f.stop)}
    if cfg.expert_bias:
        model.slices |= {prefix + "b1": rows, prefix + "b3": rows}


def split_shared(model: Transformer, block: str, group: tuple[int, ...], rank: int) -> None:
    """A block's shared expert split like its routed ones over the group that holds its tokens and splits every
    expert: this rank keeps a slice of its width (w1/w3 rows, w2 columns), and its part joins the routed experts'
    all-reduce, so the group computes it once instead of once per rank."""
    cfg, ff = model.cfg, model.layers[block].feed_forward
    f = balanced_slice(cfg.shared_hidden_dim, len(group), group.index(rank))
    with torch.device("meta"):
        ff.shared = DenseMLP(cfg.dim, len(f))
    ff.shared_partial = True
    prefix = f"layers.{block}.feed_forward.shared."
    model.slices = slices_of(model) | {prefix + "w1.weight": (0, f.start, f.stop), prefix + "w3.weight": (
        0, f.start, f.stop), prefix + "w2.weight": (1, f.start, f.stop)}


class VocabSlice(nn.Module):
    """Rows `start`.. of the embedding (Megatron's vocabulary-parallel embedding): a token outside them looks up
    zeros, and the group's all-reduce adds the one row each token has, so the sum is the plain lookup exactly."""

    def __init__(self, rows: int, dim: int, start: int, ranks: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.ranks = start, ranks
        self.dist: DistContext | None = None  # set by `moe.parallel.sharding.connect_ranks`

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows = torch.where(inside[..., None], rows, 0)
        return self.dist.all_reduce(rows, self.ranks) if self.dist is not None else rows


def split_embedding(model: Transformer, ranks: tuple[int, ...], rank: int) -> None:
    """Keep this rank's share of the vocabulary's embedding rows."""
    cfg = model.cfg
    rows = balanced_slice(cfg.vocab_size, len(ranks), ranks.index(rank))
    with torch.device("meta"):
        model.tok_embeddings = VocabSlice(len(rows), cfg.dim, rows.start, ranks)
    model.slices = slices_of(model) | {"tok_embeddings.weight": (0, rows.start, rows.stop)}


def reduce_attention_output(model: Transformer, block: str, ranks: tuple[int, ...], dist: DistContext) -> None:
    """The row-parallel output projection's all-reduce, as a forward hook: the model's code stays single-device."""
    def all_reduce(module, args, out: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce(out, ranks)

    model.layers[block].attention.register_forward_hook(all_reduce)


class TensorDispatcher(LocalDispatcher):
    """Experts split over a group that holds every token: each rank runs its slice of every routed expert and one
    all-reduce over the group sums the weighted partial results (no rows cross ranks)."""

    def __init__(self, n_experts: int, ranks: tuple[int, ...], dist: DistContext) -> None:
        super().__init__(n_experts)
        self.ranks, self.dist = ranks, dist

    def combine(self, y_ND: torch.Tensor, meta) -> torch.Tensor:
        return self.dist.all_reduce(weighted_sum(y_ND, meta), self.ranks)

    def combine_with(self, y_ND: torch.Tensor, meta, partial_TD: torch.Tensor) -> torch.Tensor:
        return self.dist.all_reduce(weighted_sum(y_ND, meta) + partial_TD, self.ranks)
