"""Replicated attention: every rank holds the embedding, attention, norms, routers and head (small), the
experts stay spread as in the placement, and each rank runs its own slice of the batch.

With layer placement one owner works per block while the others only exchange rows; here every rank
attends for its sequences at once and sends its own tokens in every exchange (the layout DeepSeek calls
data-parallel attention, and the trainer's). The batch is split in contiguous slices, rank r the r-th (the server
keeps each sequence on a home rank instead, `moe.engine.rows`); rank 0 gathers the last-position logits, samples,
and broadcasts the tokens, so control flow is decided in one place. Costs: the dense weights on every rank (a few
percent of a Mixtral) and one gather of logits per step.

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
from moe.engine.rows import Rows
from moe.engine.sharded import ShardedEngine
from moe.parallel.gather import ExchangeDispatcher


class ReplicatedAttentionEngine(ShardedEngine):
    compiled: CompiledDecode | None = None
    _own_padding: tuple = (None, None, None)  # the padding and rows it was cut for, this rank's share

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
        """Every rank runs every sequence of this batch (the module docstring says when and why); never where the
        rows have homes (the server's, whose caches stay on their rank whatever the batch's size)."""
        return batch < self.dist.world_size and self.step.exchange == "auto" and self._routes_alike and \
            self.homes is None

    def routes_alike(self, batch: int) -> dict[int, tuple[int, ...]]:
        """A batch that every rank runs whole: every rank routes every block's tokens."""
        if self.redundant(batch):
            return dict.fromkeys(range(self.model.cfg.n_layers), tuple(range(self.dist.world_size)))
        return super().routes_alike(batch)

    def my_rows(self, batch: int) -> Rows:
        return Rows.of(list(range(batch)), self.dist.device) if self.redundant(batch) else \
            self.rows_of(batch)[self.rank]

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        if self.compiled is not None and self.redundant(batch):
            self.caches = self.compiled.caches_for(batch, length)
        else:
            if self.compiled is not None:
                self.compiled.caches = None  # a batch split over the ranks runs eager, in caches of its rows
            self.caches = self.model.make_caches(self.my_rows(batch).count, length)  # none here: empty caches
        self.padding = Padding.of(pad_B, self.dist.device)  # the whole batch's: each call takes its rows' share

    @torch.inference_mode()
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches, last_only: bool) -> torch.Tensor | None:
        B, S = tokens_BS.shape
        device = self.dist.device
        redundant = self.redundant(B)
        self.step.everywhere = redundant
        self.step.most = max(r.count for r in self.rows_of(B)) * S  # the most tokens a rank brings
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
        if rows.count:
            local = self.model(tokens_BS[rows.host].to(device), start, caches, self._padding_of(padding, rows),
                               last_only=last_only)
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

    def _padding_of(self, padding: Padding | None, rows: Rows) -> Padding | None:
        """The padding of this rank's rows: the whole batch's where it runs every row, else made once per batch and
        rows (a request, or a change of the server's batch), not per step."""
        if padding is None or rows.count == padding.host_B.shape[0]:
            return padding
        cut_for, rows_for, _ = self._own_padding
        if cut_for is not padding or rows_for is not rows:
            self._own_padding = (padding, rows, Padding.of(padding.host_B[rows.host], self.dist.device))
        return self._own_padding[2]

    def _gather(self, local: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
        """Every rank's logits rows, in batch order, on rank 0 (equal-size buffers: gather needs them)."""
        rows = self.rows_of(batch)
        V = self.model.cfg.vocab_size
        buf = torch.zeros(max(r.count for r in rows), seq, V, dtype=self.dtype, device=self.dist.device)
        if local is not None:
            buf[:len(local)] = local
        parts = self.dist.gather(buf, dst=0)
        if self.rank != 0:
            return None
        out = torch.empty(batch, seq, V, dtype=self.dtype, device=self.dist.device)
        for p, r in zip(parts, rows, strict=True):
            out[r.device] = p[:r.count]
        return out

