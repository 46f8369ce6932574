"""The one engine interface: what `MoEModel` asks of wherever the model runs.

Three engines implement it: `LocalEngine` (one process holds everything), `ShardedEngine` (this process
is one rank of N, in lock-step with the others: a rank process, or a torchrun process), and `RemoteEngine`
(the user's process, forwarding each call by name to N rank processes that each run a `ShardedEngine`).
Every method returns the same value on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from moe.generation import GenerationResult, SamplingParams
from moe.memory import MemoryUse

# The calls a rank process serves; RemoteEngine forwards exactly these.
ENGINE_CALLS = ("generate", "logits", "prompt_logprobs", "load_stats", "reset_load_stats", "set_round_robin",
                "track_entropy", "save", "memory", "random_seed")


class Engine(Protocol):
    def generate(self, ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 eos: tuple[int, ...], context: int,
                 on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Engines that run the steps themselves also take `should_stop` (see `generate_tokens`)."""

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """[B, S, V] logits (no cache, positions from 0)."""

    def prompt_logprobs(self, ids: list[list[int]], top: int) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """Per prompt, per token after the first: its log-probability and the `top` most likely (id, value)
        (`moe.generation.scoring`); computed where the head is, only these values sent."""

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(routing counts [blocks, 2, experts], [router entropy sum, token-blocks it covers], rows computed per
        [block, rank])."""

    def reset_load_stats(self) -> None: ...
    def set_round_robin(self, enabled: bool) -> None: ...
    def track_entropy(self, enabled: bool) -> None: ...

    def save(self, out: str, max_shard_bytes: int | None, beside: list[Path],
             progress: bool = False) -> list[dict]:
        """Write a Hugging Face directory; per rank, the files it wrote and their bytes. `progress`: rank 0
        shows the bytes it has written."""

    def memory(self) -> list[MemoryUse]:
        """Per rank: host peak, and on a GPU allocated, reserved and peak (MiB)."""

    def random_seed(self) -> int:
        """A fresh seed, the same on every rank (drawn once, shared)."""

    def close(self) -> None: ...
