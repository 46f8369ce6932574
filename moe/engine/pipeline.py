"""A pipeline of whole blocks: every block, its experts included, on its owner (experts `layer`), as Mistral's
reference code splits layers over pipeline ranks and llama.cpp splits them over GPUs. A step crosses the ranks once:
each runs its range of blocks and hands the hidden states to the next; no collective inside a block.

Each hand-off is a broadcast within the pair of ranks (the world, on 2 ranks), waited for by polling as every
collective is (`DistContext._finish`): gloo's point-to-point receive cannot be polled, and a rank that slept through
the other ranks' blocks woke late.

With `compile=True`, where each rank holds one contiguous range (the embedding with the first block, the head with
the last: `pipeline_refusal`), each rank's part of a decode step runs compiled as one rank's whole step does
(`moe.engine.compiled`): the first rank's graph starts from the tokens, the others' from the hidden states they
receive, and the head's rank's graph ends with the head. The hand-offs stay outside the graphs; prompts run eager.
"""

from __future__ import annotations

import torch

from models.attention import Padding
from models.transformer import Transformer
from moe.engine.compiled import CompiledDecode
from moe.engine.sharded import ShardedEngine
from moe.parallel.distributed import DistContext
from moe.parallel.gather import StepRows
from moe.parallel.placement import Placement


def pipeline_refusal(plan: Placement) -> str | None:
    """Why the decode steps of `plan` cannot run compiled as a pipeline, or None."""
    if not plan.pipeline:
        return "experts 'layer' in every block (a pipeline of whole blocks)"
    ranges = [plan.blocks_of(r) for r in range(plan.world_size)]
    idle = [r for r, blocks in enumerate(ranges) if not blocks]
    if idle:
        return (f"a block on every rank ({len(plan.block_ranks)} blocks over {plan.world_size} ranks leave rank "
                f"{idle[0]} none: use at most {len(plan.block_ranks)} ranks)")
    if any(blocks != list(range(blocks[0], blocks[-1] + 1)) for blocks in ranges):
        return f"each rank's blocks in one contiguous range (the blocks' owners are {list(plan.block_ranks)})"
    if plan.embed_rank != plan.block_ranks[0] or plan.head_rank != plan.block_ranks[-1]:
        return "the embedding on the first block's rank and the head on the last block's"
    return None


def hand_offs(plan: Placement) -> list[tuple[int, int]]:
    """(from, to) of every move of the hidden states along the pipeline: embedding, blocks, head."""
    holders = [plan.embed_rank, *plan.block_ranks, plan.head_rank]
    return [(a, b) for a, b in zip(holders, holders[1:], strict=False) if a != b]


class PipelineEngine(ShardedEngine):
    compiled: CompiledDecode | None = None
    # the server's: caches of the length asked, made fresh by every `start` (its running batch keeps several and
    # joins them), a decode step takes the caller's and always a padding tensor (one graph per batch size)
    exact_caches = False
    _zeros: torch.Tensor | None = None  # the padding of a batch without any

    def __init__(self, model: Transformer, placement: Placement, dist: DistContext, dtype: torch.dtype,
                 step: StepRows | None = None) -> None:
        super().__init__(model, placement, dist, dtype, step)
        dist.make_groups([tuple(sorted(pair)) for pair in hand_offs(placement)])  # collective: the same on every rank

    def compile_decode(self) -> None:
        self.compiled = CompiledDecode(self.model, head=self.rank == self.head_rank)
        blocks, owners = self.placement.blocks_of(self.rank), self.placement.block_ranks
        self.previous = owners[blocks[0] - 1] if blocks[0] > 0 else None  # who hands this rank its input
        self.next = owners[blocks[-1] + 1] if blocks[-1] + 1 < len(owners) else None

    def _move(self, h: torch.Tensor | None, src: tuple[int, ...], dst: tuple[int, ...],
              shape: tuple[int, ...]) -> torch.Tensor | None:
        """From one owner to the next by a broadcast within the pair; the other ranks take no part."""
        if src == dst:
            return h
        pair = tuple(sorted(src + dst))
        if self.rank not in pair:
            return None
        return self._hand_off(h if self.rank == src[0] else None, src[0], dst[0], shape)

    def _hand_off(self, h: torch.Tensor | None, src: int, dst: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """`src`'s hidden states `h` on `dst` (None on `src`, which lets them go)."""
        pair = tuple(sorted((src, dst)))
        if self.rank == src:
            self.dist.broadcast(h.contiguous(), src, pair)
            return None
        return self.dist.broadcast(torch.empty(shape, dtype=self.dtype, device=self.dist.device), src, pair)

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        if self.compiled is None or self.exact_caches:
            return super().start(batch, length, pad_B)
        self.caches = self.compiled.caches_for(batch, length)  # kept for the next request of this shape
        self.padding = Padding.of(pad_B, self.dist.device)

    @torch.inference_mode()
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches, last_only: bool) -> torch.Tensor | None:
        B, S = tokens_BS.shape
        if self.compiled is None or S != 1 or caches is not self.caches:
            return super().tokens_to_logits(tokens_BS, start, padding, caches, last_only)
        shape = (B, 1, self.model.cfg.dim)
        x = (tokens_BS.to(self.dist.device) if self.previous is None
             else self._hand_off(None, self.previous, self.rank, shape))
        pad = padding.device_B if padding is not None else None
        if self.exact_caches:  # zeros mask and turn as no padding does, to the bit
            self.compiled.caches = caches
            pad = pad if pad is not None else self._no_padding(B)
        out = self.compiled(x, start, pad)
        if self.next is None:
            return out[:, None]
        return self._hand_off(out, self.rank, self.next, shape)

    def _no_padding(self, batch: int) -> torch.Tensor:
        if self._zeros is None or self._zeros.shape[0] != batch:
            self._zeros = torch.zeros(batch, dtype=torch.long, device=self.dist.device)
        return self._zeros

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.caches = None
        super().close()
