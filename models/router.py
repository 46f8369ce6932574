"""The router: gate logits -> (weights [T, K] fp32, expert ids [T, K]) by the family's kind, and the checksum of
its choices that ranks routing the same tokens compare.

Shapes: T tokens, D model dim, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Gate logits -> (weights [T, K] fp32, expert ids [T, K]). Kinds (`ModelConfig.router`): "mixtral", the
    softmax of the top-k logits; "softmax", the top-k of every expert's probability, renormalised only where
    `renormalise` (Qwen2/3-MoE, OLMoE); "sparsemixer", PhiMoE's top-2 (`sparsemixer`)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, kind: str = "mixtral", renormalise: bool = True,
                 jitter: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.kind, self.renormalise, self.jitter = kind, renormalise, jitter
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

    def forward(self, x_TD: torch.Tensor, counting: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`counting`: this rank keeps the entropy of these tokens (False where another rank routes them too)."""
        T = x_TD.shape[0]
        if self.weight is None or self.round_robin:
            ids_TK = torch.arange(T * self.top_k, device=x_TD.device).view(T, self.top_k) % self.n_experts
            weights_TK = torch.full((T, self.top_k), 1.0 / self.top_k, device=x_TD.device)
            return weights_TK, ids_TK
        logits_TE = F.linear(x_TD, self.weight, self.bias).float()
        if self.track_entropy and counting:
            with torch.no_grad():
                logp_TE = torch.log_softmax(logits_TE, dim=-1)
                self.entropy_sum -= (logp_TE.exp() * logp_TE).sum().double()
                self.entropy_tokens += T
        if self.training:
            self.last_logits_TE = logits_TE
        if self.kind == "sparsemixer":
            return sparsemixer(logits_TE, self.jitter)
        if self.kind == "softmax":
            top_TK, ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.top_k, dim=-1)
            if self.renormalise:
                top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
            return top_TK.to(x_TD.dtype).float(), ids_TK  # rounded to the activations' precision, as transformers
        top_logits_TK, ids_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        return torch.softmax(top_logits_TK, dim=-1), ids_TK


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


def routing_checksum(ids_TK: torch.Tensor) -> torch.Tensor:
    """A number that changes when any token's choice of experts does: each chosen id weighted by its place."""
    flat = ids_TK.reshape(-1)
    return ((flat + 1) * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()
