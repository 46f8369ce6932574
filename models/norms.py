"""The norms of the families: RMSNorm (its weight applied after the cast back, or before it as gpt-oss does) and
LayerNorm with a bias (PhiMoE), each normalising in fp32 as its reference does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.kernels import native


class LayerNorm(nn.Module):
    """LayerNorm with a bias (PhiMoE's norms), normalised in fp32 as torch's own does in reduced precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def runs_natively(self, x: torch.Tensor) -> bool:
        return False  # no native op of its own


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The family's norm (`ModelConfig.norm`)."""
    if cfg.norm == "layer":
        return LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, weight_in_fp32=cfg.norm == "rms_fp32")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32
        self.weight = nn.Parameter(torch.ones(dim))
        self.native = False  # an inference model on native kernels: one op (`native.rms_norm`), not eight

    def prepare_weights(self, choice) -> None:
        self.native = choice.native

    def runs_natively(self, x: torch.Tensor) -> bool:
        """`native.rms_norm` normalises `x` (and the ops that chain the norm in C++ may: `operands`)."""
        return native.glue_runs(self.native) and x.dtype == self.weight.dtype

    @property
    def operands(self) -> tuple[torch.Tensor, float, bool]:
        return self.weight, self.eps, self.weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_natively(x):
            return native.rms_norm(x, self.weight, self.eps, self.weight_in_fp32)
        # Normalise in fp32 and cast back before the weight (Llama, Mixtral), or after it (gpt-oss), as each
        # family's reference does, so bf16 matches it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype) if self.weight_in_fp32 else self.weight * x32.to(x.dtype)
