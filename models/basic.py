"""Linear and embedding layers that allocate without initialising, plus explicit initialisation.

Models are built on the meta device and filled from checkpoints; running an init kernel there would
pull in torch's Python meta registrations (~75 MB of resident memory per rank) for nothing. Training
from scratch calls `init_weights` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import weights
from models.kernels.choice import KernelChoice


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: weights.LinearWeight | None = None  # the weight in its inference format (models.weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight)
        return out + self.bias if self.bias is not None else out

    def prepare_weights(self, choice: KernelChoice) -> None:
        """For inference: keep the weight only in its fastest format; `weight` keeps just its shape."""
        if self.kernel is None and not self.weight.is_meta:  # not converted yet, nor fused into a parent's
            self.kernel = weights.make(self.weight, choice)
            self.weight = weights.shape_only(self.weight)

    def dense(self, name: str) -> torch.Tensor:
        """Parameter `name` as a plain tensor (converted back if converted)."""
        return self.kernel.dense() if self.kernel is not None and name == "weight" else getattr(self, name).detach()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.kernel is not None:
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


def hooked(*modules: nn.Module | None) -> bool:
    """Whether calling these modules would run a hook (theirs, or one registered for every module): code that calls
    ops in their place (`models.kernels.decode_block`, `models.decode_plan`) must call them instead, so that the
    hook runs (a tensor-parallel rank's sum over ranks is one; a user's capture of activations another)."""
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks) or any(
        m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)
