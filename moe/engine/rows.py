"""Which rows of a batch each rank attends in blocks with replicated attention (data-parallel attention).

`generate` gives each rank a contiguous, balanced slice of its batch. The server gives each sequence a home rank
when it joins and keeps it there until it leaves (`homes`, one rank per row), as vLLM's data-parallel ranks keep
their own requests: a rank's KV cache rows never move to another rank when the batch changes, and a sequence is
attended by the same kernels on one rank from its first token to its last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.parallel.strategies import balanced_slice


@dataclass(frozen=True)
class Rows:
    """One rank's rows of a batch: a slice where they are contiguous (a view, no index), else index tensors on the
    host (for the host's padding copy) and on the device."""

    host: slice | torch.Tensor
    device: slice | torch.Tensor
    count: int

    @classmethod
    def of(cls, rows: list[int], device: torch.device) -> Rows:
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):
            span = slice(first, first + len(rows))
            return cls(span, span, len(rows))
        index = torch.tensor(rows, dtype=torch.long)
        return cls(index, index.to(device), len(rows))


def balanced(batch: int, ranks: int, device: torch.device) -> list[Rows]:
    """Each rank a contiguous slice, the first ones a row more where the batch does not divide."""
    return [Rows.of(list(balanced_slice(batch, ranks, r)), device) for r in range(ranks)]


def homed(homes: list[int], ranks: int, device: torch.device) -> list[Rows]:
    """Each rank the rows whose home it is, in batch order."""
    for h in homes:
        if not 0 <= h < ranks:
            raise ValueError(f"a row's home rank {h} is not one of the {ranks} ranks")
    return [Rows.of([i for i, h in enumerate(homes) if h == r], device) for r in range(ranks)]


def least_loaded(homes: list[int], ranks: int, new: int) -> list[int]:
    """Homes for `new` sequences joining a batch whose rows have `homes`: each on the rank with the fewest rows
    then (the lowest such rank), so every rank attends about as many sequences."""
    load = [homes.count(r) for r in range(ranks)]
    out = []
    for _ in range(new):
        r = load.index(min(load))
        load[r] += 1
        out.append(r)
    return out
