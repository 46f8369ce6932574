"""The class of placements where a block has fewer experts than there are ranks ("sharding never changes the
answer"): some ranks hold none of a block's experts, some get no rows, top-1 routing, replicas. Every rank count
from 1 to E + 2, every strategy that the shape allows, eager and compiled, fp32, bf16 and int8, against 1 rank."""

from __future__ import annotations

import pytest
import torch

from moe import MoEModel
from tests.checkpoints import tiny_config, write_checkpoint

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# 2 experts, top-1: on 3 and 4 ranks one or two ranks hold no expert of any block. A 9-token prompt and a short
# one: prompts take the all-to-all (where a rank with no experts receives an empty list of counts), decode steps
# the gathered exchange.
CONFIG = tiny_config(n_layers=2, n_experts=2, top_k=1)
PROMPTS = [[1, 5, 7, 9, 11, 13, 15, 17, 19], [1, 3]]
IDS = torch.tensor([[1, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]])
STRATEGIES = [("layer", "expert"), ("replicated", "expert"), ("tensor", "expert"), ("layer", "tensor"),
              ("replicated", "tensor"), ("layer", "layer")]
EXACT = {("layer", "expert"), ("replicated", "expert"), ("layer", "layer")}  # no partial sums added over ranks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("few-experts") / "ckpt", CONFIG, seed=5)


@pytest.fixture(scope="module")
def one_rank(ckpt):
    """{dtype: (logits, greedy tokens, the first prompt's greedy tokens alone)} on 1 rank."""
    out = {}
    for dtype in ("float32", "bfloat16", "int8"):
        with MoEModel.from_pretrained(ckpt, dtype=dtype) as model:
            out[dtype] = (model(IDS), model.generate(PROMPTS, max_new_tokens=8),
                          model.generate(PROMPTS[:1], max_new_tokens=8))
    return out


def runs(gpus: int, attention: str, experts: str) -> bool:
    """The layouts the shape allows: 4 query heads split over 1, 2 or 4 ranks."""
    return attention != "tensor" or 4 % gpus == 0


@pytest.mark.parametrize("gpus", [2, 3, 4])
@pytest.mark.parametrize(("attention", "experts"), STRATEGIES, ids=["/".join(s) for s in STRATEGIES])
def test_fp32_on_ranks_without_experts_gives_the_one_rank_answer(ckpt, one_rank, gpus, attention, experts):
    if not runs(gpus, attention, experts):
        pytest.skip(f"4 heads do not split over {gpus} ranks")
    logits, tokens, _ = one_rank["float32"]
    with MoEModel.from_pretrained(ckpt, gpus=gpus, attention=attention, experts=experts) as model:
        got = model(IDS)
        if (attention, experts) in EXACT:
            assert torch.equal(got, logits), (got - logits).abs().max().item()
        assert (got - logits).abs().max().item() < 1e-5
        assert model.generate(PROMPTS, max_new_tokens=8) == tokens


@pytest.mark.parametrize("gpus", [3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("attention", ["layer", "replicated"])
def test_bf16_and_int8_on_ranks_without_experts_give_the_one_rank_tokens(ckpt, one_rank, gpus, dtype, attention):
    """Whole experts, where the bits are the 1-rank bits in every precision."""
    logits, tokens, _ = one_rank[dtype]
    with MoEModel.from_pretrained(ckpt, gpus=gpus, dtype=dtype, attention=attention) as model:
        assert torch.equal(model(IDS), logits)
        assert model.generate(PROMPTS, max_new_tokens=8) == tokens


def test_replicas_and_a_rank_without_experts_give_the_one_rank_answer(ckpt, one_rank):
    """Expert 0 on ranks 0 and 2, expert 1 on rank 0 only, rank 1 none: copies alternate between replicas."""
    logits, tokens, _ = one_rank["float32"]
    plan = {"world_size": 3, "embed_rank": 0, "head_rank": 2, "block_ranks": [1, 2],
            "expert_ranks": [[[0, 2], [0]], [[2, 0], [0]]]}
    with MoEModel.from_pretrained(ckpt, gpus=3, placement=plan) as model:
        assert torch.equal(model(IDS), logits)
        assert model.generate(PROMPTS, max_new_tokens=8) == tokens


def test_compiled_steps_on_ranks_without_experts_give_the_one_rank_tokens(ckpt, one_rank):
    """Rank 2 holds no expert. (A compiled pipeline, where every rank holds its blocks' experts, is no case of this
    class: tests/test_serve_compiled.py compiles one on 2 ranks, tests/test_compiled_ranks.py and test_torchrun.py
    on 3.)"""
    _, tokens, alone = one_rank["float32"]
    with MoEModel.from_pretrained(ckpt, gpus=3, attention="replicated", experts="expert", compile=True) as model:
        assert model.info.compiled
        assert model.generate(PROMPTS[:1], max_new_tokens=8) == alone  # a lone sequence: the compiled step
        assert model.generate(PROMPTS, max_new_tokens=8) == tokens


def test_a_compiled_pipeline_with_a_rank_without_blocks_is_refused_in_one_line(ckpt):
    with pytest.raises(ValueError, match=r"needs a block on every rank \(2 blocks over 3 ranks leave rank 2 none"):
        MoEModel.from_pretrained(ckpt, gpus=3, experts="layer", compile=True)
