"""The one-rank engine: the whole model in this process."""

from __future__ import annotations

import torch

from models.attention import KVCache
from models.transformer import Transformer
from moe.checkpoint.distributed_save import save_distributed
from moe.distributed import single_process
from moe.generation import GenerationResult, generate_tokens
from moe.load_stats import local_load_stats, reset_load_stats, set_round_robin
from moe.memory import peak_memory_mib


class LocalEngine:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.caches: dict[str, KVCache] | None = None

    def start(self, batch: int, length: int) -> None:
        self.caches = self.model.make_caches(batch, length)

    @torch.inference_mode()
    def forward_last(self, tokens_BS: torch.Tensor, start: int, pad_B: torch.Tensor) -> torch.Tensor:
        device = self.model.tok_embeddings.weight.device
        return self.model(tokens_BS.to(device), start, self.caches, pad_B, last_only=True)[:, -1]

    def generate(self, ids, params, eos, context, on_token=None) -> GenerationResult:
        return generate_tokens(self, ids, params, eos, context, on_token)

    def share(self, tokens_B: torch.Tensor) -> torch.Tensor:
        return tokens_B.cpu()

    @torch.inference_mode()
    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_BS.to(self.model.tok_embeddings.weight.device))

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        counts, entropy = local_load_stats(self.model)
        return counts, entropy, counts.sum(dim=(1, 2))[:, None]  # one rank computes every copy

    def reset_load_stats(self) -> None:
        reset_load_stats(self.model)

    def set_round_robin(self, enabled: bool) -> None:
        set_round_robin(self.model, enabled)

    def save(self, out: str, max_shard_bytes: int | None, tokenizer: str | None) -> list[dict]:
        return [save_distributed(self.model, self.model.cfg, out, single_process(), max_shard_bytes, tokenizer)]

    def peak_memory_mib(self) -> list[float]:
        return [peak_memory_mib(self.model.norm.weight.device)]

    def close(self) -> None:
        self.caches = None
