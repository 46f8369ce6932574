"""The prompt kernel (models/kernels/csrc/prompt_gemm.cpp). int8: the same bits, row for row, as the decode kernel and
as a naive emulation of its integer sums; exact sums at any width; NaN and infinity propagate; a block's experts on a
prompt give each row what a decode step would. fp32 and bf16 weights: the decode kernel's bits too (both sum a row in
one order, models/kernels/csrc/row_dot.h), within rounding of float64, zeros past the groups."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from models import weights
from models.kernels import native
from models.kernels.choice import choose
from models.mixture import GroupedExperts
from tests.checkpoints import ROOT
from tests.test_matvec import naive_int8

pytestmark = pytest.mark.skipif(not native.prompts(), reason="the prompt kernel needs an AVX2 build")


@pytest.mark.parametrize("width", [512, 1792, 33, 7])  # one int32 pass, several (> 256 pairs), odd, short
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_int8_prompt_products_match_the_decode_kernel_bit_for_bit(width, x_dtype):
    g = torch.Generator().manual_seed(width)
    E, out, counts = 4, 101, [17, 0, 40, 13]  # 101: a short last panel and microkernel; expert 1 gets no rows
    n = sum(counts) + 3  # rows past the last group come out as zeros
    w = torch.randint(-127, 128, (E, out, width), generator=g, dtype=torch.int8)
    scale = torch.rand(E, out, generator=g) / 100
    x = (torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g) * 10).to(x_dtype)
    c = torch.tensor(counts)
    got = native.prompt_grouped(x, w, c, scale)
    assert got.dtype == x_dtype and got.shape == (n, out)
    assert torch.equal(got, native.grouped(x, w, c, scale))
    assert torch.equal(got.float(), naive_int8(x, w, counts, scale).to(x_dtype).float())
    assert got[-3:].eq(0).all()
    # A row alone gives the same bits as in its group.
    assert torch.equal(native.prompt_grouped(x[20:21], w[2:3], None, scale[2:3])[0], got[20])


@torch.inference_mode()
def test_int8_prompt_sums_cannot_overflow():
    """Every term at its largest over 40000 columns: the int32 lanes are widened 79 times, the sum stays exact."""
    width = 40000
    w = torch.full((1, 7, width), -127, dtype=torch.int8)
    x = torch.full((20, width), 3.0)
    assert native.prompt_grouped(x, w, None, torch.ones(1, 7)).eq(-127 * 3.0 * width).all()


@pytest.mark.parametrize("kernel", [native.grouped, native.prompt_grouped])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@torch.inference_mode()
def test_int8_rows_that_are_not_finite_propagate(kernel, bad):
    """A NaN or an infinity in a row must not round to a finite integer: the call computes in fp32."""
    w = torch.randint(-127, 128, (1, 5, 64), dtype=torch.int8)
    x = torch.randn(20, 64)
    x[1, 7] = bad
    got = kernel(x, w, None, torch.ones(1, 5))
    assert not got[1].isfinite().any()
    assert torch.allclose(got[0], w[0].float() @ x[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("dtype", "int8"), [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
@torch.inference_mode()
def test_a_prompt_through_the_experts_gives_each_row_its_decode_result(dtype, int8):
    torch.manual_seed(0)
    experts = GroupedExperts(64, 96, list(range(4)))
    for p in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(p, std=0.1)
    experts.to(dtype)
    weights.prepare(experts, choose("native", "cpu", dtype, int8))  # "auto" on a CPU with bf16 instructions: oneDNN
    assert experts.choice.native_prompts
    counts = torch.tensor([30, 0, 41, 9])
    x = torch.randn(80, 64).to(dtype)
    prompt = experts(x, counts)
    starts = [0, 30, 30, 71]
    for e, first in enumerate(starts):  # each row alone, as a decode step computes it
        for r in range(first, first + int(counts[e])):
            one = torch.zeros(4, dtype=torch.long)
            one[e] = 1
            assert torch.equal(experts(x[r:r + 1], one)[0], prompt[r])


@pytest.mark.parametrize(("dtype", "int8"), [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
@torch.inference_mode()
def test_a_batch_over_many_small_experts_runs_the_decode_kernel_with_the_prompt_kernels_bits(monkeypatch, dtype,
                                                                                            int8):
    """64 experts, a row each (a decode batch of 8 at top-8): the decode kernel, which reads each weight once, where
    the prompt kernel would first widen all 64 weights (5-13x slower, docs/kernels.md); 9 rows each (past 8 on
    average): the prompt kernel. A row gets the same bits either way."""
    torch.manual_seed(0)
    experts = GroupedExperts(64, 32, list(range(64)))
    for p in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(p, std=0.1)
    experts.to(dtype)
    weights.prepare(experts, choose("native", "cpu", dtype, int8))
    x = torch.randn(64 * 9, 64).to(dtype)
    assert experts.decode_rows == 64 * 8 and experts.streams(64 * 8) and not experts.streams(64 * 9)
    decode = native.grouped
    monkeypatch.setattr(native, "grouped", lambda *a: pytest.fail("the decode kernel ran"))
    wide = experts(x, torch.full((64,), 9))
    monkeypatch.setattr(native, "grouped", decode)
    monkeypatch.setattr(native, "prompt_grouped", lambda *a: pytest.fail("the prompt kernel ran"))
    firsts = torch.arange(64) * 9  # each expert's first row, alone in its group
    assert torch.equal(experts(x[firsts], torch.ones(64, dtype=torch.long)), wide[firsts])
    # Where bf16 prompts run oneDNN (AMX, AMD), whose bits differ, an expert's rows past 32 take them on any rank count
    experts.choice = dataclasses.replace(experts.choice, asked="auto", fast_bf16=True)
    assert experts.decode_rows == (native.EXPERT_MAX_ROWS if dtype == torch.bfloat16 and not int8 else 64 * 8)


@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_where_bf16_prompts_run_onednn_a_batch_over_many_experts_is_one_call_with_the_per_expert_bits(monkeypatch,
                                                                                                     bias):
    """AMX and AMD (`fast_bf16`): an expert's rows up to 32 take the decode kernel a call each; 64 experts with a few
    rows each run as one grouped call of it instead, the same bits as the calls one by one."""
    torch.manual_seed(1)
    experts = GroupedExperts(64, 32, list(range(64)), bias=bias)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    experts.to(torch.bfloat16)
    weights.prepare(experts, dataclasses.replace(choose("auto", "cpu", torch.bfloat16), fast_bf16=True))
    assert not experts.choice.native_prompts
    counts = torch.randint(0, 4, (64,))
    counts[5] = 32  # the most rows one expert's decode kernel takes
    x = torch.randn(int(counts.sum()), 64).to(torch.bfloat16)
    starts = [0, *counts.cumsum(0).tolist()]
    want = torch.cat([experts.one_expert(e, x[starts[e]:starts[e + 1]], None) for e in range(64) if counts[e]])
    with monkeypatch.context() as m:
        m.setattr(experts, "one_expert", lambda *a: pytest.fail("an expert ran alone"))
        assert torch.equal(experts(x, counts), want)
    counts[5] = 33  # past it: oneDNN's bits for that expert, so the experts run one by one
    x = torch.randn(int(counts.sum()), 64).to(torch.bfloat16)
    monkeypatch.setattr(experts, "streamed_forward", lambda *a: pytest.fail("one grouped call"))
    experts(x, counts)


# 512 and 1792: one pass per chain; 4100: three passes over the depth (2048 columns each) and a tail of 4; 33 and 7:
# a tail, and no chained columns at all.
@pytest.mark.parametrize("width", [512, 1792, 4100, 33, 7])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_float_prompt_products_match_the_decode_kernel_bit_for_bit(width, w_dtype):
    """Both kernels sum a row in one order (models/kernels/csrc/row_dot.h), so a row's result does not depend on its
    batch or on which kernel computes it: a prompt, its decode steps and the same rows on other ranks agree to the last
    bit."""
    g = torch.Generator().manual_seed(width)
    counts = [17, 0, 40, 13]
    w = torch.randn(4, 101, width, generator=g).to(w_dtype)
    x = torch.randn(sum(counts) + 3, width, generator=g).to(w_dtype)
    got = native.prompt_grouped(x, w, torch.tensor(counts))
    assert got.dtype == w_dtype and got[-3:].eq(0).all()
    assert torch.equal(got, native.grouped(x, w, torch.tensor(counts)))
    want = torch.cat([x[a:a + n].double() @ w[e].double().T
                      for e, (a, n) in enumerate(zip([0, 17, 17, 57], counts, strict=True))])
    tol = 2e-6 if w_dtype == torch.float32 else 8e-3  # fp32 sums; bf16: one rounding of the result
    assert ((got[:70].double() - want).abs().max() / want.abs().max()) < tol
    assert torch.equal(native.prompt_grouped(x[20:21], w[2:3])[0], got[20])  # alone, as in its group


@torch.inference_mode()
def test_bf16_outputs_are_rounded_as_torch_rounds_fp32():
    """Outputs are stored 8 at a time with a rounding of our own: it must give torch's bits (nearest, ties to even),
    overflow to infinity included, and a NaN must stay a NaN. Each row of x is 2 * a unit row, so each output is 2 *
    one chosen fp32 weight, exactly, before its rounding to bf16."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 48, 48, generator=g) * 1e3
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8)]) / 2  # halfway once doubled
    w[0, :4, 0], w[0, 4:7, 1] = ties, torch.tensor([3e38, -3e38, float("nan")])  # 2 * 3e38 overflows
    x = torch.zeros(64, 48, dtype=torch.bfloat16)
    x[torch.arange(64), torch.arange(64) % 48] = 2.0
    got = native.prompt_grouped(x, w)
    want = (x.float() @ w[0].T).bfloat16()
    assert want.isinf().any() and want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_prompt_products_refuse_a_scale_for_float_weights_and_need_one_for_int8():
    with pytest.raises(RuntimeError, match="int8 weights need a scale"):
        native.prompt_grouped(torch.zeros(2, 8), torch.zeros(1, 4, 8), None, torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="int8 weights need a scale"):
        native.prompt_grouped(torch.zeros(2, 8), torch.zeros(1, 4, 8, dtype=torch.int8))


OTHER_BUILD = """
import hashlib
import torch
from models.kernels import native
assert native.available(), native.why_unavailable()
print(native._simd_flags()[0])
g = torch.Generator().manual_seed(0)
ops = torch.ops.moe_cpu
c = torch.tensor([9, 0, 20])
for width in (512, 4100, 7):
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(3, 21, width, generator=g).to(dtype), torch.randn(30, width, generator=g).to(dtype)
        got = ops.grouped_gemm(x, w, c, None)
        assert torch.equal(got, ops.grouped_matvec(x, w, c, None)), (dtype, width)
        print(dtype, width, hashlib.sha256(got.float().numpy().tobytes()).hexdigest())
        if dtype == torch.bfloat16:  # products and sums below fp32's normal range: flushed as the bf16 instruction does
            tiny = (x.float() * 1e-19).bfloat16(), (w.float() * 1e-19).bfloat16()
            got = ops.grouped_gemm(*tiny, c, None)
            assert torch.equal(got, ops.grouped_matvec(*tiny, c, None)), ("tiny", width)
            print("tiny", width, hashlib.sha256(got.float().numpy().tobytes()).hexdigest())
    w, s = torch.randint(-127, 128, (3, 21, width), generator=g, dtype=torch.int8), torch.rand(3, 21, generator=g)
    got = ops.grouped_gemm(x, w, c, s)
    assert torch.equal(got, ops.grouped_matvec(x, w, c, s)), ("int8", width)
    print("int8", width, hashlib.sha256(got.float().numpy().tobytes()).hexdigest())
"""


def _build_run(flavour: str | None, tmp_path) -> tuple[list[str], str]:
    """(OTHER_BUILD's lines, its stderr) from `flavour`'s build in `tmp_path`, or from this CPU's own build (cached)
    if None."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_CPU_KERNELS"}
    if flavour is not None:
        env.update(TORCH_EXTENSIONS_DIR=str(tmp_path), MOE_CPU_KERNELS=flavour)
    done = subprocess.run([sys.executable, "-c", OTHER_BUILD], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines(), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["generic", "avx2"])
def test_every_build_gives_both_kernels_the_same_bits_as_this_one(flavour, tmp_path):
    """A build for less than this CPU runs (`MOE_CPU_KERNELS`; built in a process of its own) sums every row in
    dot_rows' order too: its prompt and decode kernels agree, and its int8 results are this build's. With AVX2 its
    fp32 and bf16 results are this build's too (AVX2 or AVX-512: 6 or 12 weight rows per inner loop, 8 or 16 lanes,
    the same multiply-adds per lane); without, two roundings per multiply-add (never fused by the compiler) give
    other fp32 bits. Its new extension cache is a new virtual environment's: one notice and a build, then a quiet
    load."""
    own = native._simd_flags()[0]
    if flavour == own:
        pytest.skip(f"this CPU's own build is {flavour}: the other tests run it")
    (other, built), (mine, _) = _build_run(flavour, tmp_path), _build_run(None, tmp_path)
    assert (other[0], mine[0]) == (flavour, own)
    same = [line for line in mine[1:] if flavour == "avx2" or line.startswith("int8")]
    assert len(same) >= 3 and set(same) <= set(other[1:])
    again, loaded = _build_run(flavour, tmp_path)
    assert "building the CPU kernels" in built and "building" not in loaded and again == other


def test_an_unknown_kernel_build_is_refused_in_one_line(monkeypatch):
    native._simd_flags.cache_clear()
    monkeypatch.setenv("MOE_CPU_KERNELS", "avx1024")
    try:
        with pytest.raises(ValueError, match="MOE_CPU_KERNELS='avx1024': one of generic, avx2, avx512"):
            native._simd_flags()
    finally:
        native._simd_flags.cache_clear()
