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
        return next(r for r in self.group.call("logits", tokens_BS) if r is not None)  # the head's rank answers

    def load_stats_per_rank(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every rank's copy of the gathered counters (they agree: each rank all-reduced them)."""
        return self.group.call("load_stats")

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.load_stats_per_rank()[0]

    def reset_load_stats(self) -> None:
        self.group.call("reset_load_stats")

    def save(self, out: str, max_shard_bytes: int | None, tokenizer: str | None) -> list[dict]:
        return self.group.call("save", out, max_shard_bytes, tokenizer)

    def peak_memory_mib(self) -> list[float]:
        return self.group.call("memory")

    def set_round_robin(self, enabled: bool) -> None:
        self.group.call("set_round_robin", enabled)

    def close(self) -> None:
        self.group.close()
