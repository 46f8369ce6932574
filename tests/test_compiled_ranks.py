"""`compile=True` on N ranks: with attention replicated a lone sequence's decode step is the whole model on every
rank, compiled with each block's sum over ranks as an opaque op; in a pipeline of whole blocks each rank's range is
compiled. Both give the 1-rank tokens and count the same loads as the eager ranks; the replicated layout leaves
larger batches to the eager steps; compile is refused where a rank would run part of a block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe import MoEModel
from moe.engine.compiled import compile_step
from moe.parallel.distributed import init_process_group
from moe.workers.group import run_ranks
from tests.checkpoints import TRAINED

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # each rank compiles its step (tens of seconds)


@pytest.mark.parametrize("experts", ["expert", "tensor"])
def test_two_ranks_compiled_give_the_one_rank_tokens(experts):
    layout = dict(gpus=2, attention="replicated", experts=experts)
    check_compiled_against_eager(MoEModel.from_pretrained(TRAINED), layout)  # a batch of 2 runs eager there


def check_compiled_against_eager(one: MoEModel, layout: dict) -> None:
    """The compiled ranks and the eager ones give `one`'s tokens (greedy, and sampled), and count the same copies
    per expert and rows each rank computed."""
    with MoEModel.from_pretrained(TRAINED, **layout) as eager, \
            MoEModel.from_pretrained(TRAINED, compile=True, **layout) as compiled:
        assert compiled.info.compiled and not eager.info.compiled
        for prompts in ([[1, 45, 312, 9, 77]], [[1, 700, 12, 13]], [[1, 45, 312, 9], [1, 8]]):
            want = one.generate(prompts, max_new_tokens=20, ignore_eos=True)
            assert compiled.generate(prompts, max_new_tokens=20, ignore_eos=True) == want, prompts
            assert eager.generate(prompts, max_new_tokens=20, ignore_eos=True) == want, prompts
        sampled = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)
        assert compiled.generate(["And God said"], **sampled) == one.generate(["And God said"], **sampled)
        eager.generate(["And God said"], **sampled)
        ran, want = compiled.expert_load(), eager.expert_load()
        assert torch.equal(ran.counts, want.counts) and torch.equal(ran.received, want.received)


def test_a_pipeline_of_whole_blocks_compiled_gives_the_one_rank_tokens():
    """Each rank's range of blocks compiled (the first from the tokens, a middle one, the last to the logits),
    batches too. Two ranks: tests/test_serve_compiled.py."""
    check_compiled_against_eager(MoEModel.from_pretrained(TRAINED), dict(gpus=3, experts="layer"))


def test_compile_on_ranks_that_run_part_of_a_step_is_refused():
    for layout in (dict(gpus=2), dict(gpus=2, attention="tensor"), dict(gpus=2, experts="tensor")):
        with pytest.raises(ValueError, match="compile=True on N ranks needs replicated attention in every block"):
            MoEModel.from_pretrained(TRAINED, compile=True, **layout)
    with pytest.raises(ValueError, match="needs exchange='auto' \\(got 'gather'\\)"):
        MoEModel.from_pretrained(TRAINED, compile=True, gpus=2, attention="replicated", exchange="gather")
    replicas = {"world_size": 2, "embed_rank": 0, "head_rank": 0,
                "blocks": [{"attention": "replicated", "experts": "expert"}] * 4,
                "expert_ranks": [[[0, 1], [0], [0], [0], [1], [1], [1], [1]]] + [None] * 3}
    with pytest.raises(ValueError, match="needs experts without replicas"):
        MoEModel.from_pretrained(TRAINED, compile=True, gpus=2, placement=replicas)
    interleaved = {"world_size": 2, "embed_rank": 0, "head_rank": 1,
                   "blocks": [{"attention": "layer", "ranks": [r], "experts": "layer"} for r in (0, 1, 0, 1)]}
    with pytest.raises(ValueError, match="experts 'layer' needs each rank's blocks in one contiguous range"):
        MoEModel.from_pretrained(TRAINED, compile=True, gpus=2, placement=interleaved)


def _compiled_sum(rank: int, world_size: int, port: int, out: str) -> None:
    dist = init_process_group(rank, world_size, "127.0.0.1", port)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))

    def step(t: torch.Tensor) -> torch.Tensor:
        return dist.sum_in_rank_order(t * 3) - 1

    got, eager = compile_step(step, dist.device)(x), step(x)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"same": torch.equal(got, eager), "sum": got.tolist()}))
    dist.destroy()


def test_a_compiled_sum_over_ranks_gives_the_eager_bits(tmp_path):
    run_ranks(_compiled_sum, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    x0, x1 = (torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(2))
    assert all(r["same"] for r in ranks)
    assert ranks[0]["sum"] == ranks[1]["sum"] == (x0 * 3 + x1 * 3 - 1).tolist()
