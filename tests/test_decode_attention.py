"""A decode step's attention (models/kernels/csrc/decode_attention.cpp): torch's SDPA for one query, in fp32, reading
only the keys the mask lets through; the same greedy tokens as SDPA on the trained model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.kernels import native
from models.kernels.choice import NATIVE_ATTENTION
from moe import MoEModel
from tests.checkpoints import TRAINED
from tests.test_int8 import PROMPTS

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels could not be built")


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("shape", [(1, 8, 2, 256), (3, 8, 2, 37), (2, 4, 4, 7), (2, 6, 1, 100)])  # B, H, G, L
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40, 128])  # the vector loops' widths (32 and 16 columns) and their tails
@torch.inference_mode()
def test_matches_sdpa_with_and_without_a_mask(shape, dtype, dim):
    B, H, G, L = shape
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, n, length, dim, generator=g).to(dtype) for n, length in ((H, 1), (G, L), (G, L)))
    mask = torch.rand(B, 1, 1, L, generator=g) < 0.5
    mask[..., -1] = True  # the step's own slot: always visible
    for m in (None, mask, mask[:1].expand(B, -1, -1, -1)):  # per sequence, none, one for all (stride 0)
        got = native.decode_attention(q, k, v, m)
        assert got.dtype == dtype and got.shape == q.shape
        want = sdpa(q, k, v, m)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # fp32 sums in another order; bf16: the output's rounding
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


@torch.inference_mode()
def test_reads_a_cache_through_its_strides():
    """The eager decode path passes the filled part of the cache: a view with the cache's strides."""
    cache_k, cache_v = torch.randn(2, 2, 64, 32), torch.randn(2, 2, 64, 32)
    k, v = cache_k[:, :, :20], cache_v[:, :, :20]  # the batch and head strides of a 64-slot cache
    assert not k.is_contiguous()
    q = torch.randn(2, 4, 1, 32)
    assert torch.allclose(native.decode_attention(q, k, v, None), sdpa(q, k, v, None), atol=1e-6)


@torch.inference_mode()
def test_hidden_keys_are_never_read():
    """Slots past the step hold an earlier request's keys (or anything): they must not matter, not even a NaN."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    mask[..., :6] = True
    k[:, :, 6:], v[:, :, 6:] = float("nan"), float("inf")
    got = native.decode_attention(q, k, v, mask)
    assert got.isfinite().all()
    assert torch.allclose(got, sdpa(q, k[:, :, :6], v[:, :, :6], None), atol=1e-6)
    mask[:] = False  # no visible key: NaN, as SDPA gives
    assert native.decode_attention(q, k, v, mask).isnan().all()


def test_bad_shapes_are_refused_in_one_line():
    q, k = torch.randn(1, 6, 1, 16), torch.randn(1, 4, 5, 16)
    with pytest.raises(RuntimeError, match="G dividing H"):
        native.decode_attention(q, k, k, None)
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        native.decode_attention(torch.randn(1, 4, 1, 16), k, k.bfloat16(), None)
    with pytest.raises(RuntimeError, match=r"mask \[B or 1, 1, 1, L\]"):
        native.decode_attention(torch.randn(1, 4, 1, 16), k, k, torch.ones(1, 1, 1, 4, dtype=torch.bool))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_those_of_sdpa(dtype):
    with MoEModel.from_pretrained(TRAINED, dtype=dtype) as model:
        blocks = [block.attention for block in model.engine.model.layers.values()]
        assert all(attention.choice.attention(True, False, 16) == NATIVE_ATTENTION for attention in blocks)
        ours = model.generate(PROMPTS, max_new_tokens=32)
        for attention in blocks:
            attention.choice = dataclasses.replace(attention.choice, native=False)  # torch's SDPA
        assert model.generate(PROMPTS, max_new_tokens=32) == ours


def test_only_with_our_kernels():
    """cpu_kernels="torch" (or "onednn") asks for torch's own kernels: the attention stays torch's SDPA."""
    with MoEModel.from_pretrained(TRAINED, cpu_kernels="torch") as model:
        assert not any(block.attention.choice.attention(True, False, 16) == NATIVE_ATTENTION
                       for block in model.engine.model.layers.values())
