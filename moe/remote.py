"""The N-rank engine as seen from the user's process: requests go to the worker ranks, answers come back."""

from __future__ import annotations

import torch

from moe.generation import GenerationResult, SamplingParams
from moe.launcher import WorkerGroup
from moe.placement import Placement


class RemoteEngine:
    def __init__(self, group: WorkerGroup, placement: Placement) -> None:
        self.group, self.placement = group, placement

    def generate(self, ids: list[list[int]], params: SamplingParams, eos: int | None, context: int,
                 on_token=None) -> GenerationResult:
        return self.group.call("generate", ids, params, eos, context, on_token=on_token)[0]

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.group.call("logits", tokens_BS)[self.placement.head_rank]

    def load_counts(self) -> torch.Tensor:
        """Routing happens at each block's owner; the sum over ranks is the whole picture."""
        return torch.stack(self.group.call("load_counts")).sum(0)

    def peak_memory_mib(self) -> list[float]:
        return self.group.call("memory")

    def set_round_robin(self, enabled: bool) -> None:
        self.group.call("set_round_robin", enabled)

    def close(self) -> None:
        self.group.close()
