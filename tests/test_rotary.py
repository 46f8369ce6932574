"""Rotary cos/sin come from a table of every position (`RotaryTable`): the same bits as computing them for the
positions at hand, so prompts, eager steps and compiled steps all rotate by the same values."""

from __future__ import annotations

import pytest
import torch

from models.rope import TABLE_STEP, RotaryTable, base_frequencies, rotary_tables
from tests.checkpoints import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_table_rows_are_the_computed_values(dtype, head_dim):
    cfg = tiny_config(head_dim=head_dim, max_seq_len=4096, rope_theta=1e6)
    table = RotaryTable(cfg)
    prompt = torch.arange(37)[None].expand(2, -1)
    padded = (torch.arange(600)[None] - torch.tensor([[0], [5], [599]])).clamp(min=0)  # 3 rows, left padding
    steps = torch.tensor([[0], [1], [4095], [2047]])
    for positions in (prompt, padded, steps):
        want = rotary_tables(positions, base_frequencies(cfg.rope_theta, head_dim), 1.0, dtype)
        got = table(positions, dtype, int(positions.max()) + 1)
        assert got[0].shape == want[0].shape == (positions.shape[0], 1, positions.shape[1], head_dim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_table_follows_the_dtype_asked_for():
    table = RotaryTable(tiny_config())
    positions = torch.tensor([[3, 4]])
    assert table(positions, torch.float32, 5)[0].dtype == torch.float32
    cos, sin = table(positions, torch.bfloat16, 5)
    assert cos.dtype == sin.dtype == torch.bfloat16 and table.cos.shape == (256, 16)


def test_a_long_context_builds_only_the_positions_met():
    """A 1M-token context: the table holds the positions calls have needed, grown a step at a time."""
    table = RotaryTable(tiny_config(max_seq_len=2**20))
    table(torch.arange(10)[None], torch.float32, 10)
    assert table.cos.shape[0] == TABLE_STEP
    table(torch.tensor([[TABLE_STEP + 3]]), torch.float32, TABLE_STEP + 4)
    assert table.cos.shape[0] == 2 * TABLE_STEP
