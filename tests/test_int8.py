"""The int8 weight-only mode: per-channel quantization, its products, and what it does to the trained model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import weights
from moe import MoEModel
from moe.evaluation import score_text
from tests.checkpoints import TRAINED
from tests.test_trained_model import HELD_OUT

PROMPTS = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome, clever,"]  # N ranks = 1



def test_quantization_is_per_output_channel_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different scales
    q, scale = weights.quantize(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().amax(dim=1).eq(127).all()  # every row uses its full range
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-12).all()


def activation_rounding(int8: weights.Int8, x: torch.Tensor) -> torch.Tensor:
    """[rows, out] bound on what the streaming kernel's rounding of each activation row to int16 can change: every
    element moves by at most max|x row| / 65534 (models/kernels/csrc/matvec.cpp)."""
    return x.float().abs().amax(dim=1, keepdim=True) / 65534 * (int8.q.float().abs() * int8.scale32[:, None]).sum(1)


@pytest.mark.parametrize("rows", [1, 3, 9, 130])  # the streaming kernel (<= 8 rows) and the dequantizing path
@torch.inference_mode()
def test_int8_products_match_the_dequantized_weight(rows):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    int8 = weights.Int8.of(w)
    want = F.linear(x.float(), int8.q.float() * int8.scale32[:, None])  # the exact dequantized product
    got = int8(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # The kernel sums x*q exactly after rounding x to int16; the many-row path sums in fp32 and rounds twice (the
    # product, then the scaled result): within one bf16 step of each output, plus the kernel's rounding of x.
    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + activation_rounding(int8, x) + 1e-6).all()


@torch.inference_mode()
def test_an_int8_row_gets_the_same_result_whatever_rows_share_its_product():
    """A batch split over ranks (replicated attention) runs its rows through the other path: results agree to
    one bf16 rounding step (the kernel rounds once, the many-row product twice) and the kernel's rounding of x."""
    g = torch.Generator().manual_seed(3)
    int8 = weights.Int8.of(torch.randn(256, 128, generator=g).bfloat16())
    x = torch.randn(40, 128, generator=g).bfloat16()
    alone = torch.cat([int8(x[i:i + 1]) for i in range(40)]).float()  # the streaming kernel, one row at a time
    together = int8(x).float()  # 40 rows at once: the fp32 path
    assert ((together - alone).abs() <= alone.abs() * 2**-7 + activation_rounding(int8, x) + 1e-6).all()


@pytest.fixture(scope="module")
def bf16_and_int8():
    with MoEModel.from_pretrained(TRAINED, dtype="bfloat16") as bf16, MoEModel.from_pretrained(TRAINED,
                                                                                               dtype="int8") as int8:
        yield bf16, int8


def test_int8_bits_per_byte_within_one_percent_of_bf16(bf16_and_int8):
    bf16, int8 = bf16_and_int8
    assert int8.info.dtype == "int8"
    scores = [score_text(m, [HELD_OUT * 4], m.tokenizer, seq_len=128) for m in (bf16, int8)]
    bpb16, bpb8 = (s.bits_per_byte for s in scores)
    assert abs(bpb8 - bpb16) / bpb16 < 0.01, (bpb16, bpb8)


def test_int8_greedy_choices_and_logits_follow_the_float_model(bf16_and_int8):
    bf16, int8 = bf16_and_int8
    with MoEModel.from_pretrained(TRAINED) as fp32:  # the checkpoint's own precision
        assert_choices_follow(fp32, int8)
    assert_logits_follow_bf16(bf16, int8)


def assert_choices_follow(reference: MoEModel, model: MoEModel, positions: int = 256) -> None:
    """The greedy choice (argmax) at each of `positions` positions of held-out text, teacher-forced: the same as
    `reference`'s at >= 95% of them (measured: 96.9% for int8 against fp32, 8 of 256 differ), and different only
    where `reference`'s two best logits lie within 0.5 of each other (measured: at most 0.38), a near tie that
    any rounding decides. Greedy generation follows whichever way such a tie falls, so whole generated texts are
    no measure: a text equal up to its first near tie is all that one can ask."""
    ids = torch.tensor([model.tokenizer.encode(HELD_OUT * 4)[:positions]])
    want, got = reference(ids).float()[0], model(ids).float()[0]
    same = want.argmax(-1) == got.argmax(-1)
    best2 = want.topk(2, dim=-1).values
    margins = (best2[:, 0] - best2[:, 1])[~same]
    assert same.float().mean().item() >= 0.95, same.float().mean().item()
    assert (margins < 0.5).all(), margins


def assert_logits_follow_bf16(bf16: MoEModel, int8: MoEModel) -> None:
    """Logits of this model span about +-15; int8 weights move a position's logits by 0.19 (median of the largest
    change; bf16 against fp32: 0.09), more where a token's choice of experts flips (here 4 positions of 64)."""
    ids = torch.tensor([int8.tokenizer.encode(HELD_OUT)[:64]])
    a, b = bf16(ids).float(), int8(ids).float()
    err = (a - b).abs().amax(-1)[0]
    assert err.median().item() < 0.3 and (err < 0.5).float().mean().item() > 0.9, err
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.95


def test_int8_through_torchs_weight_only_kernel_follows_our_kernels(bf16_and_int8):
    """`cpu_kernels="torch"` runs every int8 product as a GPU does: torch's weight-only kernel
    (`_weight_int8pack_mm`, reading the int8 weight as it is) for decode rows, the dequantized product for
    prompts. Its greedy choices follow the fp32 model's as ours do (measured: 98% of 256 positions), and its
    logits follow bf16's as closely."""
    bf16, ours = bf16_and_int8
    with MoEModel.from_pretrained(TRAINED, dtype="int8", cpu_kernels="torch") as torchs, \
            MoEModel.from_pretrained(TRAINED) as fp32:
        assert not any(w.stream for w in linear_weights(torchs)) and all(w.stream for w in linear_weights(ours))
        assert_choices_follow(fp32, torchs)
        assert_logits_follow_bf16(bf16, torchs)


def linear_weights(model: MoEModel) -> list[weights.LinearWeight]:
    """Every linear weight of a 1-rank model in its inference format (parts of fused weights as their whole)."""
    found = []
    for module in model.engine.model.modules():
        for w in [getattr(module, "kernel", None), getattr(module, "wqkv", None),
                  *[x for pair in (getattr(module, "kernels", None) or []) for x in pair]]:
            w = w.whole if isinstance(w, weights.Part) else w
            if isinstance(w, weights.LinearWeight):
                found.append(w)
    return found


def test_int8_weights_take_about_half_the_memory_of_bf16(bf16_and_int8):
    def linear_bytes(model: MoEModel) -> int:
        """Bytes of the storages behind every linear weight (experts' weights are views of stacked ones)."""
        held = {}
        for w in linear_weights(model):
            if isinstance(w, weights.Int8):
                tensors = [w.q, w.scale, w.scale32]
            elif isinstance(w, weights.Streamed | weights.Dense):
                tensors = [w.weight]
            else:
                tensors = [w.packed]
            for t in tensors:
                storage = t.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
        return sum(held.values())

    bf16, int8 = bf16_and_int8
    ratio = linear_bytes(int8) / linear_bytes(bf16)
    assert 0.45 < ratio < 0.55, ratio


def test_int8_on_two_ranks_matches_one(bf16_and_int8):
    _, one = bf16_and_int8
    ids = torch.tensor([one.tokenizer.encode(HELD_OUT)[:48]])
    with MoEModel.from_pretrained(TRAINED, dtype="int8", gpus=2) as two:
        assert two.info.dtype == "int8"
        assert two.generate(PROMPTS, max_new_tokens=32) == one.generate(PROMPTS, max_new_tokens=32)
        assert (two(ids).float() - one(ids).float()).abs().max().item() < 0.1  # bf16 activations: sums' order


@pytest.mark.multiprocess
def test_int8_on_ranks_that_hold_none_of_a_blocks_experts(bf16_and_int8):
    """Each block whole on one rank (experts split over a group of one): the other rank quantizes no expert of it."""
    _, one = bf16_and_int8
    n = one.config.n_layers
    plan = {"world_size": 2, "embed_rank": 0, "head_rank": 1,
            "blocks": [{"attention": "layer", "ranks": [r], "experts": "tensor", "groups": [[r]]}
                       for r in (0,) * (n // 2) + (1,) * (n - n // 2)]}
    with MoEModel.from_pretrained(TRAINED, dtype="int8", gpus=2, placement=plan) as two:
        assert two.generate(PROMPTS, max_new_tokens=16) == one.generate(PROMPTS, max_new_tokens=16)


def test_int8_models_refuse_to_save_and_stay_usable(bf16_and_int8, tmp_path):
    _, int8 = bf16_and_int8
    with pytest.raises(ValueError, match="int8 model cannot be saved"):
        int8.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert int8.generate(PROMPTS[:1], max_new_tokens=4)


def test_int8_is_refused_for_training():
    from moe.engine.build import build_model

    with pytest.raises(ValueError, match="inference only"):
        build_model(TRAINED, "int8")
