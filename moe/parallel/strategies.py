"""How one block is sharded: its attention and its experts, each by one of the schools of sharding.

Attention (with its norms and KV cache):
- `layer`: one owner rank (layer placement, as Mistral's reference code splits layers over pipeline ranks);
- `replicated`: every rank holds it and attends for its own slice of the batch (DeepSeek's data-parallel
  attention); among other blocks, the batch is split over the ranks before it and gathered after it;
- `tensor`: the heads split evenly over a group of ranks (Megatron's column-parallel q/k/v, row-parallel output
  and one all-reduce). With fewer KV heads than ranks, each KV head is held by every rank whose query heads use it.

Experts:
- `expert`: whole experts placed on ranks (with replicas), reached by the all-to-all or gathered exchange;
- `tensor`: every expert's hidden dimension F split over a group (w1/w3 column-parallel, w2 row-parallel, one
  all-reduce). With several groups, experts are placed whole over the groups and split inside each
  (Megatron's expert-tensor parallelism): a token copy goes to every rank of its expert's group;
- `layer`: every expert whole on the block's attention owner, so the block runs on one rank with no exchange
  (Mistral's reference pipeline, whose ranks hold whole layers; llama.cpp's layer split). Needs attention `layer`.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_STRATEGIES = ("layer", "replicated", "tensor")
EXPERT_STRATEGIES = ("expert", "tensor", "layer")


class PlacementError(ValueError):
    """The plan does not fit the model or the number of ranks; the message names the field (and the block)."""


@dataclass(frozen=True)
class BlockStrategy:
    attention: str = "layer"
    attention_ranks: tuple[int, ...] = ()  # layer: (owner,); tensor: the group; replicated: every rank
    experts: str = "expert"
    expert_groups: tuple[tuple[int, ...], ...] = ()  # tensor: groups that each split F; expert: ()

    @property
    def leader(self) -> int:
        """The attention rank that brings the block's tokens to an exchange (the owner, or a group's first)."""
        return self.attention_ranks[0]

    @property
    def split_experts(self) -> int:
        """Ranks each expert's F is split over (1: whole experts)."""
        return len(self.expert_groups[0]) if self.experts == "tensor" else 1

    @property
    def local_tensor_experts(self) -> bool:
        """Every expert split over one group that also holds the block's hidden states: local experts and one
        all-reduce, no exchange (vLLM's layout for Mixtral). Otherwise copies travel by the exchange."""
        return self.experts == "tensor" and len(self.expert_groups) == 1 and self.attention != "replicated"

    @property
    def needs_exchange(self) -> bool:
        """The block's token copies travel to its experts by the exchange, which every rank enters (with no rows of
        its own, if need be). Not where the experts sit with the hidden states: on the owner (`layer`) or on the one
        group that splits them all."""
        return not (self.experts == "layer" or self.local_tensor_experts)

    def to_json(self) -> dict:
        out: dict = {"attention": self.attention}
        if self.attention != "replicated":
            out["ranks"] = list(self.attention_ranks)
        out["experts"] = self.experts
        if self.experts == "tensor":
            out["groups"] = [list(g) for g in self.expert_groups]
        return out

    @classmethod
    def from_json(cls, data: object, block: int, world_size: int) -> BlockStrategy:
        where = f"placement blocks[{block}]"
        if not isinstance(data, dict) or "attention" not in data:
            raise PlacementError(f"{where} has no attention strategy (one of {', '.join(ATTENTION_STRATEGIES)})")
        try:
            attention, experts = data["attention"], data.get("experts", "expert")
            ranks = tuple(range(world_size)) if attention == "replicated" else tuple(data["ranks"])
            groups = tuple(tuple(g) for g in data["groups"]) if experts == "tensor" else ()
        except KeyError as e:
            raise PlacementError(f"{where} lacks field {e} for attention {data.get('attention')!r} / experts "
                                f"{data.get('experts', 'expert')!r}") from None
        except TypeError:
            raise PlacementError(f"{where}: ranks and groups must be lists of rank numbers") from None
        return cls(attention, ranks, experts, groups)

    def describe(self) -> str:
        """'tensor[0,1] / expert' for tables and reports."""
        attn = self.attention if self.attention == "replicated" else f"{self.attention}[{_ranks(self.attention_ranks)}]"
        experts = self.experts if self.experts in ("expert", "layer") else \
            "tensor" + "".join(f"[{_ranks(g)}]" for g in self.expert_groups)
        return f"{attn} / {experts}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))


def validate_block(s: BlockStrategy, block: int, world_size: int, cfg) -> None:
    """Every check that needs the model's shapes: a one-line error naming the block, before any rank starts."""
    where = f"placement blocks[{block}]"
    if s.attention not in ATTENTION_STRATEGIES:
        raise PlacementError(f"{where}: attention {s.attention!r} is not one of {', '.join(ATTENTION_STRATEGIES)}")
    if s.experts not in EXPERT_STRATEGIES:
        raise PlacementError(f"{where}: experts {s.experts!r} is not one of {', '.join(EXPERT_STRATEGIES)}")
    _check_group(s.attention_ranks, f"{where} attention ranks", world_size)
    if s.attention == "layer" and len(s.attention_ranks) != 1:
        raise PlacementError(f"{where}: attention 'layer' has one owner rank, got {list(s.attention_ranks)}")
    if s.attention == "tensor":
        g, H, G = len(s.attention_ranks), cfg.n_heads, cfg.n_kv_heads
        if H % g or (G % g and g % G):
            raise PlacementError(f"{where}: {H} query heads and {G} KV heads cannot be split evenly over {g} ranks "
                                "(the heads must divide by the ranks, and the KV heads divide them or by them)")
        if cfg.qk_norm == "projection":
            raise PlacementError(f"{where}: attention 'tensor' would split the q and k norms, which {cfg.family} takes "
                                 "over every head's projection at once; use attention 'layer' or 'replicated'")
    if s.experts == "tensor":
        if not s.expert_groups:
            raise PlacementError(f"{where}: experts 'tensor' needs at least one group of ranks")
        seen: set[int] = set()
        for group in s.expert_groups:
            _check_group(group, f"{where} expert group {list(group)}", world_size)
            if seen & set(group):
                raise PlacementError(f"{where}: expert groups {[list(x) for x in s.expert_groups]} share a rank")
            seen |= set(group)
        sizes = {len(group) for group in s.expert_groups}
        if len(sizes) > 1:
            raise PlacementError(f"{where}: expert groups {[list(x) for x in s.expert_groups]} differ in size")
        if cfg.hidden_dim % sizes.pop():
            raise PlacementError(f"{where}: the experts' hidden dimension {cfg.hidden_dim} cannot be split evenly "
                                f"over {len(s.expert_groups[0])} ranks")
    elif s.expert_groups:
        raise PlacementError(f"{where}: groups are for experts 'tensor'; experts {s.experts!r} are placed by "
                             "expert_ranks")
    if s.experts == "layer" and s.attention != "layer":
        raise PlacementError(f"{where}: experts 'layer' (every expert on the block's owner) needs attention 'layer', "
                             f"got {s.attention!r}")


def _check_group(ranks: tuple[int, ...], what: str, world_size: int) -> None:
    if not ranks or len(set(ranks)) != len(ranks):
        raise PlacementError(f"{what} = {list(ranks)} must list distinct ranks")
    for r in ranks:
        if not isinstance(r, int) or not 0 <= r < world_size:
            raise PlacementError(f"{what} names rank {r!r}, outside the world of ranks 0..{world_size - 1}")


def head_slices(n_heads: int, n_kv_heads: int, size: int, index: int) -> tuple[range, range]:
    """(query heads, KV heads) of member `index` of a tensor-parallel group of `size` ranks."""
    q = balanced_slice(n_heads, size, index)
    if n_kv_heads >= size:
        return q, balanced_slice(n_kv_heads, size, index)
    kv = index // (size // n_kv_heads)  # fewer KV heads than ranks: the one KV head these query heads use
    return q, range(kv, kv + 1)


def balanced_ranges(n_items: int, n_parts: int) -> list[int]:
    """Sizes of n_parts contiguous ranges covering n_items, the first ones one larger when uneven."""
    return [n_items // n_parts + (1 if p < n_items % n_parts else 0) for p in range(n_parts)]


def balanced_slice(n: int, size: int, index: int) -> range:
    """Member `index`'s range of `n` items split by `balanced_ranges` over `size` members (heads, the experts'
    hidden dimension and the vocabulary over a tensor group; a batch over the ranks)."""
    sizes = balanced_ranges(n, size)
    start = sum(sizes[:index])
    return range(start, start + sizes[index])
