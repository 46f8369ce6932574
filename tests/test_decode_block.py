"""A decode step's block in two ops (models/kernels/csrc/decode_block.cpp), called by a batch's plan
(models/decode_plan.py) or through the modules, against the ops they chain, as the eager model calls them one by
one without them: the same logits and expert loads, bit for bit; where an op does not apply (a shared expert,
PhiMoE's router and norms, GraniteMoE's multipliers), the model keeps the ops."""

from __future__ import annotations

import pytest
import torch

from models.attention import Attention
from models.decode_plan import DecodePlan
from models.kernels import decode_block, native
from models.mixture import MoEFeedForward
from moe import MoEModel
from moe.bench.speed import decode_step_ops
from tests.test_block_glue import decode_logits, family_checkpoint

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernel not built: {native.why_unavailable()}")


def loads(model: MoEModel) -> list[torch.Tensor]:
    return [m.load_counts for m in model.engine.model.modules() if isinstance(m, MoEFeedForward)]


def plan_modules_and_op_by_op(model: MoEModel, monkeypatch) -> list[tuple]:
    """(logits, loads) of `decode_logits`, each from zeroed load tables: the steps as a plan of block ops
    (`models.decode_plan`), then through the modules (which call the block ops), then without the block ops."""
    runs = []
    for way in ("plan", "modules", "op by op"):
        if way == "modules":
            monkeypatch.setattr(DecodePlan, "runs", lambda *args: False)
        if way == "op by op":
            monkeypatch.setattr(MoEFeedForward, "in_one_op", lambda *args: False)
            monkeypatch.setattr(Attention, "one_op_operands", lambda *args: None)
        for table in loads(model):
            table.zero_()
        runs.append((decode_logits(model), [table.clone() for table in loads(model)]))
        assert (model.engine.plan.blocks is not None) == (way == "plan")  # the plan made, or never asked
    return runs


# the families whose attention half runs as one op: not with q/k/v biases (this Qwen3-MoE's and GraniteMoE's), q
# and residual scales (GraniteMoE) or norms of whole projections (OLMoE); their routed experts still run as one op
ATTENTION_OP = {"mixtral": True, "qwen3_moe": True, "qwen3_moe-unnormalised": False, "granitemoe": False,
                "olmoe": False}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("name", list(ATTENTION_OP))
def test_gives_the_op_by_op_logits_and_loads(name, dtype, tmp_path, monkeypatch):
    """The router's kinds (top-k of logits; of probabilities, renormalised or not), per-head q/k norms, a dense layer
    among MoE ones (qwen3_moe), fp32, bf16 and int8 weights."""
    with MoEModel.from_pretrained(family_checkpoint(name, tmp_path), dtype=dtype, compile=False) as model:
        ops, cfg = decode_step_ops(model.engine), model.config
        moe_blocks = cfg.n_layers - len(cfg.dense_layers)
        assert ops["moe_cpu.add_attention"] == (cfg.n_layers if ATTENTION_OP[name] else 0)
        assert ops["moe_cpu.add_routed_experts"] + ops["moe_cpu.routed_experts"] == moe_blocks
        assert not ops["moe_cpu.route"] and not ops["moe_cpu.group_by_expert"] and not ops["aten.topk"]
        (plan, plan_loads), *others = plan_modules_and_op_by_op(model, monkeypatch)
        ops = decode_step_ops(model.engine)
        assert ops["moe_cpu.group_by_expert"] == moe_blocks and not ops["moe_cpu.add_attention"]
    assert sum(t.sum() for t in plan_loads) > 0
    for logits, step_loads in others:
        for ours, theirs in zip(plan + plan_loads, logits + step_loads, strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["qwen2_moe", "phimoe"])
def test_a_shared_expert_or_another_router_keeps_the_ops(name, tmp_path):
    with MoEModel.from_pretrained(family_checkpoint(name, tmp_path), compile=False) as model:
        ops = decode_step_ops(model.engine)
    assert ops["moe_cpu.group_by_expert"]
    assert not ops["moe_cpu.routed_experts"] and not ops["moe_cpu.add_routed_experts"]


def test_refuses_mismatched_shapes():
    with pytest.raises(RuntimeError, match="routed_experts: x"):
        decode_block.routed_experts(torch.randn(1, 8), torch.randn(4, 6), (torch.randn(4, 6, 8), torch.randn(4, 8, 3)),
                                    (None, None), 2, 0, True, None, 0)


@pytest.mark.parametrize(("name", "where"), [("mixtral", "block"), ("mixtral", "norm"), ("mixtral", "router"),
                                           ("qwen3_moe", "q_norm")])
def test_a_hook_runs_at_every_decode_step(name, where, tmp_path):
    """A forward hook on a block or on a module the block ops, or `attend_one` without them, would call in its place
    (a user's capture of activations) runs at every step, and the logits stay the same bits."""
    with MoEModel.from_pretrained(family_checkpoint(name, tmp_path), compile=False) as model:
        want = decode_logits(model)
        block = model.engine.model.layers["0"]
        module = block.get_submodule({"block": "", "norm": "ffn_norm", "router": "feed_forward.gate",
                                      "q_norm": "attention.q_norm"}[where])
        calls = []
        handle = module.register_forward_hook(lambda *args: calls.append(1))
        got = decode_logits(model)
        handle.remove()
    assert len(calls) == 5  # the prompt and 4 decode steps
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours, theirs)
