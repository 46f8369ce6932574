"""A block's glue as native ops (models/kernels/csrc/block_glue.cpp) against the torch chains they replace: RoPE with
the cache write, the grouping of copies by expert, their weighted sum and the experts' SwiGLU give those chains'
bits; the norm gives torch's within rounding, each row's own whatever its batch; an eager model on native kernels
runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels import native
from models.mixture import Dispatched, group_by_expert, weighted_sum
from models.norms import RMSNorm
from models.rope import apply_rotary
from moe import MoEModel
from moe.bench.speed import decode_step_ops
from tests.checkpoints import SHIPPED

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernel not built: {native.why_unavailable()}")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_tables", [True, False])
def test_rotary_into_cache_gives_apply_rotarys_bits(dtype, batch_tables):
    torch.manual_seed(0)
    B, S, H, G, Dh, L, start = 3, 5, 4, 2, 64, 16, 7
    qkv = torch.randn(B, S, H + 2 * G, Dh, dtype=dtype) * 4
    q, k, v = qkv.split((H, G, G), dim=2)  # views, as the fused q/k/v product's split gives them
    cos, sin = (torch.randn(B if batch_tables else 1, 1, S, Dh, dtype=dtype) for _ in range(2))
    k_cache, v_cache = torch.zeros(B, G, L, Dh, dtype=dtype), torch.zeros(B, G, L, Dh, dtype=dtype)
    turned_q = native.rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, start)
    turned = apply_rotary(torch.cat((q.transpose(1, 2), k.transpose(1, 2)), dim=1), cos, sin)
    assert torch.equal(turned_q, turned[:, :H])
    assert torch.equal(k_cache[:, :, start:start + S], turned[:, H:])
    assert torch.equal(v_cache[:, :, start:start + S], v.transpose(1, 2))
    assert not k_cache[:, :, :start].any() and not v_cache[:, :, start + S:].any()  # no other slot written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,width", [(1, 2, 64), (7, 3, 32), (40, 8, 512)])  # the last: threads split
def test_grouping_and_weighted_sum_give_the_torch_chains_bits(dtype, tokens, top_k, width):
    torch.manual_seed(1)
    E = 10
    x = torch.randn(tokens, width, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    rows, counts, token, weight = native.group_by_expert(x, weights, ids, E)
    g = group_by_expert(ids, E)
    assert torch.equal(counts, g.counts_E) and torch.equal(token, g.token_N)
    assert torch.equal(rows, x[g.token_N]) and torch.equal(weight, weights.reshape(-1)[g.order_N])
    y = torch.randn(tokens * top_k, width, dtype=dtype) * 3
    assert torch.equal(native.combine(y, weight, token, tokens), weighted_sum(y, Dispatched(token, weight, tokens)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_of_fused_halves_gives_torchs_bits(dtype):
    """Widths around torch's loop step (a row's last values go one by one there, with another exp)."""
    torch.manual_seed(3)
    step = native.torch_vector_width(dtype)
    for rows, width in [(1, 1792), (3, 384), (2, step - 1), (5, step + 7), (4, 2 * step + 3), (70, 37)]:
        h = torch.randn(rows, 2 * width, dtype=dtype) * 4
        assert torch.equal(native.silu_mul(h), F.silu(h[:, :width]).mul_(h[:, width:])), (rows, width)


def test_expert_ids_are_counted_and_checked():
    table = torch.zeros(2, 5, dtype=torch.long)
    native.count_ids(table, 1, torch.tensor([[1, 3], [3, 4]]))
    assert table.tolist() == [[0, 0, 0, 0, 0], [0, 1, 0, 2, 1]]
    with pytest.raises(RuntimeError, match="expert id 5 of 5"):
        native.count_ids(table, 0, torch.tensor([5]))
    with pytest.raises(RuntimeError, match="expert id 7 of 5"):
        native.group_by_expert(torch.zeros(1, 4), torch.ones(1, 1), torch.tensor([[7]]), 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_norm_is_torchs_within_rounding_and_each_rows_own(dtype, weight_in_fp32):
    torch.manual_seed(2)
    norm = RMSNorm(300, 1e-5, weight_in_fp32).to(dtype)  # 300: lanes and a tail
    norm.weight.data = torch.randn(300, dtype=dtype)
    x = torch.randn(6, 2, 300, dtype=dtype) * 5
    ours = native.rms_norm(x, norm.weight, norm.eps, weight_in_fp32)
    step = torch.finfo(dtype).eps * 4  # the sums' orders differ: an ulp of the scale, then the weight's rounding
    torch.testing.assert_close(ours, norm(x), rtol=step, atol=step)
    assert torch.equal(native.rms_norm(x[2:3, 1:], norm.weight, norm.eps, weight_in_fp32), ours[2:3, 1:])


def test_an_eager_model_on_native_kernels_runs_the_glue_and_keeps_the_torch_answer():
    path = SHIPPED
    prompt = [[1, 5, 9, 3, 12, 40]]
    with MoEModel.from_pretrained(path, compile=False) as ours, \
            MoEModel.from_pretrained(path, compile=False, cpu_kernels="torch") as plain:
        ops = decode_step_ops(ours.engine)
        blocks = ours.config.n_layers
        for op in ("add_attention", "add_routed_experts"):
            assert ops[f"moe_cpu.{op}"] >= blocks, op
        assert not decode_step_ops(plain.engine)["moe_cpu.rms_norm"]
        ours_out = ours.generate(prompt, max_new_tokens=8, ignore_eos=True)
        assert ours_out == plain.generate(prompt, max_new_tokens=8, ignore_eos=True)


def family_checkpoint(name: str, tmp_path):
    """The shipped Mixtral checkpoint, or a tiny random one of another family (`tests.test_families.hf_family`)."""
    if name == "mixtral":
        return SHIPPED
    from tests.test_families import hf_family

    hf_family(name).save_pretrained(tmp_path / name)
    return tmp_path / name


def decode_logits(model: MoEModel, steps: int = 4) -> list[torch.Tensor]:
    """A padded batch of two prompts, then `steps` greedy decode steps: each step's logits."""
    engine, prompts = model.engine, torch.tensor([[0, 0, 5, 9, 3], [1, 7, 2, 8, 4]])
    with torch.inference_mode():
        engine.start(2, 32, torch.tensor([2, 0]))
        logits = [engine.forward_last(prompts, 0)]
        for i in range(steps):
            logits.append(engine.forward_last(logits[-1].argmax(-1, keepdim=True), prompts.shape[1] + i))
    return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])  # qwen3_moe: per-head q/k norms, head_dim != dim/heads
def test_a_decode_steps_attention_in_one_op_gives_the_ops_bits(name, dtype, tmp_path, monkeypatch):
    from models.attention import Attention

    monkeypatch.setattr(Attention, "one_op_operands", lambda *args: None)  # the op on its own, not in the block's
    with MoEModel.from_pretrained(family_checkpoint(name, tmp_path), dtype=dtype, compile=False) as model:
        assert decode_step_ops(model.engine)["moe_cpu.attend_one"] == model.config.n_layers
        fused = decode_logits(model)
        monkeypatch.setattr(Attention, "attends_in_one_op", lambda *args: False)
        assert not decode_step_ops(model.engine)["moe_cpu.attend_one"]
        for one_op, op_by_op in zip(fused, decode_logits(model), strict=True):
            assert torch.equal(one_op, op_by_op)
