"""Placement plan: which rank owns the embedding, each block and the head, and which ranks hold each expert.

A plain JSON-serialisable object, validated before any worker starts. Everything else (what a rank
loads, what it computes, who talks to whom) is derived from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moe.parallel.strategies import BlockStrategy, PlacementError, balanced_ranges, validate_block

__all__ = ["Placement", "PlacementError", "balanced_ranges", "resolve_placement"]


def owners_from_sizes(sizes: list[int]) -> list[int]:
    return [rank for rank, size in enumerate(sizes) for _ in range(size)]


@dataclass(frozen=True)
class Placement:
    world_size: int
    embed_rank: int
    block_ranks: tuple[int, ...]  # owner of each block's attention, norms, router and KV cache
    head_rank: int
    expert_ranks: tuple[tuple[tuple[int, ...], ...], ...]  # [block][expert] -> ranks holding a replica (or,
    # for experts split by `tensor`, the group that holds the expert's slices)
    blocks: tuple[BlockStrategy, ...] | None = None  # per block; None: attention by layer, experts placed whole

    @classmethod
    def default(cls, n_layers: int, n_experts: int, world_size: int,
                blocks_per_rank: list[int] | None = None) -> Placement:
        """Contiguous balanced block ranges (embedding first, head last); experts in contiguous groups."""
        sizes = blocks_per_rank if blocks_per_rank is not None else balanced_ranges(n_layers, world_size)
        if len(sizes) != world_size or sum(sizes) != n_layers or min(sizes) < 0:
            raise PlacementError(f"blocks per rank {sizes} must have {world_size} entries summing to {n_layers}")
        expert_owner = owners_from_sizes(balanced_ranges(n_experts, world_size))
        experts = tuple(tuple((expert_owner[e],) for e in range(n_experts)) for _ in range(n_layers))
        return cls(world_size, 0, tuple(owners_from_sizes(sizes)), world_size - 1, experts)

    def with_strategies(self, attention: str, experts: str, group_size: int | None = None) -> Placement:
        """Every block's attention and experts by one strategy over all ranks (the API's and CLI's shortcuts):
        attention "layer" keeps the owners, "replicated" and "tensor" use every rank; experts "expert" keep their
        placement, "tensor" splits every expert over all ranks, or, with `group_size`, over groups of that many
        consecutive ranks that hold contiguous runs of experts (expert-tensor parallelism), "layer" puts every expert
        of a block on its owner (a pipeline of whole blocks)."""
        everyone = tuple(range(self.world_size))
        size = group_size or self.world_size
        if experts == "tensor" and (size < 1 or self.world_size % size):
            raise PlacementError(f"expert groups of {size} ranks do not divide {self.world_size} ranks")
        groups = tuple(everyone[g:g + size] for g in range(0, self.world_size, size)) if experts == "tensor" else ()
        blocks, experts_at = [], []
        for i, owner in enumerate(self.block_ranks):
            ranks = (owner,) if attention == "layer" else everyone
            blocks.append(BlockStrategy(attention, ranks, experts, groups))
            experts_at.append(self.expert_ranks[i] if experts == "expert" else None)  # filled below
        # Attention split over all ranks and experts exchanged: the last block's result is on the first rank, so the
        # head goes there (no send per step); otherwise it stays on the last rank, beside no embedding.
        head = self.embed_rank if (attention, experts) == ("tensor", "expert") else self.head_rank
        return replace(self, block_ranks=tuple(b.leader for b in blocks), head_rank=head, blocks=tuple(blocks),
                       expert_ranks=tuple(experts_at)).fill_experts(len(self.expert_ranks[0]))

    def fill_experts(self, n_experts: int) -> Placement:
        """Experts of blocks the plan leaves out (None): contiguous runs over the ranks, or, for experts split by
        `tensor`, over the block's groups; experts `layer` all on the block's owner."""
        if all(b is not None for b in self.expert_ranks) or (self.blocks is not None
                                                                and len(self.blocks) != len(self.expert_ranks)):
            return self  # nothing left out, or a plan `validate` refuses
        filled = []
        for i, held in enumerate(self.expert_ranks):
            s = self.strategy(i)
            owners = (s.expert_groups if s.experts == "tensor" else ((s.leader,),) if s.experts == "layer"
                      else tuple((r,) for r in range(self.world_size)))
            runs = owners_from_sizes(balanced_ranges(n_experts, len(owners)))  # as `default` places experts
            filled.append(held if held is not None else tuple(owners[runs[e]] for e in range(n_experts)))
        return replace(self, expert_ranks=tuple(filled))

    def strategy(self, block: int) -> BlockStrategy:
        if self.blocks is None:
            return BlockStrategy("layer", (self.block_ranks[block],))
        return self.blocks[block]

    @property
    def embed_ranks(self) -> tuple[int, ...]:
        """Ranks holding the embedding: the embed rank, or, when the first block's attention is split over a group
        that includes it, every rank of that group, each a share of the vocabulary's rows (one all-reduce per step
        gives all of them the embedded tokens, where the embed rank would send them to each)."""
        first = self.strategy(0) if self.block_ranks else None
        if first is not None and first.attention == "tensor" and self.embed_rank in first.attention_ranks:
            return first.attention_ranks
        return (self.embed_rank,)

    @property
    def replicated(self) -> bool:
        """Attention replicated over the batch in every block: each rank runs the whole dense model on its slice of
        the batch (`moe.engine.replicated`). Replicated in some blocks only, the batch is split for those."""
        return self.blocks is not None and all(s.attention == "replicated" for s in self.blocks)

    @property
    def pipeline(self) -> bool:
        """Every block whole on its owner (experts `layer`): a pipeline of whole blocks (`moe.engine.pipeline`)."""
        return self.blocks is not None and all(s.experts == "layer" for s in self.blocks)

    @property
    def whole_experts(self) -> list[int]:
        """Blocks whose experts are placed whole (the ones a load-balancing planner may move)."""
        return [i for i in range(len(self.block_ranks)) if self.strategy(i).experts == "expert"]

    # ---- validation and queries ----------------------------------------------------------------

    def validate(self, n_layers: int, n_experts: int, world_size: int, cfg=None) -> Placement:
        def rank_ok(field: str, r: int) -> None:
            if not isinstance(r, int) or not 0 <= r < world_size:
                raise PlacementError(f"placement {field} = {r!r} is not a rank in 0..{world_size - 1}")

        if self.world_size != world_size:
            raise PlacementError(f"placement is for {self.world_size} ranks, but {world_size} were asked for")
        rank_ok("embed_rank", self.embed_rank)
        rank_ok("head_rank", self.head_rank)
        if self.blocks is not None and len(self.blocks) != n_layers:
            raise PlacementError(f"placement blocks has {len(self.blocks)} entries, the model {n_layers}: every "
                                 "block needs an attention strategy")
        if len(self.block_ranks) != n_layers:
            raise PlacementError(f"placement block_ranks has {len(self.block_ranks)} entries, the model {n_layers}")
        for i, r in enumerate(self.block_ranks):
            rank_ok(f"block_ranks[{i}]", r)
        if len(self.expert_ranks) != n_layers:
            raise PlacementError(f"placement expert_ranks has {len(self.expert_ranks)} blocks, the model {n_layers}")
        for i, experts in enumerate(self.expert_ranks):
            if experts is None:
                raise PlacementError(f"placement expert_ranks[{i}] is missing")
            if len(experts) != n_experts:
                raise PlacementError(f"placement expert_ranks[{i}] has {len(experts)} experts, the model {n_experts}")
            for e, ranks in enumerate(experts):
                if not ranks or len(set(ranks)) != len(ranks):
                    raise PlacementError(f"placement expert_ranks[{i}][{e}] = {list(ranks)} must list distinct ranks")
                for r in ranks:
                    rank_ok(f"expert_ranks[{i}][{e}]", r)
        if self.blocks is not None:
            self._validate_blocks(world_size, cfg)
        return self

    def _validate_blocks(self, world_size: int, cfg) -> None:
        for i, s in enumerate(self.blocks):
            if cfg is not None:
                validate_block(s, i, world_size, cfg)
            if s.experts == "layer":
                for e, ranks in enumerate(self.expert_ranks[i]):
                    if tuple(ranks) != (s.leader,):
                        raise PlacementError(f"placement expert_ranks[{i}][{e}] = {list(ranks)}: block {i}'s experts "
                                             f"'layer' are held by its owner alone, rank {s.leader}")
            if s.experts == "tensor":
                for e, ranks in enumerate(self.expert_ranks[i]):
                    if tuple(ranks) not in s.expert_groups:
                        raise PlacementError(f"placement expert_ranks[{i}][{e}] = {list(ranks)} is not one of block "
                                             f"{i}'s expert groups {[list(g) for g in s.expert_groups]}")

    def local_experts(self, block: int, rank: int) -> list[int]:
        """Global ids of the experts of `block` that `rank` holds, ascending."""
        return [e for e, ranks in enumerate(self.expert_ranks[block]) if rank in ranks]

    def blocks_of(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.block_ranks) if r == rank]

    def attended_by(self, rank: int) -> list[int]:
        """The blocks whose attention (whole or some heads) and KV cache `rank` holds."""
        return [i for i in range(len(self.block_ranks)) if rank in self.strategy(i).attention_ranks]

    # ---- files and display -----------------------------------------------------------------------

    def to_json(self) -> dict:
        """The owners in `block_ranks`, or, with strategies, every block's strategy in `blocks` instead."""
        out = {"world_size": self.world_size, "embed_rank": self.embed_rank, "head_rank": self.head_rank}
        if self.blocks is None:
            out["block_ranks"] = list(self.block_ranks)
        else:
            out["blocks"] = [s.to_json() for s in self.blocks]
        return out | {"expert_ranks": [[list(r) for r in b] for b in self.expert_ranks]}

    @classmethod
    def from_json(cls, data: dict) -> Placement:
        try:
            world = int(data["world_size"])
            blocks = None
            if "blocks" in data:
                if "block_ranks" in data:
                    raise PlacementError("placement gives both block_ranks and blocks: say each block's attention "
                                         "ranks in blocks only")
                blocks = tuple(BlockStrategy.from_json(b, i, world) for i, b in enumerate(data["blocks"]))
                owners = tuple(b.leader if b.attention_ranks else 0 for b in blocks)
            else:
                owners = tuple(data["block_ranks"])
            # With strategies, a block's experts may be left out (null, or no expert_ranks at all): `fill_experts`
            experts = data["expert_ranks"] if blocks is None or "expert_ranks" in data else [None] * len(blocks)
            return cls(world, data["embed_rank"], owners, data["head_rank"],
                       tuple(None if b is None else tuple(tuple(r) for r in b) for b in experts), blocks)
        except (KeyError, TypeError) as e:
            raise PlacementError(f"placement JSON lacks or mistypes field {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as e:
            raise PlacementError(f"{path}: cannot read placement file ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise PlacementError(f"{path}: not valid JSON ({e})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def table(self) -> str:
        """One row per rank: what it owns and how many expert replicas it holds."""
        rows = ["rank  blocks           experts held (of all blocks)  extra"]
        for r in range(self.world_size):
            blocks = compress(self.blocks_of(r)) or "-"
            held = sum(len(self.local_experts(i, r)) for i in range(len(self.block_ranks)))
            extra = " ".join(n for n, owner in (("embed", self.embed_rank), ("head", self.head_rank)) if owner == r)
            rows.append(f"{r:>4}  {blocks:<15}  {held:>28}  {extra}")
        if self.blocks is not None:
            rows += ["", "blocks  attention / experts"]
            runs = [(i, self.blocks[i].describe()) for i in range(len(self.blocks))]
            start = 0
            for i in range(1, len(runs) + 1):  # consecutive blocks with one strategy on one line
                if i == len(runs) or runs[i][1] != runs[start][1]:
                    rows.append(f"{compress(list(range(start, i))):<6}  {runs[start][1]}")
                    start = i
        return "\n".join(rows)


def compress(items: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def resolve_placement(placement: Placement | str | Path | dict | None, cfg, ranks: int,
                      blocks_per_rank: list[int] | None = None, attention: str = "layer",
                      experts: str = "expert") -> Placement:
    """A validated plan from a Placement, a JSON file, a dict, or the default (optionally per-rank block counts),
    with every block's strategies set by `attention` / `experts` when those are not the defaults."""
    n_layers, n_experts = cfg.n_layers, cfg.n_experts
    if placement is None:
        plan = Placement.default(n_layers, n_experts, ranks, blocks_per_rank)
    elif isinstance(placement, Placement):
        plan = placement
    elif isinstance(placement, dict):
        plan = Placement.from_json(placement)
    else:
        plan = Placement.load(placement)
    if len(plan.expert_ranks) == n_layers:
        plan = plan.fill_experts(n_experts)
    if (attention, experts) != ("layer", "expert"):
        if plan.blocks is not None:
            raise PlacementError("the placement gives each block's strategies; leave attention= and experts= out")
        plan.validate(n_layers, n_experts, ranks)
        plan = plan.with_strategies(attention, experts)
    return plan.validate(n_layers, n_experts, ranks, cfg)
