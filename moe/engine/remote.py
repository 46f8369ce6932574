"""The N-rank engine as seen from the user's process: each call goes by name to the rank processes, each of
which runs it on its `ShardedEngine`; rank 0's answer comes back (every rank computes the same one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moe.engine.base import ENGINE_CALLS
from moe.generation import GenerationResult, SamplingParams
from moe.memory import MemoryUse
from moe.workers.group import WorkerGroup


class RemoteEngine:
    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def _call(self, name: str, *args, on_token: Callable[[int, int], None] | None = None):
        assert name in ENGINE_CALLS, name
        return self.group.call(name, *args, on_token=on_token)[0]

    def each_rank(self, name: str, *args) -> list:
        """Every rank's own answer to a call (they should agree; tests check that they do)."""
        assert name in ENGINE_CALLS, name
        return self.group.call("each", name, *args)

    def generate(self, ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 eos: tuple[int, ...], context: int,
                 on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        return self._call("generate", ids, params, eos, context, on_token=on_token)

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self._call("logits", tokens_BS)

    def prompt_logprobs(self, ids: list[list[int]], top: int) -> list:
        return self._call("prompt_logprobs", ids, top)

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._call("load_stats")

    def reset_load_stats(self) -> None:
        self._call("reset_load_stats")

    def set_round_robin(self, enabled: bool) -> None:
        self._call("set_round_robin", enabled)

    def track_entropy(self, enabled: bool) -> None:
        self._call("track_entropy", enabled)

    def save(self, out: str, max_shard_bytes: int | None, beside: list[Path],
             progress: bool = False) -> list[dict]:
        return self._call("save", out, max_shard_bytes, beside, progress)

    def memory(self) -> list[MemoryUse]:
        return self._call("memory")

    def random_seed(self) -> int:
        return self._call("random_seed")

    def close(self) -> None:
        self.group.close()
