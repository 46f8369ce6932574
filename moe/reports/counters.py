"""Read and reset the routing counters of the MoE layers this process holds."""

from __future__ import annotations

import torch
from torch import nn


def local_load_stats(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """([blocks, 2, experts] copies routed by the blocks held here, [router entropy sum, tokens it covers])
    on the CPU. Entropy is summed only while tracked (`track_entropy`), so it has its own token count; a router
    sums neither where another rank counts the same tokens (`MoEFeedForward.counts_load`)."""
    counts = torch.stack([b.feed_forward.load_counts.cpu() for b in model.layers.values()])
    entropy = torch.zeros(2, dtype=torch.float64)
    for g in gates(model):
        entropy += torch.stack([g.entropy_sum, g.entropy_tokens]).cpu()
    return counts, entropy


def reset_load_stats(model: nn.Module) -> None:
    for block in model.layers.values():
        block.feed_forward.load_counts.zero_()
    for gate in gates(model):
        gate.entropy_sum.zero_()
        gate.entropy_tokens.zero_()


def gates(model: nn.Module) -> list[nn.Module]:
    return [b.feed_forward.gate for b in model.layers.values() if b.feed_forward.gate is not None]


def track_entropy(model: nn.Module, enabled: bool) -> None:
    for gate in gates(model):
        gate.track_entropy = enabled


def set_round_robin(model: nn.Module, enabled: bool) -> None:
    for gate in gates(model):
        gate.round_robin = enabled
