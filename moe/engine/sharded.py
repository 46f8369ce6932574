"""One rank's engine: runs its share of the model in lock-step with the other ranks.

The blocks are walked in order on every rank: the owner attends and routes, every rank enters the
block's expert exchange (with no rows when it owns none), hidden states move owner to owner. Every
`Engine` call returns the same value on every rank, so a rank process and a torchrun process serve
the same results.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from models.attention import AttentionContext, KVCache, Padding
from models.transformer import Transformer, real_token_rows
from moe.checkpoint.distributed_save import save_distributed
from moe.generation import GenerationResult, SamplingParams, generate_tokens
from moe.memory import MemoryUse
from moe.parallel.distributed import DistContext
from moe.parallel.gather import StepRows
from moe.parallel.placement import Placement
from moe.progress import Progress
from moe.reports.counters import local_load_stats, reset_load_stats, set_round_robin, track_entropy


class ShardedEngine:
    def __init__(self, model: Transformer, placement: Placement, dist: DistContext, dtype: torch.dtype,
                 step: StepRows | None = None) -> None:
        self.model, self.placement, self.dist, self.dtype = model, placement, dist, dtype
        self.step = step or StepRows()  # shared with every block's dispatcher (moe.parallel.gather)
        self.rank = dist.rank
        self.owns_group = False  # under torchrun the engine leaves the group on close()
        self.caches: dict[str, KVCache] = {}
        self.padding: Padding | None = None
        self.my_blocks = placement.blocks_of(self.rank)
        cfg = model.cfg  # what a rank sends when it has no token of its own in a block: made once, not per step
        self.no_rows = (torch.empty(0, cfg.dim, dtype=dtype, device=dist.device),
                        torch.empty(0, cfg.top_k, device=dist.device),
                        torch.empty(0, cfg.top_k, dtype=torch.long, device=dist.device))

    @property
    def head_rank(self) -> int:
        """The rank that gets the logits, samples and broadcasts the next tokens."""
        return self.placement.head_rank

    # -- stepping (moe.generation.Stepper) ---------------------------------------------------------
    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        cfg = self.model.cfg
        if self.dist.device.type == "cuda":  # the user's process cannot see this GPU's free memory: check here
            self._check_kv_fits(batch * length * len(self.my_blocks) * 2 * cfg.n_kv_heads * cfg.head_dim
                                * self.dtype.itemsize)
        self.caches = {str(i): KVCache(batch, cfg.n_kv_heads, length, cfg.head_dim, self.dtype, self.dist.device)
                       for i in self.my_blocks}
        self.padding = Padding.of(pad_B, self.dist.device)

    def _check_kv_fits(self, need: int) -> None:
        """Every rank compares its KV cache with its GPU's free memory; all raise the same error if one cannot
        hold it, so they stay in step (a user error: the model stays usable)."""
        free = torch.cuda.mem_get_info(self.dist.device)[0]
        short = [(r, n, f) for r, (n, f) in enumerate(self.dist.all_gather_object((need, free))) if n > f]
        if short:
            r, n, f = short[0]
            raise ValueError(f"rank {r}: a KV cache of {n / 2**30:.1f} GiB does not fit in its GPU's {f / 2**30:.1f} "
                             "GiB free; ask for fewer new tokens or fewer prompts")

    def forward_last(self, tokens_BS: torch.Tensor, start: int) -> torch.Tensor | None:
        logits = self.tokens_to_logits(tokens_BS, start, self.padding, self.caches, last_only=True)
        return logits[:, -1] if logits is not None else None

    def share(self, decided: torch.Tensor) -> torch.Tensor:
        """The head's rank decided the next tokens (and whether to stop); every rank gets them, so every rank
        takes the same decisions."""
        return self.dist.broadcast(decided.to(self.dist.device), self.head_rank)

    @property
    def device(self) -> torch.device:
        return self.dist.device

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
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches: dict[str, KVCache] | None, last_only: bool) -> torch.Tensor | None:
        """Logits on the head's rank, None elsewhere."""
        cfg, p = self.model.cfg, self.placement
        B, S = tokens_BS.shape
        shape = (B, S, cfg.dim)
        device = self.dist.device
        h = self.model.tok_embeddings(tokens_BS.to(device)) if self.rank == p.embed_rank else None
        ctx = AttentionContext.build(cfg, B, S, start, padding, device, self.dtype) if self.my_blocks else None
        rows = real_token_rows(padding, S, start, device)
        self.step.most = B * S  # a block's owner brings at most every token; the others none
        holder = p.embed_rank
        for name, block in self.model.layers.items():
            owner = p.block_ranks[int(name)]
            h = self._move(h, holder, owner, shape)
            holder = owner
            if self.rank == owner:
                h = block(h, ctx, caches[name] if caches is not None else None, rows)
            else:  # not the owner: still take part in this block's exchanges, with no rows of our own
                block.feed_forward.run_experts(*self.no_rows)
        h = self._move(h, holder, p.head_rank, shape)
        if self.rank != self.head_rank:
            return None
        if last_only:
            h = h[:, -1:]
        return self.model.output(self.model.norm(h))

    # -- the Engine interface ----------------------------------------------------------------------
    def generate(self, ids: list[list[int]], params: SamplingParams, eos: int | None, context: int,
                 on_token: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        return generate_tokens(self, ids, params, eos, context, on_token, should_stop)

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self.tokens_to_logits(tokens_BS, 0, None, None, last_only=False)
        if logits is None:
            B, S = tokens_BS.shape
            logits = torch.empty(B, S, self.model.cfg.vocab_size, dtype=self.dtype, device=self.dist.device)
        return self.dist.broadcast(logits, self.head_rank).cpu()

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing counters summed over all ranks, and the rows each rank's experts computed per block
        ([blocks, ranks]); one all-reduce, only when a report is asked for, so every rank gets the same."""
        counts, entropy = local_load_stats(self.model)
        received = torch.zeros(len(self.model.layers), self.dist.world_size, dtype=torch.float64)
        for i, block in enumerate(self.model.layers.values()):
            received[i, self.rank] = block.feed_forward.dispatcher.received
        packed = torch.cat([counts.double().reshape(-1), received.reshape(-1), entropy])
        packed = self.dist.all_reduce(packed.to(self.dist.device)).cpu()
        n = counts.numel()
        return (packed[:n].round().long().view(counts.shape), packed[-2:],
                packed[n:-2].round().long().view(received.shape))

    def reset_load_stats(self) -> None:
        reset_load_stats(self.model)
        for block in self.model.layers.values():
            block.feed_forward.dispatcher.reset_received()

    def set_round_robin(self, enabled: bool) -> None:
        set_round_robin(self.model, enabled)

    def track_entropy(self, enabled: bool) -> None:
        track_entropy(self.model, enabled)

    def save(self, out: str, max_shard_bytes: int | None, tokenizer: str | None,
             progress: bool = False) -> list[dict]:
        shown = Progress("saving", unit="B", enabled=progress and self.rank == 0)
        mine = save_distributed(self.model, self.model.cfg, out, self.dist, max_shard_bytes, tokenizer, shown)
        return self.dist.all_gather_object(mine)

    def memory(self) -> list[MemoryUse]:
        return self.dist.all_gather_object(MemoryUse.now(self.dist.device))

    def random_seed(self) -> int:
        return int(self.dist.broadcast_object(random.randrange(2**31), 0))

    def close(self) -> None:
        self.caches = {}
        if self.owns_group:
            self.owns_group = False
            self.dist.destroy()
