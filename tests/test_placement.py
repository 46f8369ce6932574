"""Placement plans and the index math of expert parallelism, by hand."""

from __future__ import annotations

import pytest
import torch

from moe.parallel.dispatch import SlotTable, chunk_order
from moe.parallel.placement import Placement, PlacementError, balanced_ranges


def test_balanced_ranges():
    assert balanced_ranges(6, 4) == [2, 2, 1, 1]
    assert balanced_ranges(8, 3) == [3, 3, 2]
    assert balanced_ranges(2, 4) == [1, 1, 0, 0]


def test_default_placement_uneven_counts():
    p = Placement.default(n_layers=6, n_experts=8, world_size=3)
    assert p.block_ranks == (0, 0, 1, 1, 2, 2)
    assert (p.embed_rank, p.head_rank) == (0, 2)
    assert [p.local_experts(0, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(b == p.expert_ranks[0] for b in p.expert_ranks)


def test_more_ranks_than_blocks_and_experts():
    p = Placement.default(n_layers=2, n_experts=3, world_size=4)
    assert p.block_ranks == (0, 1) and p.head_rank == 3
    assert p.local_experts(1, 3) == [] and p.blocks_of(2) == []


def test_blocks_per_rank_override_and_its_validation():
    assert Placement.default(4, 2, 2, blocks_per_rank=[3, 1]).block_ranks == (0, 0, 0, 1)
    with pytest.raises(PlacementError, match="summing to 4"):
        Placement.default(4, 2, 2, blocks_per_rank=[2, 1])


def test_json_round_trip_and_validation(tmp_path):
    p = Placement.default(3, 4, 2)
    p.save(tmp_path / "p.json")
    assert Placement.load(tmp_path / "p.json") == p
    bad = p.to_json() | {"head_rank": 5}
    with pytest.raises(PlacementError, match="head_rank = 5"):
        Placement.from_json(bad).validate(3, 4, 2)
    with pytest.raises(PlacementError, match="for 2 ranks, but 3"):
        p.validate(3, 4, 3)
    missing = p.to_json()
    missing["expert_ranks"][1][2] = []
    with pytest.raises(PlacementError, match=r"expert_ranks\[1\]\[2\]"):
        Placement.from_json(missing).validate(3, 4, 2)


def test_table_lists_every_rank():
    table = Placement.default(6, 8, 4).table().splitlines()
    assert len(table) == 5 and "embed" in table[1] and "head" in table[4] and "0-1" in table[1]


def test_slot_table_by_hand():
    # 4 experts on 2 ranks: rank 0 holds 0,1; rank 1 holds 2,3 and a replica of 0.
    t = SlotTable(((0, 1), (0,), (1,), (1,)), world_size=2)
    assert t.slots_per_rank == 3
    assert t.slot_of.tolist() == [[0, 3], [1, -1], [4, -1], [5, -1]]
    # Copies of expert 0 alternate between its replicas, in order of appearance.
    ids = torch.tensor([0, 2, 0, 0, 1, 0])
    assert t.slots(ids).tolist() == [0, 4, 3, 0, 1, 3]


def test_chunk_order_groups_by_slot_then_source():
    # received from rank 0: 2 rows of slot 0, 1 of slot 1; from rank 1: 1 row of slot 0, 2 of slot 1
    counts = torch.tensor([[2, 1], [1, 2]])
    rows = torch.tensor([10, 11, 12, 20, 21, 22])  # tens digit: source rank + 1, order within
    assert rows[chunk_order(counts)].tolist() == [10, 11, 20, 12, 21, 22]
