"""Linear and embedding layers that allocate without initialising, plus explicit initialisation.

Models are built on the meta device and filled from checkpoints; running an init kernel there would
pull in torch's Python meta registrations (~75 MB of resident memory per rank) for nothing. Training
from scratch calls `init_weights` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import cpu_kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.packed: torch.Tensor | None = None  # oneDNN layout for CPU inference (models.cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed)
        return F.linear(x, self.weight)

    def pack_weights(self) -> bool:
        """For CPU inference: keep the weight in oneDNN's layout only; `weight` keeps just its shape."""
        if self.packed is not None or not cpu_kernels.can_pack(self.weight):
            return False
        self.packed = cpu_kernels.pack(self.weight)
        self.weight = cpu_kernels.shape_only(self.weight)
        return True

    def dense(self, name: str) -> torch.Tensor:
        """Parameter `name` as a dense tensor (unpacked if packed)."""
        return cpu_kernels.unpack(self.packed) if self.packed is not None else getattr(self, name).detach()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None:
            destination[prefix + "weight"] = self.dense("weight")


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Norm weights to one, everything else normal(0, std)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=generator)
