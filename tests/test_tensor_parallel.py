"""Tensor-parallel attention and experts and per-block strategies ("sharding never changes the answer", "a rank
reads only what it holds"): N ranks against one rank for each strategy and for mixed plans, the slices each rank
reads, a save from a tensor-parallel plan read back by transformers, and the plan's errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe import MoEModel
from moe.parallel.placement import Placement, PlacementError
from tests.checkpoints import ROOT, tiny_config, write_checkpoint
from tests.readme_blocks import blocks as readme_blocks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SHAPES = {
    # Multi-query attention: one KV head for 4 query heads, held by every rank of a 2- or 4-rank group.
    "3blocks-mqa": tiny_config(n_layers=3, n_heads=4, n_kv_heads=1, n_experts=4, top_k=2),
    # Two KV heads, 8 experts, tied embeddings, a sliding window.
    "4blocks-8experts-tied": tiny_config(n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2,
                                         tie_embeddings=True, sliding_window=6),
}
PROMPTS = [[1, 5, 9, 33, 7], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 100]]


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    cfg = SHAPES[request.param]
    path = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", cfg, seed=5)
    model = MoEModel.from_pretrained(path)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    return path, cfg, ids, model(ids), model.generate(PROMPTS, max_new_tokens=10, temperature=0)


def check_same_as_one_rank(reference, **kwargs) -> MoEModel:
    path, _, ids, logits, tokens = reference
    with MoEModel.from_pretrained(path, **kwargs) as model:
        assert (model(ids) - logits).abs().max().item() < 1e-5
        assert model.generate(PROMPTS, max_new_tokens=10, temperature=0) == tokens
    return model


def block(attention: str, ranks=None, experts: str = "expert", groups=None) -> dict:
    out = {"attention": attention, "experts": experts}
    if ranks is not None:
        out["ranks"] = list(ranks)
    if groups is not None:
        out["groups"] = [list(g) for g in groups]
    return out


def plan(cfg, world: int, blocks: list[dict], embed: int = 0, head: int | None = None) -> dict:
    """Experts of `expert` blocks in contiguous runs over the ranks; of `tensor` blocks over the groups."""
    experts = []
    for b in blocks:
        owners = b["groups"] if b["experts"] == "tensor" else [[r] for r in range(world)]
        experts.append([owners[e * len(owners) // cfg.n_experts] for e in range(cfg.n_experts)])
    return {"world_size": world, "embed_rank": embed, "head_rank": world - 1 if head is None else head,
            "blocks": blocks, "expert_ranks": experts}


@pytest.mark.parametrize("gpus, attention, experts", [
    (2, "tensor", "expert"),  # heads split, whole experts exchanged from the group's first rank
    (2, "tensor", "tensor"),  # vLLM's layout: one all-reduce for attention, one for experts
    (4, "tensor", "tensor"),  # MQA: the one KV head on all 4 ranks
    (3, "layer", "tensor"),  # experts split over every rank, attention on each block's owner
    (2, "replicated", "tensor"),  # batch slices, every copy to both slices of its expert
    (2, "layer", "layer"),  # a pipeline of whole blocks: experts with their block's owner, no exchange
    (3, "layer", "layer"),
])
def test_one_strategy_for_every_block_gives_the_one_rank_answer(reference, gpus, attention, experts):
    model = check_same_as_one_rank(reference, gpus=gpus, attention=attention, experts=experts)
    assert {b.attention for b in model.info.placement.blocks} == {attention}


def test_two_expert_groups_each_split_two_ways(reference):
    """Megatron's expert-tensor parallelism: experts placed over 2 groups, each expert's F split inside."""
    cfg = reference[1]
    groups = [[0, 1], [2, 3]]
    check_same_as_one_rank(reference, gpus=4, placement=plan(cfg, 4, [block("layer", [i % 4], "tensor", groups)
                                                                     for i in range(cfg.n_layers)]))


def test_a_plan_mixing_strategies_across_blocks(reference):
    cfg = reference[1]
    kinds = [block("tensor", [0, 1]),  # attention split over 2, experts placed whole over 4
             block("layer", [2], "tensor", [[0, 1, 2, 3]]),  # one owner, every expert split over all 4
             block("tensor", [2, 3], "tensor", [[2, 3]]),  # vLLM's layout on a 2-rank subgroup; ranks 0, 1 idle
             block("tensor", [0, 1, 2, 3], "tensor", [[0, 1], [2, 3]])]  # heads over 4, experts 2 groups x 2
    blocks = [kinds[i % len(kinds)] for i in range(cfg.n_layers)]
    check_same_as_one_rank(reference, gpus=4, placement=plan(cfg, 4, blocks, embed=1, head=2))


def test_the_readme_plan_gives_the_one_rank_answer(tmp_path):
    (example,) = [b for b in readme_blocks("json", ROOT / "docs" / "parallelism.md") if '"blocks"' in b]
    (tmp_path / "plan.json").write_text(example)
    shipped = ROOT / "weights" / "tiny-moe-austen-bbe"
    one = MoEModel.from_pretrained(shipped)
    want = one.generate(["It is a truth universally"], max_new_tokens=12)
    with MoEModel.from_pretrained(shipped, gpus=4, placement=tmp_path / "plan.json") as model:
        assert model.generate(["It is a truth universally"], max_new_tokens=12) == want
        assert [b.describe() for b in model.info.placement.blocks] == [
            "tensor[0,1,2,3] / tensor[0,1,2,3]", "tensor[0,1] / expert", "layer[2] / tensor[0,1][2,3]",
            "tensor[2,3] / tensor[2,3]"]


def test_the_expert_load_report_shows_each_blocks_strategy(reference):
    path, cfg, *_ = reference
    with MoEModel.from_pretrained(path, gpus=2, attention="tensor", experts="tensor") as model:
        model.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        report = model.expert_load()
    assert "tensor[0,1] / tensor[0,1]" in report.table()
    assert report.routed_tokens == sum(map(len, PROMPTS)) + 3 * len(PROMPTS)  # counted once, routed on both ranks
    copies = report.total.sum(1).double()
    assert (report.rank_load() == copies[:, None]).all()  # each rank computes its slice of every copy


def test_replicated_blocks_among_others_split_the_batch_for_those_blocks(reference):
    """3 ranks: the logits' batch of 2 leaves one rank without a sequence in the replicated blocks."""
    cfg = reference[1]
    kinds = [block("replicated", None, "expert"),
             block("tensor", [0, 1]),
             block("replicated", None, "tensor", [[0, 1, 2]]),
             block("layer", [2], "tensor", [[0, 1, 2]])]
    blocks = [kinds[i % len(kinds)] for i in range(cfg.n_layers)]
    check_same_as_one_rank(reference, gpus=3, placement=plan(cfg, 3, blocks, embed=1, head=0))


def test_each_rank_reads_only_its_slices(reference):
    path, cfg, *_ = reference
    with MoEModel.from_pretrained(path, gpus=2, attention="tensor", experts="tensor") as model:
        reads, bytes_read = model.info.tensors_read, model.info.bytes_read
    Dh, F, D = cfg.head_dim, cfg.hidden_dim, cfg.dim
    kv_rows = Dh * max(cfg.n_kv_heads // 2, 1)
    for rank in (0, 1):
        got = reads[rank]
        assert got["model.layers.0.self_attn.q_proj.weight"] == [[cfg.n_heads // 2 * Dh, D]]
        assert got["model.layers.0.self_attn.k_proj.weight"] == [[kv_rows, D]]
        assert got["model.layers.0.self_attn.o_proj.weight"] == [[D, cfg.n_heads // 2 * Dh]]
        for e in range(cfg.n_experts):
            assert got[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] == [[F // 2, D]]
            assert got[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] == [[D, F // 2]]
        head = [[cfg.vocab_size, D]] if rank == 1 and cfg.tie_embeddings else []  # the tied head reads it whole
        assert got["model.embed_tokens.weight"] == [[cfg.vocab_size // 2, D]] + head  # its half of the vocabulary
        # bytes: what the shapes say, nothing more
        assert bytes_read[rank] == 4 * sum(torch.Size(shape).numel() for shapes in got.values() for shape in shapes)
    # Split tensors are read once over the ranks; a KV head both ranks need (MQA) by both.
    full = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    twice = cfg.n_layers * 2 * Dh * D * 4 if cfg.n_kv_heads == 1 else 0
    tied = cfg.vocab_size * D * 4 if cfg.tie_embeddings else 0  # the head on rank 1 reads the whole embedding too
    assert abs(sum(bytes_read) - twice - tied - full) < 64 * 1024  # headers are the only difference


def test_a_save_from_a_tensor_parallel_plan_loads_in_transformers(reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, cfg, ids, logits, _ = reference
    groups = [[0, 1], [2, 3]]
    mixed = plan(cfg, 4, [block("tensor", [0, 1, 2, 3], "tensor", groups if i % 2 else [[0, 1, 2, 3]])
                          for i in range(cfg.n_layers)])
    with MoEModel.from_pretrained(path, gpus=4, placement=mixed) as model:
        model.save_pretrained(tmp_path / "saved")
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "saved", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(ids).logits - logits).abs().max().item() < 1e-4
    assert (MoEModel.from_pretrained(tmp_path / "saved")(ids) - logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("change, words", [
    (lambda p: p["blocks"][1].update(ranks=[0, 1, 2]), ["4 query heads", "3 ranks"]),
    (lambda p: p["blocks"][0].update(experts="tensor", groups=[[0, 1, 2, 3, 4]]), ["rank 4", "0..3"]),
    (lambda p: p["blocks"][2].pop("attention"), ["blocks[2]", "no attention strategy"]),
    (lambda p: p["blocks"].pop(), ["every block needs an attention strategy"]),
    (lambda p: p["blocks"][0].update(experts="tensor", groups=[[0, 1], [1, 2]]), ["share a rank"]),
    (lambda p: p["blocks"][0].update(experts="layer"), ["blocks[0]", "experts 'layer'", "needs attention 'layer'"]),
    (lambda p: p["blocks"].__setitem__(1, block("layer", [2], "layer")),
     ["expert_ranks[1][0] = [0]", "held by its owner alone, rank 2"]),
])
def test_plan_errors_are_one_line_before_any_rank_starts(tmp_path, change, words):
    cfg = tiny_config(n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96)
    path = write_checkpoint(tmp_path / "ckpt", cfg)
    bad = plan(cfg, 4, [block("tensor", [0, 1, 2, 3]) for _ in range(cfg.n_layers)])
    change(bad)
    with pytest.raises(PlacementError) as e:
        MoEModel.from_pretrained(path, gpus=4, placement=bad)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_indivisible_hidden_dimension_is_named(tmp_path):
    cfg = tiny_config(hidden_dim=96)
    path = write_checkpoint(tmp_path / "ckpt", cfg)
    with pytest.raises(PlacementError, match="hidden dimension 96 cannot be split evenly over 5 ranks"):
        MoEModel.from_pretrained(path, gpus=5, experts="tensor")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(path), "--gpus", "3",
                           "--attention", "tensor", "--prompt", "hi", "--max-new-tokens", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "4 query heads and 2 KV heads cannot be split evenly over 3 ranks" in proc.stderr


def test_the_plan_round_trips_and_prints_each_blocks_strategy():
    cfg = tiny_config(n_layers=3)
    p = Placement.default(3, cfg.n_experts, 2).with_strategies("tensor", "tensor").validate(3, cfg.n_experts, 2, cfg)
    again = Placement.from_json(p.to_json()).validate(3, cfg.n_experts, 2, cfg)
    assert again == p and "block_ranks" not in p.to_json()
    assert "0-2     tensor[0,1] / tensor[0,1]" in p.table()
    assert Placement.default(3, 4, 2).to_json().keys() >= {"block_ranks", "expert_ranks"}  # the old form unchanged


def test_the_planner_rebalances_whole_experts_and_keeps_split_ones():
    from moe.reports.planner import plan_placement

    cfg = tiny_config(n_layers=2, n_experts=8)
    base = Placement.from_json(plan(cfg, 4, [block("layer", [0]), block("tensor", [0, 1, 2, 3], "tensor",
                                                                         [[0, 1], [2, 3]])]))
    base = base.validate(2, 8, 4, cfg)
    counts = torch.tensor([[90, 1, 1, 1, 1, 1, 1, 1], [90, 1, 1, 1, 1, 1, 1, 1]])
    planned = plan_placement(counts, 4, 0, base).validate(2, 8, 4, cfg)
    assert planned.blocks == base.blocks
    assert planned.expert_ranks[1] == base.expert_ranks[1]  # split over groups: not the planner's to move
    assert planned.expert_ranks[0] != base.expert_ranks[0]  # balanced by the measured load
