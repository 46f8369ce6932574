"""How an inference model holds its linear weights: in the layout its kernel reads fastest, fused where
several products read the same input.

A loaded model has plain parameters (`weight [out, in]`); `prepare(model, kernels, int8)` converts each
linear weight once into a `LinearWeight`:

- `Dense`: the plain tensor and `F.linear` (GPUs; CPUs with `cpu_kernels="torch"`).
- `OneDNN`: reordered into oneDNN's blocked layout (`models.cpu_kernels`; CPU fp32/bf16).
- `Int8`: per-output-channel symmetric int8 (`scale = max|w_row| / 127`), products in the activation dtype.

Fusion (`fused`): q/k/v read the same normalised input, as do each expert's w1/w3, so one weight with their
rows stacked gives all of them in one product: a decode step makes 49 products instead of 81 on `small`.
The original parameters keep their names and shapes on the meta device; `dense()` gives each back
(bit-exactly, except from int8), so `state_dict()` and saving see an ordinary model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import cpu_kernels

INT8 = "int8"  # the weight-only precision's name in `dtype=` (activations bf16)
# Up to this many rows an int8 product runs torch's weight-only kernel, which reads the int8 weight directly
# (on this CPU 1.4x faster than oneDNN's bf16 for one row, 2x slower for 8). Larger products (prefill,
# batches) are bound by arithmetic, not reads: x q^T in the activation dtype (int8 values are exact in bf16),
# then the scales. Measured against the kernel on 512 x 512 @ 512 x 3584: within one bf16 step everywhere,
# 3.5x faster than the same product in fp32; scaling the weight before the product instead (q * scale
# rounded to bf16) loses whole digits where a row's terms cancel.
INT8_KERNEL_MAX_ROWS = 4


class LinearWeight:
    """`w(x)` = x @ weight.T for x [..., in]; `dense()` the [out, in] weight as a plain tensor."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        raise NotImplementedError


class Dense(LinearWeight):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.out_features = weight.detach(), weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dense(self) -> torch.Tensor:
        return self.weight


class OneDNN(LinearWeight):
    def __init__(self, weight: torch.Tensor) -> None:
        self.packed, self.out_features = cpu_kernels.pack(weight), weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, self.packed)

    def dense(self) -> torch.Tensor:
        return cpu_kernels.unpack(self.packed)


class Int8(LinearWeight):
    def __init__(self, weight: torch.Tensor) -> None:
        self.q, scale = quantize(weight)
        self.scale = scale.to(weight.dtype)  # the kernel takes scales in the activation dtype
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x.device.type == "cpu" and x2.shape[0] <= INT8_KERNEL_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.q, self.scale)
        else:  # many rows, or a GPU (never run on CUDA)
            out = F.linear(x2, self.q.to(x.dtype)) * self.scale
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [out, in] int8, scale [out] fp32) with weight ~ q * scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Part(LinearWeight):
    """Rows start:stop of a fused weight: what a parameter that was fused into another still is."""

    def __init__(self, whole: LinearWeight, start: int, stop: int) -> None:
        self.whole, self.start, self.stop, self.out_features = whole, start, stop, stop - start

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start:self.stop]

    def dense(self) -> torch.Tensor:
        return self.whole.dense()[self.start:self.stop]


def format_for(weight: torch.Tensor, kernels: str, int8: bool) -> type[LinearWeight]:
    """The fastest format for this weight: int8 when asked, oneDNN on a CPU that runs its dtype, else dense."""
    if int8:
        return Int8
    if kernels == "onednn" and cpu_kernels.can_pack(weight):
        return OneDNN
    return Dense


def make(weight: torch.Tensor, kernels: str, int8: bool) -> LinearWeight:
    return format_for(weight, kernels, int8)(weight)


def fused(weights: list[torch.Tensor], kernels: str, int8: bool) -> tuple[LinearWeight, list[Part]]:
    """One weight of the stacked rows, and each input weight as a part of it."""
    whole = make(torch.cat([w.detach() for w in weights]), kernels, int8)
    parts, start = [], 0
    for w in weights:
        parts.append(Part(whole, start, start + w.shape[0]))
        start += w.shape[0]
    return whole, parts


def shape_only(weight: torch.Tensor) -> nn.Parameter:
    """What stays of a converted parameter: its name, shape and dtype (on the meta device, no memory)."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def prepare(model: nn.Module, kernels: str = "onednn", int8: bool = False) -> None:
    """Convert every linear weight of an inference model (modules with `prepare_weights(kernels, int8)`),
    once; parents fuse their children's weights first. Embeddings, norms and routers stay as they are."""
    for module in model.modules():
        if hasattr(module, "prepare_weights"):
            module.prepare_weights(kernels, int8)
