"""CPU weight formats (oneDNN-packed; streamed by our kernel): the same products, dense weights back exactly, the same
answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from models import weights
from models.basic import Linear
from models.kernels import native, onednn
from models.kernels.choice import choose
from models.mixture import GroupedExperts
from moe import MoEModel
from tests.checkpoints import TRAINED

pytestmark = pytest.mark.skipif(not onednn.can_pack(torch.zeros(1)), reason="torch built without oneDNN")
BF16 = onednn.can_pack(torch.zeros(1, dtype=torch.bfloat16))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16, reason="no bf16 instructions on this CPU"))])
@torch.inference_mode()
def test_packed_linear_matches_dense_and_unpacks_exactly(dtype):
    lin = Linear(64, 96)
    randomize(lin)
    lin.to(dtype)
    weight = lin.weight.detach().clone()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(rows, 64, generator=g).to(dtype) for rows in (1, 7, 130)]  # 130: padded to 144 rows
    dense = [F.linear(x, weight) for x in xs]
    lin.prepare_weights(choose("onednn", "cpu", dtype))
    packed = lin.kernel
    lin.prepare_weights(choose("onednn", "cpu", dtype))
    assert isinstance(packed, weights.OneDNN) and lin.kernel is packed  # converts once
    assert lin.weight.is_meta and lin.weight.shape == (96, 64) and lin.weight.dtype == dtype  # no memory left
    for x, want in zip(xs, dense, strict=True):
        got = lin(x)
        assert got.dtype == dtype
        # Products of 64 terms: fp32 agrees to rounding, bf16 to one bf16 step of the result.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(lin.state_dict()["weight"], weight)


def test_row_counts_are_rounded_to_few_sizes():
    buckets = [onednn.row_bucket(rows) for rows in range(1, 8193)]
    assert buckets[:16] == list(range(1, 17))  # decode batches run at their own size
    assert all(rows <= b <= rows * 1.125 for rows, b in enumerate(buckets, start=1))
    assert len(set(buckets)) == 16 + 8 * 9  # 8 sizes per power of two from 16 to 8192: bounded oneDNN shapes


@torch.inference_mode()
def test_packed_experts_match_and_save_dense_stacks():
    experts = GroupedExperts(64, 96, [3, 5, 6])
    randomize(experts, seed=1)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([2, 0, 5])  # the middle expert gets no row and does not run
    want = experts(x, counts)
    state = {k: v.clone() for k, v in experts.state_dict().items()}
    experts.prepare_weights(choose("onednn", "cpu", torch.float32))
    assert all(isinstance(w, weights.OneDNN) for pair in experts.kernels for w in pair)
    assert all(p.is_meta for p in experts.parameters())
    assert torch.allclose(experts(x, counts), want, rtol=1e-5, atol=1e-5)
    assert experts.state_dict().keys() == state.keys()
    assert all(torch.equal(experts.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("kernels", ["auto", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="the project's kernels did not build")), "onednn"])
def test_cpu_kernels_give_the_torch_answer_and_save_the_same_weights(tmp_path, kernels):
    prompts = [[1, 45, 312, 9, 77], [1, 8, 8]]
    ids = torch.tensor([[1, 45, 312, 9, 77, 1000, 3, 4]])
    plain = MoEModel.from_pretrained(TRAINED, cpu_kernels="torch")
    fast = MoEModel.from_pretrained(TRAINED, cpu_kernels=kernels)
    assert fast.info.cpu_kernels == kernels
    if kernels == "auto":
        assert MoEModel.from_pretrained(TRAINED).info.cpu_kernels == "auto"  # the default
    fmt = weights.Streamed if kernels in ("auto", "native") and native.available() else weights.OneDNN
    converted = [m for m in fast.engine.model.modules() if isinstance(m, Linear | GroupedExperts)]
    assert all(isinstance(m.kernel.whole if isinstance(m.kernel, weights.Part) else m.kernel, fmt)
               for m in converted if isinstance(m, Linear))
    assert all(isinstance(w, fmt) for m in converted if isinstance(m, GroupedExperts)
               for pair in m.kernels for w in pair)
    assert all(m.choice.native == (fmt is weights.Streamed) for m in converted if isinstance(m, GroupedExperts))
    assert (fast(ids) - plain(ids)).abs().max().item() < 1e-4
    assert fast.generate(prompts, max_new_tokens=24, ignore_eos=True) == plain.generate(
        prompts, max_new_tokens=24, ignore_eos=True)
    fast.save_pretrained(tmp_path / "out", max_shard_size=None)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    source = {k: v for f in sorted(TRAINED.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], source[k]) for k in source)


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="cpu_kernels='mkl': use one of auto, native, onednn, torch"):
        MoEModel.from_pretrained(TRAINED, cpu_kernels="mkl")


def test_loading_converts_each_unit_as_soon_as_it_is_read():
    """So only one block's original tensors are held besides the converted model (moe.checkpoint.loader)."""
    from models.transformer import Transformer
    from moe.checkpoint.formats import detect
    from moe.checkpoint.loader import load_into

    ckpt = detect(TRAINED)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    seen = []

    def on_unit(unit: torch.nn.Module) -> None:
        name = next(n for n, m in model.named_modules() if m is unit)
        assert not any(p.is_meta for p in unit.parameters()), name  # the unit is whole when it is handed over
        later = [p for n, p in model.named_parameters() if n.startswith("output.")]
        assert all(p.is_meta for p in later) or name == "output", name  # and the rest is not read yet
        seen.append(name)

    load_into(model, ckpt, TRAINED, shapes, torch.float32, "cpu", on_unit=on_unit)
    assert seen == ["tok_embeddings", *[f"layers.{i}" for i in range(ckpt.config.n_layers)], "norm", "output"]


@torch.inference_mode()
def test_bf16_attention_runs_in_fp32_where_the_cpu_has_no_bf16_instructions():
    """Where torch's bf16 attention takes its generic path, a bf16 block attends in fp32 (q, k and v widened
    exactly): the same answer as bf16 attention within its rounding, one rounding of the result."""
    from models.attention import Attention, AttentionContext, RotaryTable
    from models.config import ModelConfig

    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, n_experts=2, top_k=1,
                      vocab_size=32)
    attn = Attention(cfg)
    randomize(attn)
    attn.to(torch.bfloat16)
    attn.prepare_weights(choose("auto", "cpu", torch.bfloat16))
    assert attn.choice.attends_fp32 == (not onednn.native_bf16())
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    ctx = AttentionContext.build(cfg, RotaryTable(cfg), 2, 5, 0, None, x.device, torch.bfloat16)
    answers = {}
    for fp32 in (True, False):
        attn.choice = dataclasses.replace(attn.choice, native=False, bf16_instructions=not fp32)  # SDPA
        answers[fp32] = attn(x, ctx, None).float()
    assert torch.allclose(answers[True], answers[False], rtol=2**-6, atol=2**-6 * answers[False].abs().max().item())


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="the project's kernels did not build here")
def test_the_servers_cpu_kernels_reach_its_model():
    """--cpu-kernels native: bf16 prompts through the project's prompt kernel, also on a CPU with bf16 instructions
    (where "auto" takes oneDNN's), as the model's line on stderr says."""
    pytest.importorskip("uvicorn")
    from tests.servers import Server

    with Server(TRAINED, "--dtype", "bfloat16", "--cpu-kernels", "native", "--no-compile") as server:
        assert server.post("/v1/completions", {"prompt": "And", "max_tokens": 2}).status_code == 200
        assert server.stop() == 0
    assert "bfloat16 decode native matvec" in server.said and "prompts native gemm" in server.said
