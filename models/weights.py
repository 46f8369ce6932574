"""How an inference model holds its linear weights: in the layout its kernel reads fastest, fused where
several products read the same input.

A loaded model has plain parameters (`weight [out, in]`); `prepare(model, kernels, int8)` converts each
linear weight once into a `LinearWeight`:

- `Streamed`: the plain tensor; up to `matvec.MAX_ROWS` rows (decode steps) run the streaming kernel
  (`models.matvec`), more rows (prompts) the prompt kernel (`matvec.prompt_grouped`). CPU fp32/bf16 with
  `kernels="auto"`.
- `OneDNN`: reordered into oneDNN's blocked layout (`models.cpu_kernels`; CPU fp32/bf16, `kernels="onednn"`).
- `Dense`: the plain tensor and `F.linear` (GPUs; CPUs with `kernels="torch"`).
- `Int8`: per-output-channel symmetric int8 (`scale = max|w_row| / 127`); with our kernels every product is an
  exact integer sum against activations rounded to int16, whatever the number of rows.

`kernels="auto"` (the default) falls back to `"onednn"` where the streaming kernel cannot be built.

Fusion (`fused`): q/k/v read the same normalised input, as do each expert's w1/w3, so one weight with their
rows stacked gives all of them in one product: a decode step makes 49 products instead of 81 on `small`.
The original parameters keep their names and shapes on the meta device; `dense()` gives each back
(bit-exactly, except from int8), so `state_dict()` and saving see an ordinary model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models import cpu_kernels, matvec

KERNELS = ("auto", "onednn", "torch")  # choices for MoEModel.from_pretrained(cpu_kernels=...)

INT8 = "int8"  # the weight-only precision's name in `dtype=` (activations bf16)
# Up to this many rows an int8 product without the streaming kernel (`kernels="onednn"`, and every GPU) runs
# torch's weight-only kernel (`_weight_int8pack_mm`, on CPU and CUDA), which reads the int8 weight directly: no
# weight-sized temporary per decode step (on this CPU 1.4x faster than oneDNN's bf16 for one row, 2x slower for
# 8; never run on CUDA). Larger products (prefill, batches) are bound by arithmetic, not reads: x q^T in the
# activation dtype (int8 values are exact in bf16), then the fp32 scales. Measured against the kernel on
# 512 x 512 @ 512 x 3584: within one bf16 step everywhere, 3.5x faster than the same product in fp32; scaling
# the weight before the product instead (q * scale rounded to bf16) loses whole digits where a row's terms cancel.
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


class Streamed(LinearWeight):
    """The plain weight, read by the streaming kernel for a few rows and by the prompt kernel for many
    (`prompt_kernel`). Where that is not built with AVX2, or for bf16 on CPUs with bf16 instructions, prompts go to
    oneDNN from the plain weight (0-35% slower than its packed layout from 64 rows on, the price of holding one
    copy), or, bf16 without those instructions, widened to fp32 first (`cpu_kernels.widened`)."""

    def __init__(self, weight: torch.Tensor, max_rows: int = matvec.MAX_ROWS) -> None:
        """`max_rows`: up to this many rows the streaming kernel runs (an expert's: as many as its block's grouped
        call takes, so the expert gives a row the same bits alone or grouped, whichever path its rank takes)."""
        self.weight, self.out_features, self.max_rows = weight.detach().contiguous(), weight.shape[0], max_rows
        self.prompts, self.onednn = prompt_kernel(self.weight), cpu_kernels.can_pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if matvec.takes(x2.shape[0], self.max_rows):
            out = matvec.grouped(x2, self.weight[None])
        elif self.prompts:
            out = matvec.prompt_grouped(x2, self.weight[None])
        elif self.onednn:
            out = cpu_kernels.linear(x2, self.weight)
        elif x2.dtype == torch.bfloat16 and not cpu_kernels.native_bf16():
            out = cpu_kernels.widened(x2, self.weight).to(x.dtype)
        else:
            out = F.linear(x2, self.weight)
        return out.view(*x.shape[:-1], self.out_features)

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
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, stream: bool) -> None:
        """q [out, in] int8 and its fp32 scales [out] (`quantize`); `dtype` the activations'; `stream`: our kernels
        run it (few rows the streaming kernel, prompts `matvec.prompt_grouped`: exact integer sums, the same bits
        per row), else torch's weight-only kernel and widened products."""
        self.q, self.scale32, self.scale = q, scale, scale.to(dtype)
        self.out_features, self.stream = q.shape[0], stream
        self.prompts = stream and matvec.prompts()  # decided once, as for `Streamed`

    @classmethod
    def of(cls, weight: torch.Tensor, kernels: str = "auto") -> Int8:
        return cls(*quantize(weight), weight.dtype, streams(weight, kernels))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.stream and matvec.takes(x2.shape[0]):
            out = matvec.grouped(x2, self.q[None], None, self.scale32[None])
        elif self.prompts:  # the same bits per row as the decode kernel's
            out = matvec.prompt_grouped(x2, self.q[None], None, self.scale32[None])
        elif x2.shape[0] <= INT8_KERNEL_MAX_ROWS:  # torch's weight-only kernel: the int8 weight read as it is
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.q, self.scale)
        elif x.device.type == "cpu" and not cpu_kernels.native_bf16():  # many rows, no bf16 instructions
            out = cpu_kernels.widened(x2, self.q).mul_(self.scale32).to(x.dtype)
        else:  # many rows with bf16 instructions, or a GPU's tensor cores
            out = (F.linear(x2, self.q.to(x.dtype)).float() * self.scale32).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [out, in] int8, scale [out] fp32) with weight ~ q * scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_each(weights_E: Iterable[torch.Tensor], shape: tuple[int, int, int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked (q [E, out, in], scale [E, out]) of E weights, quantized as they come (one weight and its fp32
    copy at a time). E may be 0: a rank that holds none of a block's experts."""
    q = torch.empty(shape, dtype=torch.int8, device=device)
    scale = torch.empty(q.shape[:2], device=device)
    for e, w in enumerate(weights_E):
        q[e], scale[e] = quantize(w)
    return q, scale


class Part(LinearWeight):
    """Rows start:stop of a fused weight: what a parameter that was fused into another still is."""

    def __init__(self, whole: LinearWeight, start: int, stop: int) -> None:
        self.whole, self.start, self.stop, self.out_features = whole, start, stop, stop - start

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start:self.stop]

    def dense(self) -> torch.Tensor:
        return self.whole.dense()[self.start:self.stop]


def prompt_kernel(weight: torch.Tensor) -> bool:
    """Prompts against this streamed fp32 or bf16 weight run our prompt kernel (`matvec.prompt_grouped`), faster
    here than oneDNN: bf16 on CPUs without bf16 instructions (oneDNN needs the weight widened first), and fp32."""
    return matvec.prompts() and (weight.dtype == torch.float32 or not cpu_kernels.native_bf16())


def streams(weight: torch.Tensor, kernels: str) -> bool:
    """The streaming kernel reads this weight: asked for ("auto"), on a CPU where it could be built (once per
    torch installation)."""
    return kernels == "auto" and weight.device.type == "cpu" and not weight.is_meta and matvec.available()


def format_for(weight: torch.Tensor, kernels: str, int8: bool) -> type[LinearWeight]:
    """The fastest format for this weight: int8 when asked; on a CPU the streaming kernel ("auto") or oneDNN,
    where they run its dtype; else dense."""
    if int8:
        return Int8
    if weight.dtype in (torch.float32, torch.bfloat16) and streams(weight, kernels):
        return Streamed
    if kernels in ("auto", "onednn") and cpu_kernels.can_pack(weight):
        return OneDNN
    return Dense


def make(weight: torch.Tensor, kernels: str, int8: bool) -> LinearWeight:
    fmt = format_for(weight, kernels, int8)
    return Int8.of(weight, kernels) if fmt is Int8 else fmt(weight)


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


def prepare(model: nn.Module, kernels: str = "auto", int8: bool = False) -> None:
    """Convert every linear weight of an inference model (modules with `prepare_weights(kernels, int8)`),
    once; parents fuse their children's weights first. Embeddings, norms and routers stay as they are."""
    for module in model.modules():
        if hasattr(module, "prepare_weights"):
            module.prepare_weights(kernels, int8)
