"""How an inference model holds its linear weights: in the layout its kernel reads fastest, fused where
several products read the same input.

A loaded model has plain parameters (`weight [out, in]`); `prepare(model, choice)` converts each linear weight
once into a `LinearWeight`, in the format the model's `KernelChoice` (`models.kernels.choice`) names:

- `Streamed`: the plain tensor, read by the native kernels (decode rows and, where they run them, prompts).
- `OneDNN`: reordered into oneDNN's blocked layout (`models.kernels.onednn`; CPU fp32/bf16, `cpu_kernels="onednn"`,
  and "auto" where the native kernels do not run).
- `Dense`: the plain tensor (GPUs; CPUs with `cpu_kernels="torch"`).
- `Int8`: per-output-channel symmetric int8 (`scale = max|w_row| / 127`); with the native kernels every product is
  an exact integer sum against activations rounded to int16, whatever the number of rows.

Each call asks the choice which product runs its rows (`KernelChoice.product`); the weight only carries it out.

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

from models.kernels import choice as kc
from models.kernels import native, onednn
from models.kernels.choice import KernelChoice

INT8 = "int8"  # the weight-only precision's name in `dtype=` (activations bf16)


class LinearWeight:
    """`w(x)` = x @ weight.T for x [..., in]; `dense()` the [out, in] weight as a plain tensor."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        raise NotImplementedError

    def native_operands(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, int8 scale or None) as the native decode kernel takes them, where `rows` rows run it; None where
        another product runs them (ops that chain this product in C++ take these: `models.kernels.decode_block`)."""
        return None


def float_product(path: str, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 [N, in] @ weight.T by the product `path` names (`KernelChoice.product`), for a plain fp32/bf16 weight; the
    native decode product is `Dense`'s own, on rows as they come."""
    if path == kc.NATIVE_PROMPT:
        return native.prompt_grouped(x2, weight[None])
    if path == kc.ONEDNN:  # the plain weight: 0-35% slower than the packed layout from 64 rows on, one copy held
        return onednn.linear(x2, weight)
    if path == kc.WIDENED:
        return onednn.widened(x2, weight).to(x2.dtype)
    return F.linear(x2, weight)


class Dense(LinearWeight):
    """The plain weight; `max_rows`: up to this many rows the native decode kernel runs, where it does (an expert's:
    as many as its block's grouped call takes, so the expert gives a row the same bits alone or grouped, whichever
    path its rank takes)."""

    def __init__(self, weight: torch.Tensor, choice: KernelChoice, max_rows: int = native.MAX_ROWS) -> None:
        self.weight, self.out_features = weight.detach().contiguous(), weight.shape[0]
        self.choice, self.max_rows = choice, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.choice.product(x.numel() // x.shape[-1], self.max_rows)
        if path == kc.NATIVE_DECODE:  # rows as they come, no reshape and view around the product
            return native.grouped(x, self.weight)
        x2 = x.reshape(-1, x.shape[-1])
        return float_product(path, x2, self.weight).view(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        return self.weight

    def native_operands(self, rows: int) -> tuple[torch.Tensor, None] | None:
        return (self.weight, None) if self.choice.product(rows, self.max_rows) == kc.NATIVE_DECODE else None


class Streamed(Dense):
    """A plain weight that the native kernels read (the choice's `native`)."""


class OneDNN(LinearWeight):
    def __init__(self, weight: torch.Tensor, choice: KernelChoice, max_rows: int = native.MAX_ROWS) -> None:
        self.packed, self.out_features = onednn.pack(weight), weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.packed)

    def dense(self) -> torch.Tensor:
        return onednn.unpack(self.packed)


class Int8(LinearWeight):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, choice: KernelChoice) -> None:
        """q [out, in] int8 and its fp32 scales [out] (`quantize`); `dtype` the activations'."""
        self.q, self.scale32, self.scale = q, scale, scale.to(dtype)
        self.out_features, self.choice = q.shape[0], choice

    @property
    def stream(self) -> bool:
        return self.choice.native

    @classmethod
    def of(cls, weight: torch.Tensor, choice: KernelChoice | None = None) -> Int8:
        """`weight` quantized; its products as `choice` says (by default what "auto" runs on its device)."""
        return cls(*quantize(weight), weight.dtype, choice or kc.choose("auto", weight.device, weight.dtype, True))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.choice.product(x.numel() // x.shape[-1])
        if path == kc.NATIVE_DECODE:  # rows as they come, no reshape and view around the product
            return native.grouped(x, self.q, None, self.scale32)
        x2 = x.reshape(-1, x.shape[-1])
        if path == kc.NATIVE_PROMPT:  # the same bits per row as the decode kernel's
            out = native.prompt_grouped(x2, self.q[None], None, self.scale32[None])
        elif path == kc.INT8_KERNEL:  # torch's weight-only kernel: the int8 weight read as it is
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.q, self.scale)
        elif path == kc.WIDENED:  # many rows on a CPU without bf16 instructions
            out = onednn.widened(x2, self.q).mul_(self.scale32).to(x.dtype)
        else:  # many rows on a CPU with bf16 instructions: x q^T in bf16 (exact int8 values), then the fp32 scales
            out = (F.linear(x2, self.q.to(x.dtype)).float() * self.scale32).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]

    def native_operands(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.q, self.scale32) if self.choice.product(rows) == kc.NATIVE_DECODE else None


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


def format_for(weight: torch.Tensor, choice: KernelChoice) -> type[LinearWeight]:
    """The format `choice` reads this weight in."""
    if choice.int8:
        return Int8
    if choice.native:
        return Streamed
    return OneDNN if choice.asked != "torch" and onednn.can_pack(weight) else Dense


def make(weight: torch.Tensor, choice: KernelChoice) -> LinearWeight:
    fmt = format_for(weight, choice)
    return Int8.of(weight, choice) if fmt is Int8 else fmt(weight, choice)


def fused(weights: list[torch.Tensor], choice: KernelChoice) -> tuple[LinearWeight, list[Part]]:
    """One weight of the stacked rows, and each input weight as a part of it."""
    whole = make(torch.cat([w.detach() for w in weights]), choice)
    parts, start = [], 0
    for w in weights:
        parts.append(Part(whole, start, start + w.shape[0]))
        start += w.shape[0]
    return whole, parts


def shape_only(weight: torch.Tensor) -> nn.Parameter:
    """What stays of a converted parameter: its name, shape and dtype (on the meta device, no memory)."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def decode_reads(model: nn.Module) -> list[tuple]:
    """A batch-1 decode step's reads of streamed weights (`Streamed`, `Int8` on the native kernels) as calls of
    `native.grouped` without their rows: (weight, rows per expert or None, scale or None). Routed experts' come
    from their block (`decode_reads`: top-k experts with a row each). What `models.kernels.tuning` times."""
    reads: list[tuple] = []
    for module in model.modules():
        if hasattr(module, "decode_reads"):
            reads += module.decode_reads()
        for value in vars(module).values():
            if isinstance(value, Streamed):
                reads.append((value.weight, None, None))
            elif isinstance(value, Int8) and value.stream:
                reads.append((value.q, None, value.scale32))
    return reads


def prepare(model: nn.Module, choice: KernelChoice) -> None:
    """Convert every linear weight of an inference model (modules with `prepare_weights(choice)`), once; parents
    fuse their children's weights first. Embeddings, norms and routers stay as they are."""
    for module in model.modules():
        if hasattr(module, "prepare_weights"):
            module.prepare_weights(choice)
