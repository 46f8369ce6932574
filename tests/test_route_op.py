"""The router's choice in one op (models/kernels/csrc/router.cpp) against the torch chains `Router.forward` runs
without it: the same weights and experts, bit for bit, ties included; an eager model on native kernels runs it."""

from __future__ import annotations

import pytest
import torch

from models.kernels import native
from models.mixture import MoEFeedForward
from models.router import Router
from moe import MoEModel
from moe.bench.speed import decode_step_ops
from tests.test_block_glue import decode_logits, family_checkpoint

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernel not built: {native.why_unavailable()}")


def torch_chain(logits: torch.Tensor, top_k: int, kind: str, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    router = Router(logits.shape[1], logits.shape[1], top_k, kind, renormalise)
    router.weight = torch.nn.Parameter(torch.eye(logits.shape[1], dtype=logits.dtype))  # the gate passes x through
    return router.eval()(logits)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8), (60, 4), (128, 8), (3, 1), (16, 3), (16, 15)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,renormalise", [("mixtral", True), ("softmax", True), ("softmax", False)])
@torch.inference_mode()
def test_gives_the_torch_chains_bits(experts, top_k, dtype, kind, renormalise):
    g = torch.Generator().manual_seed(experts * top_k)
    for tokens, spread in ((1, 3.0), (7, 0.3), (300, 2.0)):  # 300: more than one thread's rows
        logits = (torch.randn(tokens, experts, generator=g) * spread).to(dtype)
        for x in (logits, logits.round()):  # rounded: many ties, which topk breaks its own way
            if kind == "softmax" and renormalise and top_k not in native.ROUTE_RENORMALISES:
                with pytest.raises(RuntimeError, match="renormalises 1-4 or 8 weights"):
                    native.route(x, top_k, 1, True, False)
                continue
            want_w, want_ids = torch_chain(x, top_k, kind, renormalise)
            got_w, got_ids = native.route(x, top_k, 0 if kind == "mixtral" else 1, renormalise,
                                          dtype == torch.bfloat16)
            assert torch.equal(got_ids, want_ids)
            assert got_w.dtype == torch.float32 and torch.equal(got_w, want_w)


def test_refuses_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="top_k <= E"):
        native.route(torch.randn(2, 4), 5, 0, True, False)
    with pytest.raises(RuntimeError, match="kind 0 or 1"):
        native.route(torch.randn(2, 4), 2, 2, True, False)


def test_a_build_for_less_than_torch_runs_keeps_the_chain(monkeypatch):
    """Built for AVX2 (`MOE_CPU_KERNELS=avx2`) where torch runs its AVX-512 kernels, the op's softmax would add its
    sums in 8 lanes where torch adds them in 16: the chain's bits only come from the chain then."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(native, "flavour", lambda: "avx2")
    assert not native.route_runs.__wrapped__()  # uncached: the answer of this process stays as it is
    monkeypatch.setattr(native, "flavour", lambda: "avx512vnni")
    assert native.route_runs.__wrapped__()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])  # the two kinds: top-k of logits, of probabilities
def test_an_eager_model_routes_in_one_op_with_the_chains_bits(name, dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(MoEFeedForward, "in_one_op", lambda *args: False)  # the op on its own, not in the experts'
    with MoEModel.from_pretrained(family_checkpoint(name, tmp_path), dtype=dtype, compile=False) as model:
        ops = decode_step_ops(model.engine)
        blocks = model.config.n_layers - len(model.config.dense_layers)
        assert ops["moe_cpu.route"] == blocks and not ops["aten.topk"]
        fused = decode_logits(model)
        monkeypatch.setattr(Router, "routes_natively", lambda *args: False)
        assert not decode_step_ops(model.engine)["moe_cpu.route"]
        for one_op, chain in zip(fused, decode_logits(model), strict=True):
            assert torch.equal(one_op, chain)
