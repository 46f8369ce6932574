"""Replicated attention: every rank holds the embedding, attention, norms, routers and head (small), the
experts stay spread as in the placement, and each rank runs its own slice of the batch.

With layer placement one owner works per block while the others only exchange rows; here every rank
attends for its sequences at once and sends its own tokens in every exchange (the layout DeepSeek calls
data-parallel attention, and the trainer's). The batch is split in contiguous slices, rank r the r-th;
a rank with no sequence still enters every exchange. Rank 0 gathers the last-position logits, samples,
and broadcasts the tokens, so control flow is decided in one place. Costs: the dense weights on every
rank (a few percent of a Mixtral) and one gather of logits per step.
"""

from __future__ import annotations

import torch

from models.attention import Padding
from moe.engine.sharded import ShardedEngine


class ReplicatedAttentionEngine(ShardedEngine):
    @property
    def head_rank(self) -> int:
        return 0

    def my_rows(self, batch: int) -> torch.Tensor:
        return torch.arange(*self._bounds(batch)[self.rank])

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        rows = self.my_rows(batch)
        self.caches = self.model.make_caches(len(rows), length) if len(rows) else {}
        self.padding = Padding.of(pad_B[rows], self.dist.device)

    @torch.inference_mode()
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches, last_only: bool) -> torch.Tensor | None:
        B, S = tokens_BS.shape
        rows = self.my_rows(B)
        device = self.dist.device
        self.step.most = -(-B // self.dist.world_size) * S  # the largest slice's tokens
        if len(rows):
            local = self.model(tokens_BS[rows].to(device), start, caches, padding, last_only=last_only)
        else:
            local = None
            for block in self.model.layers.values():
                block.feed_forward.run_experts(*self.no_rows)
        return self._gather(local, B, 1 if last_only else S)

    def _gather(self, local: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
        """Every rank's logits rows, in batch order, on rank 0 (equal-size buffers: gather needs them)."""
        sizes = [b - a for a, b in self._bounds(batch)]
        V = self.model.cfg.vocab_size
        buf = torch.zeros(max(sizes), seq, V, dtype=self.dtype, device=self.dist.device)
        if local is not None:
            buf[:len(local)] = local
        parts = self.dist.gather(buf, dst=0)
        if self.rank != 0:
            return None
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
