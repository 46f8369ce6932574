"""A prompt's causal attention kernel (models/kernels/csrc/prompt_attention.cpp, AVX-512 builds): torch's causal SDPA
within fp32 rounding (bf16: one rounding of the result), for grouped heads, prompts that are not a multiple of its tiles
or chunks, strided inputs as the model passes them, and a prompt's later chunks (the one call's bits); and the
model's prompts run it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models import weights
from models.attention import Attention, AttentionContext, RotaryTable
from models.config import ModelConfig
from models.kernels import native
from models.kernels.choice import NATIVE_PROMPT_ATTENTION, choose

pytestmark = pytest.mark.skipif(not native.prompt_attention_runs(), reason="the prompt attention needs AVX-512")


def causal_reference(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)


# (B, H, G, S, D): the bench model's block; batch 2, no grouping, a short tile; one prompt shorter than a tile;
# several chunks of 64 keys and a partial last tile; one key head for all.
SHAPES = [(1, 8, 2, 512, 64), (2, 4, 4, 37, 16), (1, 8, 2, 5, 128), (1, 4, 1, 300, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_prompt_attention_is_causal_sdpa(shape, dtype):
    B, H, G, S, D = shape
    g = torch.Generator().manual_seed(S)
    # As the model passes them: q a view of [B, S, H, D], k a view of a longer cache, v contiguous.
    q = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, G, S + 9, D, generator=g).to(dtype)[:, :, :S]
    v = torch.randn(B, G, S, D, generator=g).to(dtype)
    got = native.prompt_attention(q, k, v)
    want = causal_reference(q, k, v)
    assert got.dtype == dtype and got.shape == (B, H, S, D)
    assert got.transpose(1, 2).is_contiguous()  # the model's reshape to [B, S, H * D] is a view
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    else:  # the fp32 result rounded once to bf16: within one bf16 step of the exact value
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)


@torch.inference_mode()
def test_a_query_sees_the_same_keys_whatever_follows_it():
    """Chunks of keys start at 0 whatever the prompt's length, so a prompt's first 100 queries give the same bits
    as the 100-token prompt alone."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    whole = native.prompt_attention(q, k, v)
    head = native.prompt_attention(q[:, :, :100], k[:, :, :100], v[:, :, :100])
    assert torch.equal(whole[:, :, :100], head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_later_chunk_is_causal_sdpa_and_gives_the_one_calls_bits(dtype):
    """Queries from slot `start` over the keys before and at them (a prompt's later chunk, its earlier keys cached):
    the bottom-right causal SDPA, and the very bits of those queries in the one call of the whole prompt, for
    chunks of one query, within a tile, across tiles and chunks of keys."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 300, 64, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    whole = native.prompt_attention(q, k, v)
    for cuts in [(0, 100, 300), (0, 17, 18, 130, 299, 300), (0, 1, 2, 64, 65, 300)]:
        parts = [native.prompt_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], a)
                 for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(parts, dim=2), whole), cuts
    start = 130
    mask = torch.ones(300 - start, 300, dtype=torch.bool).tril(start)
    want = F.scaled_dot_product_attention(q[:, :, start:].double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=True)
    got = native.prompt_attention(q[:, :, start:], k, v, start).double()
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)


def test_prompt_attention_refuses_what_it_does_not_compute():
    q, k = torch.zeros(1, 6, 8, 64), torch.zeros(1, 4, 8, 64)
    with pytest.raises(RuntimeError, match=r"q \[B, H, S, D\], k and v \[B, G, start \+ S, D\]"):
        native.prompt_attention(q, k, k)  # 4 key heads do not divide 6 query heads
    with pytest.raises(RuntimeError, match="start 2"):
        native.prompt_attention(q[:, :4], k, k, 2)  # 8 keys for 8 queries from slot 2
    with pytest.raises(RuntimeError, match="all fp32 or all bf16"):
        native.prompt_attention(q.bfloat16(), k[:, :2], k[:, :2])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.prompt_attention(q[..., :24], k[:, :2, :, :24], k[:, :2, :, :24])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_prompt_through_an_attention_block_runs_the_kernel(dtype, monkeypatch):
    cfg = ModelConfig(dim=128, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=32,
                      n_experts=2, top_k=1)
    torch.manual_seed(0)
    block = Attention(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    block.to(dtype)
    weights.prepare(block, choose("auto", "cpu", dtype))
    assert block.choice.attention(False, True, cfg.head_dim) == NATIVE_PROMPT_ATTENTION
    x = torch.randn(1, 70, cfg.dim).to(dtype)
    ctx = AttentionContext.build(cfg, RotaryTable(cfg), 1, 70, 0, None, x.device, dtype)
    assert ctx.is_causal
    calls = []
    kernel = native.prompt_attention
    monkeypatch.setattr(native, "prompt_attention", lambda *a: calls.append(1) or kernel(*a))
    got = block(x, ctx, None)
    block.choice = dataclasses.replace(block.choice, native=False)  # torch's SDPA
    want = block(x, ctx, None)
    assert calls == [1]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
