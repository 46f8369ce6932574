"""The experts of one block, stacked: w1 [El, F, D] (gate), w3 [El, F, D] (up), w2 [El, D, F] (down) for the global
experts `expert_ids`, optionally with biases b1, b3 [El, F] and b2 [El, D] (gpt-oss), and the gated unit that joins
gate and up (`Glu`). They see only token copies already grouped by expert (`models.mixture`).

Shapes: N grouped copies, D model dim, F expert hidden dim, El experts held here.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class Glu:
    """The gated unit (`ModelConfig.glu`): "silu", silu(gate) * up (SwiGLU); "clamped", gpt-oss's
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), in transformers' order."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    native: bool = False  # an inference model on native kernels: SwiGLU of fused halves in one op, the same bits

    @classmethod
    def of(cls, cfg: ModelConfig) -> Glu:
        return cls(cfg.glu, cfg.glu_alpha, cfg.glu_limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamped":
            gate = gate.clamp(max=self.limit)
            return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return F.silu(gate) * up
        return F.silu(gate).mul_(up)  # a new tensor, multiplied in place: one temporary fewer

    def halves(self, h: torch.Tensor) -> torch.Tensor:
        """The unit of h [N, 2F], gate columns first (w1 and w3 fused)."""
        if self.kind == "silu" and native.glue_runs(self.native):
            return native.silu_mul(h)
        hidden = h.shape[-1] // 2
        return self(h[:, :hidden], h[:, hidden:])


def with_zero_row(bias_El: torch.Tensor | None) -> torch.Tensor | None:
    """[El + 1, W]: the experts' biases and a row of zeros, for grouped rows past the last group (`row_bias`)."""
    return None if bias_El is None else torch.cat([bias_El, bias_El.new_zeros(1, bias_El.shape[1])]).detach()


def row_bias(padded: torch.Tensor, counts_El: torch.Tensor, rows: int) -> torch.Tensor:
    """Each grouped row's expert's bias [rows, W] from `with_zero_row`'s table (rows past the last group get zeros),
    found on the device by a search of the groups' ends: no host read of the counts."""
    ends = counts_El.cumsum(0)
    return padded[torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)]


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, expert_ids: list[int], glu: Glu = Glu(), bias: bool = False,
                 out_bias: bool | None = None) -> None:
        """`out_bias` (default: `bias`): whether b2 is held here; under tensor-parallel experts only the group's first
        rank adds it, once, before the group's sum."""
        super().__init__()
        self.expert_ids = list(expert_ids)  # global id of each stacked expert, in order
        n = len(self.expert_ids)
        self.glu = glu
        self.w1 = nn.Parameter(torch.empty(n, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden_dim, dim))
        self.b1 = nn.Parameter(torch.empty(n, hidden_dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n, hidden_dim)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n, dim)) if (bias if out_bias is None else out_bias) else None
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
        # Inference: (b1 and b3 side by side, as w13's products come out, and b2), each [El + 1, W] with a zero row
        # (`with_zero_row`), made once rather than at every step.
        self.biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    @classmethod
    def of(cls, cfg: ModelConfig, expert_ids: list[int], hidden_dim: int | None = None,
           out_bias: bool = True) -> GroupedExperts:
        """The experts `expert_ids` of a block of this config (`hidden_dim`: a tensor-parallel slice's width)."""
        return cls(cfg.dim, hidden_dim or cfg.hidden_dim, expert_ids, Glu.of(cfg), cfg.expert_bias,
                   cfg.expert_bias and out_bias)

    @property
    def decode_rows(self) -> int:
        """Up to this many copies the stacks run the decode kernel, which reads each expert's weight once for its
        rows: `native.EXPERT_MAX_ROWS`, or `native.MAX_ROWS` per local expert on average where prompts run the
        prompt kernel (a batch over many small experts, whose few rows each would spend its time widening weights;
        both kernels give a row the same bits, so a rank's share of a batch may take either). Where prompts run
        oneDNN, an expert's rows past EXPERT_MAX_ROWS take oneDNN's bits on every rank count (`prepare_weights`)."""
        if self.choice is None or not self.choice.native_prompts:
            return native.EXPERT_MAX_ROWS
        return max(native.EXPERT_MAX_ROWS, native.MAX_ROWS * len(self.expert_ids))

    def forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor | list[int]) -> torch.Tensor:
        """x_ND holds counts_El[0] copies for stacked expert 0, then counts_El[1] for expert 1, ...
        A dispatcher that already read the counts on the host passes them as a list."""
        path = self.choice.product(x_ND.shape[0], self.decode_rows) if self.choice else None
        if self.stacks is not None and path in (kc.NATIVE_DECODE, kc.NATIVE_PROMPT):
            # dtype given: a rank holding none of the block's experts gets [] from the all-to-all (torch: float)
            counts = counts_El if isinstance(counts_El, torch.Tensor) and counts_El.dtype == torch.long else \
                torch.as_tensor(counts_El, dtype=torch.long, device=x_ND.device)
            return self.streamed_forward(x_ND, counts, native.grouped if path == kc.NATIVE_DECODE
                                         else native.prompt_grouped)
        if self.offsets_on_device and self.stacks is not None and isinstance(counts_El, torch.Tensor):
            return self.grouped(x_ND, counts_El)
        # One host sync per layer (none if the dispatcher read them): the counts decide which experts run.
        counts = counts_El.tolist() if isinstance(counts_El, torch.Tensor) else counts_El
        if (self.stacks is not None and self.choice is not None and self.choice.native and counts
                and max(counts) <= native.EXPERT_MAX_ROWS and sum(counts) == x_ND.shape[0]):
            # Every expert's rows would take the decode kernel, a call each (`prepare_weights`): one grouped call
            # instead (bf16 prompts on oneDNN, a batch over many experts), the same bits.
            counts_t = torch.as_tensor(counts, dtype=torch.long, device=x_ND.device)
            return self.streamed_forward(x_ND, counts_t, native.grouped)
        training = torch.is_grad_enabled() and self.w1.requires_grad
        # unbind: one view per expert, whose backward stacks the gradients once (indexing would zero-fill)
        stacks = list(zip(self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0), strict=True)) if training else None
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue  # an expert that got no token does not run
            outs.append(self.one_expert(e, x_ND[start:start + n], stacks))
            start += n
        # Concatenating (not writing into slices of a buffer) keeps the backward pass free of zero-filled copies.
        return torch.cat(outs) if outs else x_ND.new_empty((0, self.w2.shape[1]))

    def one_expert(self, e: int, x: torch.Tensor, stacks: list | None) -> torch.Tensor:
        """Stacked expert `e` on its rows `x`: through its inference kernels, else its weights (the unbound views
        `stacks` while training; indexing only the experts that run)."""
        if self.kernels is not None:
            (w13, w2), (b13, b2) = self.kernels[e], self.biases
            h = w13(x) if b13 is None else w13(x) + b13[e]
            y = w2(self.glu.halves(h))
            return y if b2 is None else y + b2[e]
        w1, w2, w3 = stacks[e] if stacks else (self.w1[e], self.w2[e], self.w3[e])
        gate, up = F.linear(x, w1), F.linear(x, w3)
        if self.b1 is not None:
            gate, up = gate + self.b1[e], up + self.b3[e]
        y = F.linear(self.glu(gate, up), w2)
        return y if self.b2 is None else y + self.b2[e]

    def prepare_weights(self, choice: KernelChoice) -> None:
        """For inference: each expert's w1/w3 fused and w2, in their fastest format; the stacks keep shapes."""
        if self.kernels is not None or self.w1.is_meta:
            return
        self.choice = choice
        self.glu = dataclasses.replace(self.glu, native=choice.native)
        if self.b1 is not None:
            self.biases = (with_zero_row(torch.cat([self.b1, self.b3], dim=1)), with_zero_row(self.b2))
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

    def streams(self, rows: int) -> bool:
        """`rows` grouped copies run as `decode_block.routed_experts` runs them: the stacks through the native decode
        kernel, no biases, SwiGLU in one op."""
        return (self.stacks is not None and self.biases == (None, None) and self.glu.kind == "silu"
                and self.glu.native and self.choice.product(rows, self.decode_rows) == kc.NATIVE_DECODE)

    def expert_reads(self, with_rows: int) -> list[tuple]:
        """The expert products of a decode step where `with_rows` experts get a row each, as
        `models.weights.decode_reads` gives them, where the stacks stream through the native kernel."""
        if self.stacks is None or not (self.choice and self.choice.native) or not len(self.expert_ids):
            return []
        counts = torch.zeros(len(self.expert_ids), dtype=torch.long, device=self.stacks[0].device)
        counts[:with_rows] = 1
        (w13, w2), (s13, s2) = self.stacks, self.scales or (None, None)
        return [(w13, counts, s13), (w2, counts, s2)]

    @staticmethod
    def _biased(y_NW: torch.Tensor, padded: torch.Tensor | None, counts_El: torch.Tensor) -> torch.Tensor:
        return y_NW if padded is None else y_NW + row_bias(padded, counts_El, y_NW.shape[0])

    def streamed_forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor, product) -> torch.Tensor:
        """All local experts in two calls of the native decode kernel (`product`; prompts: `native.prompt_grouped`;
        int8: the same bits per row), which reads the counts itself and only the weights of experts that got rows.
        Rows past the last group come out as zeros."""
        (w13, w2), (s13, s2), (b13, b2) = self.stacks, self.scales or (None, None), self.biases
        h = self._biased(product(x_ND, w13, counts_El, s13), b13, counts_El)
        return self._biased(product(self.glu.halves(h), w2, counts_El, s2), b2, counts_El)

    def grouped(self, x_ND: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        """All local experts in two grouped products whose group offsets stay on the device. Rows past the
        last offset (copies for no expert here, sorted last by the gathering dispatcher) come out as zeros."""
        (w13, w2), (b13, b2) = self.stacks, self.biases
        offsets = counts_El.cumsum(0).to(torch.int32)
        h = self._biased(torch._grouped_mm(x_ND, w13.transpose(1, 2), offs=offsets), b13, counts_El)
        y = self._biased(torch._grouped_mm(self.glu.halves(h), w2.transpose(1, 2), offs=offsets), b2, counts_El)
        computed = torch.arange(x_ND.shape[0], device=x_ND.device) < offsets[-1]
        return torch.where(computed[:, None], y, 0)  # rows _grouped_mm did not write hold whatever memory held

    def dense(self, name: str) -> torch.Tensor:
        """Stacked weight `name` ("w1", "w2", "w3") as a plain tensor (converted back if converted)."""
        if self.kernels is None or name not in ("w1", "w2", "w3"):
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
