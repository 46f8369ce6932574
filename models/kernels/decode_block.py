"""A decode step's block in two ops (`csrc/decode_block.cpp`): the ops that eager Python calls one by one through
the block's modules, called in C++ in the same order on the same tensors, so the same bits. Each call from Python
costs 1-3 us of dispatch and the modules' own checks more; a batch-1 step of `qwen3-moe` (bf16, 2-core AMD EPYC
Zen 4) ran 151 ops. The model calls these where every part takes the native path (`Attention.add_to`,
`MoEFeedForward.add_to`, `MoEFeedForward.in_one_op`), and the modular path elsewhere.

Arguments as the modules hold them: a norm as (weight, eps, weight_in_fp32) (`RMSNorm.operands`), a product as
(weight, int8 scale or None) (`LinearWeight.native_operands`), the experts as their stacks [E, 2F, D] and [E, D, F]
with their int8 scales, a load table [2, E] (`MoEFeedForward.load_counts`) and its row, or None.
"""

from __future__ import annotations

import torch

from models.kernels.native import _ops, torch_vector_width

Operands = tuple[torch.Tensor, torch.Tensor | None]
Scales = tuple[torch.Tensor | None, torch.Tensor | None]


def routed_experts(x_TD: torch.Tensor, gate_ED: torch.Tensor, stacks: tuple[torch.Tensor, torch.Tensor],
                   scales: Scales, top_k: int, kind: int, renormalise: bool, load: torch.Tensor | None,
                   row: int) -> torch.Tensor:
    """[T, D]: `native.grouped` with the gate, `native.route` (`kind`, `renormalise`), `native.count_ids` into
    `load`'s `row`, `native.group_by_expert`, `native.grouped` with each stack around `native.silu_mul`,
    `native.combine`."""
    return _ops.routed_experts(x_TD, gate_ED, stacks[0], scales[0], stacks[1], scales[1], top_k, kind, renormalise,
                               x_TD.dtype == torch.bfloat16, load, row, torch_vector_width(x_TD.dtype))


def add_routed_experts(h_BSD: torch.Tensor, norm: tuple[torch.Tensor, float, bool], gate_ED: torch.Tensor,
                       stacks: tuple[torch.Tensor, torch.Tensor], scales: Scales, top_k: int, kind: int,
                       renormalise: bool, load: torch.Tensor | None, row: int) -> torch.Tensor:
    """h + `routed_experts` of rms_norm(h) over its rows."""
    return _ops.add_routed_experts(h_BSD, *norm, gate_ED, stacks[0], scales[0], stacks[1], scales[1], top_k, kind,
                                   renormalise, h_BSD.dtype == torch.bfloat16, load, row,
                                   torch_vector_width(h_BSD.dtype))


def add_attention(h_B1D: torch.Tensor, norm: tuple[torch.Tensor, float, bool], qkv: Operands, out: Operands,
                  heads: int, kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """h + the output product of `native.attend_one` (its arguments from `heads` on) of the q/k/v product of
    rms_norm(h)."""
    return _ops.add_attention(h_B1D, *norm, *qkv, *out, heads, kv_heads, q_norm, k_norm, qk_eps, cos, sin, k_cache,
                              v_cache, start, mask)
