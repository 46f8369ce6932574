"""One rank's share of the model and the engine that runs it in lock-step with the other ranks.

`apply_placement` rewrites a meta-device `Transformer` in place: it drops the modules this rank does
not own, keeps only its experts of every block, and swaps in the all-to-all dispatcher. Parameter
names stay global, so the loader reads exactly this rank's tensors. `ShardedEngine` walks the blocks:
the owner attends and routes, every rank exchanges expert rows, hidden states move owner to owner.
"""

from __future__ import annotations

import torch

from models.attention import AttentionContext, KVCache
from models.moe import GroupedExperts
from models.transformer import Transformer, add_feed_forward, real_token_rows
from moe.distributed import DistContext
from moe.expert_parallel import AllToAllDispatcher, SlotTable
from moe.load_stats import local_load_stats, reset_load_stats
from moe.placement import Placement


def apply_placement(model: Transformer, placement: Placement, rank: int) -> None:
    if rank != placement.embed_rank:
        model.tok_embeddings = None
    if rank != placement.head_rank:
        model.norm, model.output = None, None
    for name, block in model.layers.items():
        i = int(name)
        if placement.block_ranks[i] != rank:
            block.attention_norm = block.attention = block.ffn_norm = None
            block.feed_forward.gate = None
    apply_expert_placement(model, placement, rank)


def apply_expert_placement(model: Transformer, placement: Placement, rank: int,
                           device: torch.device | str = "meta") -> None:
    """Keep only this rank's experts of every block (new, uninitialised, on `device`) and route through
    the all-to-all dispatcher."""
    cfg = model.cfg
    for name, block in model.layers.items():
        i = int(name)
        ffn = block.feed_forward
        with torch.device(device):
            ffn.experts = GroupedExperts(cfg.dim, cfg.hidden_dim, placement.local_experts(i, rank))
        ffn.dispatcher = AllToAllDispatcher(SlotTable(placement.expert_ranks[i], placement.world_size),
                                            placement.world_size)


class ShardedEngine:
    def __init__(self, model: Transformer, placement: Placement, dist: DistContext, dtype: torch.dtype) -> None:
        self.model, self.placement, self.dist, self.dtype = model, placement, dist, dtype
        self.rank = dist.rank
        for block in model.layers.values():
            block.feed_forward.dispatcher.table.to(dist.device)
        self.caches: dict[str, KVCache] = {}
        self.my_blocks = placement.blocks_of(self.rank)
        cfg = model.cfg  # what a rank sends when it has no token of its own in a block: made once, not per step
        self.no_rows = (torch.empty(0, cfg.dim, dtype=dtype, device=dist.device),
                        torch.empty(0, cfg.top_k, device=dist.device),
                        torch.empty(0, cfg.top_k, dtype=torch.long, device=dist.device))

    def take_part_without_rows(self, ffn) -> None:
        """Enter a block's exchanges with no token of our own (every rank enters every collective)."""
        ffn.dispatcher(*self.no_rows, ffn.experts, ffn.n_experts)

    @property
    def head_rank(self) -> int:
        """The rank that gets the logits, samples and broadcasts the next tokens."""
        return self.placement.head_rank

    @property
    def holds_head(self) -> bool:
        return self.rank == self.head_rank

    def start(self, batch: int, length: int) -> None:
        cfg = self.model.cfg
        self.caches = {str(i): KVCache(batch, cfg.n_kv_heads, length, cfg.head_dim, self.dtype, self.dist.device)
                       for i in self.my_blocks}

    def _move(self, h: torch.Tensor | None, src: int, dst: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Hand the hidden states from one owner to the next; only those two ranks take part."""
        if src == dst:
            return h
        if self.rank == src:
            self.dist.send(h, dst)
            return None
        if self.rank == dst:
            return self.dist.recv(shape, self.dtype, src)
        return None

    @torch.inference_mode()
    def hidden_to_logits(self, tokens_BS: torch.Tensor, start: int, pad_B: torch.Tensor | None,
                         caches: dict[str, KVCache] | None, last_only: bool) -> torch.Tensor | None:
        cfg, p = self.model.cfg, self.placement
        B, S = tokens_BS.shape
        shape = (B, S, cfg.dim)
        device = self.dist.device
        h = self.model.tok_embeddings(tokens_BS.to(device)) if self.rank == p.embed_rank else None
        # The padding stays on the CPU (the generation loop made it there); the context copies it over.
        ctx = AttentionContext.build(cfg, B, S, start, pad_B, device, self.dtype) if self.my_blocks else None
        rows = real_token_rows(pad_B, S, start, device)
        holder = p.embed_rank
        for name, block in self.model.layers.items():
            owner = p.block_ranks[int(name)]
            h = self._move(h, holder, owner, shape)
            holder = owner
            ffn = block.feed_forward
            if self.rank == owner:
                h = block.attend(h, ctx, caches[name] if caches is not None else None)
                h = add_feed_forward(h, block.ffn_norm(h), rows, lambda x, f=ffn: f(x, decoding=start > 0))
            else:  # not the owner: still take part in this block's exchanges, with no rows of our own
                self.take_part_without_rows(ffn)
        h = self._move(h, holder, p.head_rank, shape)
        if not self.holds_head:
            return None
        if last_only:
            h = h[:, -1:]
        return self.model.output(self.model.norm(h))

    def forward_last(self, tokens_BS: torch.Tensor, start: int, pad_B: torch.Tensor) -> torch.Tensor | None:
        logits = self.hidden_to_logits(tokens_BS, start, pad_B, self.caches, last_only=True)
        return logits[:, -1] if logits is not None else None

    def share(self, tokens_B: torch.Tensor) -> torch.Tensor:
        """The head's rank decided the next tokens; every rank gets them (and so takes the same decisions)."""
        t = tokens_B.to(self.dist.device)
        return self.dist.broadcast(t, self.head_rank).cpu()

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        return self.hidden_to_logits(tokens_BS, 0, None, None, last_only=False)

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing counters summed over all ranks, and the rows each rank's experts computed per block
        ([blocks, ranks]); one all-reduce, only when a report is asked for, so every rank gets the same."""
        counts, entropy = local_load_stats(self.model)
        received = torch.zeros(len(self.model.layers), self.dist.world_size, dtype=torch.float64)
        for i, block in enumerate(self.model.layers.values()):
            received[i, self.rank] = block.feed_forward.dispatcher.received_rows
        packed = torch.cat([counts.double().reshape(-1), received.reshape(-1), entropy.reshape(1)])
        packed = packed.to(self.dist.device)
        torch.distributed.all_reduce(packed)
        packed = packed.cpu()
        n = counts.numel()
        return (packed[:n].round().long().view(counts.shape), packed[-1],
                packed[n:-1].round().long().view(received.shape))

    def reset_load_stats(self) -> None:
        reset_load_stats(self.model)
        for block in self.model.layers.values():
            block.feed_forward.dispatcher.received_rows = 0

    def close(self) -> None:
        self.caches = {}
