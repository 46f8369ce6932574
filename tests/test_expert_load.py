"""Expert-load counting, reports and load-balanced placement."""

from __future__ import annotations

import csv
import json
import math
import os
import stat
import subprocess
import sys

import pytest
import torch

from moe import MoEModel
from moe.parallel.placement import Placement
from moe.reports.planner import plan_block, plan_placement, predicted_imbalance
from tests.checkpoints import ROOT, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("load") / "ckpt", tiny_config(n_layers=3, n_experts=4, top_k=2))


def run_round_robin(model: MoEModel) -> None:
    model.set_debug_routing(True)
    model.generate([[1, 5, 6, 7, 8], [1, 9, 10]], max_new_tokens=4, temperature=0)


# Prompt tokens 5 + 3 (the padding is not routed): 8 tokens, 16 copies over 4 experts round-robin.
# Decode: 3 forward steps of 2 tokens, each step's 4 copies go to experts 0, 1, 2, 3.
PREFILL, DECODE = [4, 4, 4, 4], [3, 3, 3, 3]


def test_exact_counts_under_round_robin_routing_on_one_rank(ckpt, tmp_path):
    model = MoEModel.from_pretrained(ckpt)
    run_round_robin(model)
    report = model.expert_load()
    assert report.counts[:, 0].tolist() == [PREFILL] * 3 and report.counts[:, 1].tolist() == [DECODE] * 3
    assert int(report.total[0].sum()) == (8 + 6) * 2  # tokens x k per block
    check_written_report(report, tmp_path)


@pytest.mark.multiprocess
def test_exact_counts_identical_on_every_rank(ckpt, tmp_path):
    with MoEModel.from_pretrained(ckpt, gpus=3) as model:
        run_round_robin(model)
        per_rank = model.engine.each_rank("load_stats")
        report = model.expert_load()
    for counts, _, received in per_rank[1:]:
        assert torch.equal(counts, per_rank[0][0]) and torch.equal(received, per_rank[0][2])
    assert report.counts[:, 0].tolist() == [PREFILL] * 3 and report.counts[:, 1].tolist() == [DECODE] * 3
    # Default placement over 3 ranks: experts {0,1}, {2}, {3}; the measured rows per rank agree.
    assert report.rank_load()[0].tolist() == [14.0, 7.0, 7.0]
    check_written_report(report, tmp_path)


@pytest.mark.multiprocess
def test_counts_and_entropy_once_when_every_rank_runs_the_sequence(ckpt):
    """One sequence on 2 ranks with replicated attention: both ranks route it alike (`ReplicatedAttentionEngine.
    redundant`) and only one counts it; two sequences are split again and each rank counts its own."""
    def run(model):
        model.track_router_entropy()
        for ids in ([[1, 5, 6, 7, 8]], [[1, 5, 6, 7, 8], [1, 9, 10]], [[1, 9, 10]]):
            model.generate(ids, max_new_tokens=4, temperature=0)
        report = model.expert_load()
        return report.counts, report.to_json()["mean_router_entropy"], report.rank_load()[0]

    with MoEModel.from_pretrained(ckpt) as model:
        counts, entropy, _ = run(model)
    with MoEModel.from_pretrained(ckpt, gpus=2, attention="replicated") as model:
        got, got_entropy, rows = run(model)
    assert torch.equal(got, counts)
    assert got_entropy == pytest.approx(entropy, rel=1e-6)
    assert rows.sum().item() == counts.sum().item() / 3  # rows computed per block, over both ranks: each copy once


def check_written_report(report, out):
    paths = report.write(out)
    data = json.loads((out / "expert_load.json").read_text())
    rows = list(csv.DictReader((out / "expert_load.csv").open()))
    assert sum(map(sum, data["counts"])) == sum(int(r["total"]) for r in rows) == int(report.total.sum())
    assert sum(int(r["prefill"]) for r in rows) == sum(map(sum, data["counts_prefill"]))
    assert f"total {int(report.total.sum())} token copies" in report.table()
    assert data["unused_experts"] == 0 and data["imbalance"]["experts"]["max_over_mean"] == pytest.approx(1.0)
    if (out / "expert_load.png").exists():
        assert (out / "expert_load.png").read_bytes()[:4] == b"\x89PNG" and len(paths) == 3


def test_plan_block_balances_a_skewed_load_by_hand():
    # Default contiguous groups over 2 ranks: {0,1} = 100, {2,3} = 20.
    loads = [90.0, 10.0, 10.0, 10.0]
    # Two slots per rank: 90 + 10 | 10 + 10 is the best without replicas.
    assert plan_block(loads, 2, replicas=0) == ((0,), (1,), (1,), (0,))
    # The hottest gets a second replica (45 each), three slots per rank: 45 + 10 + 10 | 45 + 10.
    assert plan_block(loads, 2, replicas=1) == ((0, 1), (0,), (1,), (0,))


def test_planned_placement_lowers_predicted_imbalance():
    counts = torch.tensor([[50, 40, 5, 5, 0, 0, 0, 0], [1, 1, 1, 1, 30, 30, 1, 1]], dtype=torch.float64)
    default = Placement.default(2, 8, 4)
    planned = plan_placement(counts, 4, replicas=2)
    planned.validate(2, 8, 4)
    assert predicted_imbalance(counts, planned) < predicted_imbalance(counts, default)
    assert planned.block_ranks == default.block_ranks


@pytest.mark.multiprocess
@pytest.mark.slow
def test_replicated_expert_splits_its_tokens_and_keeps_the_answer(ckpt):
    one = MoEModel.from_pretrained(ckpt)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    want = one(ids)
    experts = (((0, 1), (0,), (1,), (1,)),) * 3
    plan = Placement(2, 0, (0, 1, 1), 1, experts)
    with MoEModel.from_pretrained(ckpt, gpus=2, placement=plan) as model:
        assert (model(ids) - want).abs().max().item() < 1e-5  # real routing, replicas in play
        model.reset_expert_load()
        model.set_debug_routing(True)
        model(ids)
        report = model.expert_load()
    # 16 copies round-robin: 4 per expert; expert 0's four split 2/2 over ranks 0 and 1.
    assert report.rank_load().tolist() == [[6.0, 10.0]] * 3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_planned_placement_lowers_measured_imbalance_with_identical_tokens(ckpt, tmp_path):
    prompts = [[1] + [5] * 20, [1] + [9] * 15]  # repeated tokens route alike: a skewed load
    with MoEModel.from_pretrained(ckpt, gpus=4) as model:
        tokens = model.generate(prompts, max_new_tokens=6, temperature=0)
        before = model.expert_load()
    plan = plan_placement(before.total, 4, replicas=1)
    with MoEModel.from_pretrained(ckpt, gpus=4, placement=plan) as model:
        assert model.generate(prompts, max_new_tokens=6, temperature=0) == tokens
        after = model.expert_load()
    skew_before = before.to_json()["imbalance"]["ranks"]["max_over_mean"]
    per_block_before = [b["ranks"]["max_over_mean"] for b in before.to_json()["imbalance"]["per_block"]]
    per_block_after = [b["ranks"]["max_over_mean"] for b in after.to_json()["imbalance"]["per_block"]]
    assert sum(per_block_after) < sum(per_block_before), (per_block_before, per_block_after, skew_before)


def test_plan_placement_script(ckpt, tmp_path):
    model = MoEModel.from_pretrained(ckpt)
    model.generate([[1] + [5] * 20], max_new_tokens=4, temperature=0)
    model.expert_load().write(tmp_path / "load")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_placement.py"),
                           str(tmp_path / "load" / "expert_load.json"), "--gpus", "2", "--replicas", "1",
                           "--out", str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "predicted max/mean rank load" in proc.stdout
    Placement.load(tmp_path / "plan.json").validate(3, 4, 2)


def test_report_files_get_the_permissions_the_umask_allows(ckpt, tmp_path):
    with MoEModel.from_pretrained(ckpt) as model:
        model.generate([[1, 5, 9]], max_new_tokens=2)
        report = model.expert_load()
    old = os.umask(0o022)
    try:
        paths = report.write(tmp_path / "load")
    finally:
        os.umask(old)
    assert paths and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in paths)
    assert sorted(p.name for p in (tmp_path / "load").iterdir()) == sorted(p.name for p in paths)  # no leftovers


def test_router_entropy_only_when_asked_for(ckpt):
    with MoEModel.from_pretrained(ckpt) as model:
        model.generate([[1, 5, 9]], max_new_tokens=3)
        assert model.expert_load().to_json()["mean_router_entropy"] is None  # nothing computed: costs nothing
        model.track_router_entropy()
        model.generate([[1, 5, 9]], max_new_tokens=3)
        entropy = model.expert_load().to_json()["mean_router_entropy"]
    assert 0 < entropy <= math.log(tiny_config().n_experts)
    with MoEModel.from_pretrained(ckpt) as fresh:  # the mean covers the tracked tokens only
        fresh.track_router_entropy()
        fresh.generate([[1, 5, 9]], max_new_tokens=3)
        assert fresh.expert_load().to_json()["mean_router_entropy"] == pytest.approx(entropy, rel=1e-9)


def test_a_dense_block_has_no_experts_and_the_others_count_what_transformers_routes(tmp_path):
    """Qwen3-MoE with a dense block among MoE ones (`mlp_only_layers`): the report leaves that block out of every
    figure (no unused experts, no CSV rows, no share of the means), and the other blocks count the experts
    transformers' routers choose."""
    from tests.test_families import hf_family

    hf = hf_family("qwen3_moe-unnormalised", num_hidden_layers=3)  # 4 experts top-2; block 1 dense
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        chosen = [r.topk(2, dim=-1).indices.flatten() for r in hf(ids, output_router_logits=True).router_logits]
    with MoEModel.from_pretrained(tmp_path / "hf") as model:
        model(ids)
        report = model.expert_load()
    routed = [torch.bincount(c, minlength=4).tolist() for c in chosen]
    assert report.total.tolist() == [routed[0], [0] * 4, routed[1]]
    data = report.to_json()
    assert data["dense_blocks"] == [1] and data["routed_tokens"] == ids.numel() and data["unused_experts"] == sum(
        row.count(0) for row in routed)
    assert data["imbalance"]["per_block"][1] == {"block": 1, "strategy": "layer[0] / expert", "dense": True}
    assert "dense: no experts" in report.table().splitlines()[2]
    report.write(tmp_path / "load")
    rows = list(csv.DictReader((tmp_path / "load" / "expert_load.csv").open()))
    assert {r["block"] for r in rows} == {"0", "2"} and len(rows) == 8
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_placement.py"),
                           str(tmp_path / "load" / "expert_load.json"), "--gpus", "2", "--out",
                           str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    predicted = [float(x.split()[-1]) for x in proc.stdout.splitlines()[-2].split(":")[1].split(",")]
    assert min(predicted) >= 1.0  # a max over a mean, taken over the blocks with experts only
