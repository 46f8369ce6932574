"""The router: gate logits -> (weights [T, K] fp32, expert ids [T, K]) by the family's kind, and the checksum of
its choices that ranks routing the same tokens compare.

Shapes: T tokens, D model dim, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.kernels.choice import KernelChoice
from models.weights import Dense


class Router(nn.Module):
    """Gate logits -> (weights [T, K] fp32, expert ids [T, K]). Kinds (`ModelConfig.router`): "mixtral", the
    softmax of the top-k logits; "softmax", the top-k of every expert's probability, renormalised only where
    `renormalise` (Qwen2/3-MoE, OLMoE); "sparsemixer", PhiMoE's top-2 (`sparsemixer`); "deepseek_v2",
    "deepseek_v2_grouped", "deepseek_v3" (`deepseek`), from fp32 logits as DeepSeek's reference computes them."""

    def __init__(self, dim: int, n_experts: int, top_k: int, kind: str = "mixtral", renormalise: bool = True,
                 jitter: float = 0.0, bias: bool = False, groups: tuple[int, int] = (1, 1), scaling: float = 1.0,
                 score_bias: bool = False) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.kind, self.renormalise, self.jitter = kind, renormalise, jitter
        self.groups, self.scaling = groups, scaling  # DeepSeek: (groups, groups chosen), the weights' factor
        # DeepSeek-V3's e_score_correction_bias: added to the scores to choose experts, never to weigh them
        self.score_bias = nn.Parameter(torch.empty(n_experts)) if score_bias else None
        # A dense checkpoint (E=1) has no gate: every token goes to expert 0 with weight 1.
        self.weight = nn.Parameter(torch.empty(n_experts, dim)) if n_experts > 1 else None
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias and n_experts > 1 else None  # gpt-oss
        # Debug mode: copy j of token t goes to expert (t*K + j) % E, weight 1/K; exact loads for tests.
        self.round_robin = False
        # Sum over routed tokens of the entropy of the full router distribution (for load reports), kept only
        # when asked for: it costs a few kernels per block and step that a plain decode should not pay.
        self.track_entropy = False
        self.register_buffer("entropy_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("entropy_tokens", torch.zeros((), dtype=torch.float64), persistent=False)
        # Training keeps the last gate logits (with their graph) for the load-balancing loss.
        self.last_logits_TE: torch.Tensor | None = None
        self.gate: Dense | None = None  # the gate's product in an inference model (`prepare_weights`)
        self.native = False  # an inference model on native kernels: the choice in one op (`native.route`)

    def prepare_weights(self, choice: KernelChoice) -> None:
        """An inference model's gate runs through the kernels its other products use where they are native: torch's
        bf16 product of one row against the 64x512 gate of `qwen3-moe` took 60 us, the native kernel 2 us (AMD EPYC
        Zen 4). A biased gate (gpt-oss) and DeepSeek's fp32 logits keep F.linear's rounding."""
        if choice.native and self.weight is not None and self.bias is None and not self.kind.startswith("deepseek"):
            self.gate = Dense(self.weight, choice)
        self.native = choice.native

    def forward(self, x_TD: torch.Tensor, counting: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`counting`: this rank keeps the entropy of these tokens (False where another rank routes them too)."""
        T = x_TD.shape[0]
        if self.weight is None or self.round_robin:
            ids_TK = torch.arange(T * self.top_k, device=x_TD.device).view(T, self.top_k) % self.n_experts
            weights_TK = torch.full((T, self.top_k), 1.0 / self.top_k, device=x_TD.device)
            return weights_TK, ids_TK
        if self.kind.startswith("deepseek"):
            logits = F.linear(x_TD.float(), self.weight.float())
        elif self.gate is not None and not self.training:
            logits = self.gate(x_TD)
        else:
            logits = F.linear(x_TD, self.weight, self.bias)
        if self.routes_natively(x_TD, counting):  # the op widens the logits itself
            return native.route(logits, self.top_k, self.route_kind, self.renormalise, x_TD.dtype == torch.bfloat16)
        logits_TE = logits.float()
        if self.track_entropy and counting:
            with torch.no_grad():
                logp_TE = torch.log_softmax(logits_TE, dim=-1)
                self.entropy_sum -= (logp_TE.exp() * logp_TE).sum().double()
                self.entropy_tokens += T
        if self.training:
            self.last_logits_TE = logits_TE
        if self.kind == "sparsemixer":
            return sparsemixer(logits_TE, self.jitter)
        if self.kind.startswith("deepseek"):
            return deepseek(logits_TE, self.kind, self.top_k, self.groups, self.renormalise, self.scaling,
                            self.score_bias)
        if self.kind == "softmax":
            top_TK, ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.top_k, dim=-1)
            if self.renormalise:
                top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
            return top_TK.to(x_TD.dtype).float(), ids_TK  # rounded to the activations' precision, as transformers
        top_logits_TK, ids_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        return torch.softmax(top_logits_TK, dim=-1), ids_TK

    def in_one_op(self, x_TD: torch.Tensor, counting: bool) -> bool:
        """The gate's product and the choice run as `decode_block.routed_experts` runs them: the native decode kernel
        for these rows, then `native.route` (no entropy kept, no debug round robin)."""
        return (self.gate is not None and not self.round_robin and self.routes_natively(x_TD, counting)
                and self.gate.native_operands(x_TD.numel() // x_TD.shape[-1]) is not None)

    @property
    def route_kind(self) -> int:
        """`native.route`'s number for this kind."""
        return 0 if self.kind == "mixtral" else 1

    def routes_natively(self, x_TD: torch.Tensor, counting: bool) -> bool:
        """`native.route` chooses for these rows (with the chain's bits): the kinds it knows, outside training and
        compiled steps, where this rank keeps no entropy of them."""
        kind_runs = self.kind == "mixtral" or (
            self.kind == "softmax" and (not self.renormalise or self.top_k in native.ROUTE_RENORMALISES))
        return (kind_runs and native.glue_runs(self.native) and not self.training
                and not (self.track_entropy and counting) and x_TD.dtype in (torch.float32, torch.bfloat16)
                and native.route_runs())


def sparsemixer(scores_TE: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's top-2 at inference: the best expert, weighted by the softmax over the experts whose score lies within
    a relative 2*jitter of the best; then the same around the second best, with the first left out. The two weights
    do not sum to 1."""
    weights, ids, masked = [], [], scores_TE
    for _ in range(2):
        best, at = masked.max(dim=-1, keepdim=True)
        far = (best - scores_TE) / scores_TE.abs().clamp(min=best) > 2 * jitter
        weights.append(torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1).gather(-1, at))
        ids.append(at)
        masked = masked.scatter(-1, at, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


def deepseek(logits_TE: torch.Tensor, kind: str, top_k: int, groups: tuple[int, int], renormalise: bool,
             scaling: float, score_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers, as transformers' deepseek_v2/v3 modeling files compute them. V2: softmax scores, the
    top-k of all ("deepseek_v2") or of the `groups[1]` groups with the best single score ("deepseek_v2_grouped").
    V3: sigmoid scores; experts chosen by score + `score_bias` within the `groups[1]` groups whose two best biased
    scores sum highest, weighted by their unbiased scores, renormalised if asked. Both times `scaling`."""
    n_groups, chosen = groups
    T, E = logits_TE.shape
    if kind == "deepseek_v3":
        scores = logits_TE.sigmoid()
        choice = scores + score_bias.float()
        group_scores = choice.view(T, n_groups, E // n_groups).topk(2, dim=-1).values.sum(-1)
    else:
        scores = choice = logits_TE.softmax(dim=-1)
        group_scores = scores.view(T, n_groups, E // n_groups).amax(-1)
    if kind != "deepseek_v2" and n_groups > 1:
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(chosen, dim=-1).indices, 1).bool()
        keep = keep[:, :, None].expand(T, n_groups, E // n_groups).reshape(T, E)
        choice = choice.masked_fill(~keep, float("-inf") if kind == "deepseek_v3" else 0.0)
    ids_TK = choice.topk(top_k, dim=-1).indices
    weights_TK = (scores if kind == "deepseek_v3" else choice).gather(1, ids_TK)  # V2: its masked scores, as there
    if kind == "deepseek_v3" and renormalise:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scaling, ids_TK


def routing_checksum(ids_TK: torch.Tensor) -> torch.Tensor:
    """A number that changes when any token's choice of experts does: each chosen id weighted by its place."""
    flat = ids_TK.reshape(-1)
    return ((flat + 1) * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()
