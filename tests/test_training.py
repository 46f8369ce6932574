"""The expert-parallel trainer: one step on 2 ranks equals the same step on 1 rank."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from moe.parallel.distributed import init_process_group, single_process
from moe.parallel.placement import Placement
from moe.training.steps import (
    TrainSettings,
    clip_grads,
    forward_backward,
    init_model,
    lr_at,
    sample_batch,
    shard_experts,
    sync_dense_grads,
)
from moe.workers.group import run_ranks

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, vocab_size=101,
                  n_experts=4, top_k=2, max_seq_len=64, rope_theta=10000.0)
SETTINGS = TrainSettings(seq_len=12, batch_size=4, balance_coef=0.05, grad_clip=0.5, seed=3)


def one_step(ctx) -> dict:
    torch.manual_seed(0)
    model = init_model(CFG, SETTINGS.seed)
    if ctx.distributed:
        shard_experts(model, Placement.default(CFG.n_layers, CFG.n_experts, ctx.world_size), ctx)
    model.to(ctx.device).train()
    stream = torch.randint(0, CFG.vocab_size, (500,), generator=torch.Generator().manual_seed(1))
    batch = sample_batch(stream, SETTINGS.batch_size, SETTINGS.seq_len, step=0, seed=SETTINGS.seed)
    ce_sum, balance = forward_backward(model, batch, SETTINGS, ctx)
    sync_dense_grads(model, ctx)
    norm = clip_grads(model, SETTINGS.grad_clip, ctx)
    stats = torch.stack([ce_sum.double(), balance.double()])
    if ctx.distributed:
        torch.distributed.all_reduce(stats)
    experts = {n: m.expert_ids for n, m in model.named_modules() if hasattr(m, "expert_ids")}
    return {"loss": float(stats[0]) / batch[:, 1:].numel(), "balance": float(stats[1]), "norm": norm,
            "grads": {n: p.grad.cpu() for n, p in model.named_parameters()}, "experts": experts}


def _rank_step(rank: int, world_size: int, port: int, out_dir: str) -> None:
    ctx = init_process_group(rank, world_size, "127.0.0.1", port)
    torch.save(one_step(ctx), f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_two_rank_step_matches_one_rank(tmp_path):
    ref = one_step(single_process())
    run_ranks(_rank_step, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ref["norm"] > SETTINGS.grad_clip  # clipping is exercised, with the same global norm
    for got in ranks:
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["balance"] == pytest.approx(ref["balance"], rel=1e-6)
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-6)
        for name, grad in got["grads"].items():
            module = name.rsplit(".", 1)[0]
            expected = ref["grads"][name]
            if module in got["experts"]:  # this rank's slice of the stacked experts
                expected = expected[got["experts"][module]]
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=name)
    held = sorted(e for got in ranks for e in got["experts"]["layers.0.feed_forward.experts"])
    assert held == list(range(CFG.n_experts))  # the experts really were split between the ranks


def test_balance_loss_is_one_when_routing_is_uniform():
    model = init_model(CFG, 0)
    with torch.no_grad():
        for block in model.layers.values():
            block.feed_forward.gate.weight.zero_()  # equal logits: probabilities 1/E, top-k ties
    model.train()
    batch = sample_batch(torch.arange(400) % CFG.vocab_size, 4, 12, step=0, seed=0)
    _, balance = forward_backward(model, batch, SETTINGS, single_process())
    # Equal logits: P_e = 1/E for every expert, so E * sum_e f_e * P_e = sum_e f_e = 1 whichever experts top-k
    # picks. A loss not normalised by the global token and copy counts would miss 1.
    assert float(balance) == pytest.approx(1.0)


def test_schedule_warms_up_then_decays_to_the_floor():
    s = TrainSettings(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, s) == pytest.approx(0.1)
    assert lr_at(9, 100, s) == pytest.approx(1.0)
    assert lr_at(100, 100, s) == pytest.approx(0.1)
    assert lr_at(55, 100, s) == pytest.approx(0.55)


@pytest.mark.multiprocess
def test_train_script_on_two_ranks_writes_a_loadable_checkpoint(tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    from moe import MoEModel
    from tests.checkpoints import ROOT, SHIPPED

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "\n\n".join(f"And God said to chapter {i}, let there be light.\nAnd there was light." for i in range(60))
    (corpus / "train.txt").write_text(text)
    (corpus / "valid.txt").write_text(text[:400])
    shutil.copyfile(SHIPPED / "tokenizer.model", corpus / "tokenizer.model")
    out = tmp_path / "model"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--corpus", str(corpus), "--out", str(out),
         "--gpus", "2", "--steps", "4", "--eval-every", "2", "--dim", "32", "--layers", "2", "--heads", "2",
         "--kv-heads", "1", "--hidden-dim", "32", "--experts", "4", "--seq-len", "16", "--batch-size", "4"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "validation (all" in proc.stdout
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 4 and log["ranks"] == 2 and "val_loss" in log["history"][1]
    model = MoEModel.from_pretrained(out)
    assert model.config.n_experts == 4 and model.generate(["And God said"], max_new_tokens=3)
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--corpus", str(corpus), "--out",
                            str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
