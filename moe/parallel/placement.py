"""Placement plan: which rank owns the embedding, each block and the head, and which ranks hold each expert.

A plain JSON-serialisable object, validated before any worker starts. Everything else (what a rank
loads, what it computes, who talks to whom) is derived from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PlacementError(ValueError):
    """The plan does not fit the model or the number of ranks; the message names the field."""


def balanced_ranges(n_items: int, n_parts: int) -> list[int]:
    """Sizes of n_parts contiguous ranges covering n_items, the first ones one larger when uneven."""
    return [n_items // n_parts + (1 if p < n_items % n_parts else 0) for p in range(n_parts)]


def owners_from_sizes(sizes: list[int]) -> list[int]:
    return [rank for rank, size in enumerate(sizes) for _ in range(size)]


@dataclass(frozen=True)
class Placement:
    world_size: int
    embed_rank: int
    block_ranks: tuple[int, ...]  # owner of each block's attention, norms, router and KV cache
    head_rank: int
    expert_ranks: tuple[tuple[tuple[int, ...], ...], ...]  # [block][expert] -> ranks holding a replica

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

    # ---- validation and queries ----------------------------------------------------------------

    def validate(self, n_layers: int, n_experts: int, world_size: int) -> Placement:
        def rank_ok(field: str, r: int) -> None:
            if not isinstance(r, int) or not 0 <= r < world_size:
                raise PlacementError(f"placement {field} = {r!r} is not a rank in 0..{world_size - 1}")

        if self.world_size != world_size:
            raise PlacementError(f"placement is for {self.world_size} ranks, but {world_size} were asked for")
        rank_ok("embed_rank", self.embed_rank)
        rank_ok("head_rank", self.head_rank)
        if len(self.block_ranks) != n_layers:
            raise PlacementError(f"placement block_ranks has {len(self.block_ranks)} entries, the model {n_layers}")
        for i, r in enumerate(self.block_ranks):
            rank_ok(f"block_ranks[{i}]", r)
        if len(self.expert_ranks) != n_layers:
            raise PlacementError(f"placement expert_ranks has {len(self.expert_ranks)} blocks, the model {n_layers}")
        for i, experts in enumerate(self.expert_ranks):
            if len(experts) != n_experts:
                raise PlacementError(f"placement expert_ranks[{i}] has {len(experts)} experts, the model {n_experts}")
            for e, ranks in enumerate(experts):
                if not ranks or len(set(ranks)) != len(ranks):
                    raise PlacementError(f"placement expert_ranks[{i}][{e}] = {list(ranks)} must list distinct ranks")
                for r in ranks:
                    rank_ok(f"expert_ranks[{i}][{e}]", r)
        return self

    def local_experts(self, block: int, rank: int) -> list[int]:
        """Global ids of the experts of `block` that `rank` holds, ascending."""
        return [e for e, ranks in enumerate(self.expert_ranks[block]) if rank in ranks]

    def blocks_of(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.block_ranks) if r == rank]

    # ---- files and display -----------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "embed_rank": self.embed_rank, "block_ranks": list(self.block_ranks),
                "head_rank": self.head_rank, "expert_ranks": [[list(r) for r in b] for b in self.expert_ranks]}

    @classmethod
    def from_json(cls, data: dict) -> Placement:
        try:
            return cls(int(data["world_size"]), data["embed_rank"], tuple(data["block_ranks"]), data["head_rank"],
                       tuple(tuple(tuple(r) for r in b) for b in data["expert_ranks"]))
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


def resolve_placement(placement: Placement | str | Path | dict | None, n_layers: int, n_experts: int, ranks: int,
                      blocks_per_rank: list[int] | None = None) -> Placement:
    """A validated plan from a Placement, a JSON file, a dict, or the default (optionally per-rank block counts)."""
    if placement is None:
        plan = Placement.default(n_layers, n_experts, ranks, blocks_per_rank)
    elif isinstance(placement, Placement):
        plan = placement
    elif isinstance(placement, dict):
        plan = Placement.from_json(placement)
    else:
        plan = Placement.load(placement)
    return plan.validate(n_layers, n_experts, ranks)
