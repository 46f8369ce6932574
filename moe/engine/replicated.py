"""Replicated attention: every rank holds the embedding, attention, norms, routers and head (small), the
experts stay spread as in the placement, and each rank runs its own slice of the batch.

With layer placement one owner works per block while the others only exchange rows; here every rank
attends for its sequences at once and sends its own tokens in every exchange (the layout DeepSeek calls
data-parallel attention, and the trainer's). The batch is split in contiguous slices, rank r the r-th;
rank 0 gathers the last-position logits, samples, and broadcasts the tokens, so control flow is decided in one
place. Costs: the dense weights on every rank (a few percent of a Mixtral) and one gather of logits per step.

A batch smaller than the ranks (one sequence on 2 ranks: the latency case) would leave ranks without a sequence,
waiting while the others attend. Instead every rank then runs every sequence (`redundant`): the attention is
done alike on every rank, in the time one rank would take, so no rows need moving to the experts and each block
costs one collective (the experts' partial sums, `moe.parallel.gather`), and rank 0 holds the logits without a
gather. Every rank computes the same bits (the same kernels on the same rows, the sums added in rank order), so
every rank routes alike. Only where each expert has one replica and the exchange is "auto".

Such a step is the whole model on every rank, so with `compile=True` it runs compiled as one rank's does
(`moe.engine.compiled`): the block's sum over ranks is one opaque op of the graph, and the Python of every block's
attention, routing and experts, which each rank would otherwise run on its own core, is gone.
"""

from __future__ import annotations

import functools

import torch

from models.attention import Padding
from moe.engine.compiled import CompiledDecode
from moe.engine.sharded import ShardedEngine
from moe.parallel.gather import ExchangeDispatcher


class ReplicatedAttentionEngine(ShardedEngine):
    compiled: CompiledDecode | None = None

    def compile_decode(self) -> None:
        """Decode steps of a batch that every rank runs whole (`redundant`) run compiled, one collective per block
        (an opaque op of the graph); rank 0's graph ends with the head, the others' at the last block."""
        self.compiled = CompiledDecode(self.model, head=self.rank == self.head_rank)

    @property
    def head_rank(self) -> int:
        return 0

    @functools.cached_property
    def _routes_alike(self) -> bool:
        """Every rank would send a copy to the same slot: no expert has replicas, whose round-robin state each rank
        keeps for its own rows (experts split by `tensor` have a slot per slice, and every copy goes to each)."""
        dispatchers = [b.feed_forward.dispatcher for b in self.model.layers.values() if not b.feed_forward.dense]
        return all(isinstance(d, ExchangeDispatcher) and not d.table.replicated for d in dispatchers)

    def redundant(self, batch: int) -> bool:
        """Every rank runs every sequence of this batch (the module docstring says when and why)."""
        return batch < self.dist.world_size and self.step.exchange == "auto" and self._routes_alike

    def routes_alike(self, batch: int) -> dict[int, tuple[int, ...]]:
        """A batch that every rank runs whole: every rank routes every block's tokens."""
        if self.redundant(batch):
            return dict.fromkeys(range(self.model.cfg.n_layers), tuple(range(self.dist.world_size)))
        return super().routes_alike(batch)

    def my_rows(self, batch: int) -> torch.Tensor:
        return torch.arange(batch) if self.redundant(batch) else torch.arange(*self._bounds(batch)[self.rank])

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        rows = self.my_rows(batch)
        if self.compiled is not None and self.redundant(batch):
            self.caches = self.compiled.caches_for(batch, length)
        else:
            if self.compiled is not None:
                self.compiled.caches = None  # a batch split over the ranks runs eager, in caches of its slice
            self.caches = self.model.make_caches(len(rows), length) if len(rows) else {}
        self.padding = Padding.of(pad_B[rows], self.dist.device)

    @torch.inference_mode()
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches, last_only: bool) -> torch.Tensor | None:
        B, S = tokens_BS.shape
        device = self.dist.device
        redundant = self.redundant(B)
        self.step.everywhere = redundant
        self.step.most = -(-B // self.dist.world_size) * S  # the largest slice's tokens
        for block in self.model.layers.values():  # one rank counts the copies every rank routes alike
            block.feed_forward.counts_load = self.rank == self.head_rank or not redundant
        if redundant and self.compiled is not None and S == 1 and caches is self.caches:  # a decode step
            out = self.compiled(tokens_BS.to(device), start, padding.device_B if padding is not None else None)
            return out[:, None] if self.rank == self.head_rank else None
        if redundant:  # rank 0 computes the logits; the others run the blocks for their exchanges
            if self.rank == self.head_rank:
                return self.model(tokens_BS.to(device), start, caches, padding, last_only=last_only)
            self.model.hidden_states(tokens_BS.to(device), start, caches, padding)
            return None
        rows = self.my_rows(B)
        if len(rows):
            local = self.model(tokens_BS[rows].to(device), start, caches, padding, last_only=last_only)
        else:
            local = None
            for block in self.model.layers.values():
                if not block.feed_forward.dense:
                    block.feed_forward.run_experts(*self.no_rows)
        return self._gather(local, B, 1 if last_only else S)

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.caches = None
        super().close()

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

