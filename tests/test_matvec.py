"""The streaming CPU kernel (models/kernels/csrc/matvec.cpp) against a naive loop: every weight and activation dtype,
grouped rows, rows past the groups, a row's result independent of its batch, and the experts' grouped decode path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from models.kernels import native
from models.kernels.choice import choose
from models.mixture import GroupedExperts
from tests.checkpoints import ROOT, TRAINED

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernel not built: {native.why_unavailable()}")


def naive(x, w, counts, scale):
    """y[n] = scale[e] * w[e] @ x[n] for the rows of group e, in fp32; zeros past the groups."""
    y = torch.zeros(x.shape[0], w.shape[1])
    n = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            y[n] = w[e].float() @ x[n].float() * (scale[e] if scale is not None else 1)
            n += 1
    return y


def int16_rows(x):
    """The kernel's rounding of activation rows for int8 weights: x ~ sx * q with |q| <= 32767, q an integer."""
    x = x.float()
    top = x.abs().amax(dim=1, keepdim=True)
    inv = torch.full_like(top, 32767) / top  # as the kernel divides (`32767 / top` is 32767 * (1 / top) in torch)
    q = torch.where(top > 0, torch.round(x * inv), 0).clamp(-32767, 32767)
    return q, top / 32767


def naive_int8(x, w, counts, scale):
    """What the kernel computes for int8 weights: the exact integer dot of w and the rounded rows, times the row's
    scale (in double, rounded to fp32), times the weight row's scale (fp32)."""
    q, sx = int16_rows(x)
    y = torch.zeros(x.shape[0], w.shape[1])
    n = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            exact = w[e].double() @ q[n].double()  # integers below 2^53: exact
            y[n] = (exact * sx[n].double()).float() * scale[e]
            n += 1
    return y


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [512, 100, 31])  # whole 32-lane blocks, a tail, only a tail
@torch.inference_mode()
def test_grouped_products_match_a_naive_loop(w_dtype, x_dtype, width):
    g = torch.Generator().manual_seed(width)
    shape, N = (3, 37, width), 7  # 3 weights of 37 rows
    w = torch.randn(shape, generator=g) if w_dtype != torch.int8 else torch.randint(-127, 128, shape, generator=g)
    w = w.to(w_dtype)
    x = torch.randn(N, width, generator=g).to(x_dtype)
    counts = [2, 0, 4]  # the middle weight gets no row; the 7th row belongs to no group
    scale = torch.rand(shape[:2], generator=g) if w_dtype == torch.int8 else None
    got = native.grouped(x, w, torch.tensor(counts), scale)
    assert got.dtype == x_dtype and got.shape == (N, shape[1])
    if w_dtype == torch.int8:  # integer sums: exactly the emulated result, rounded once to the output dtype
        assert torch.equal(got, naive_int8(x, w, counts, scale).to(x_dtype))
    want = naive(x, w, counts, scale)
    tol = 1e-5 if x_dtype == torch.float32 else 8e-3  # fp32 sums in another order; bf16: one rounding of the result
    if w_dtype == torch.int8:  # the activations' rounding to int16: at most max|x| / 65534 per element
        bound = (w.float().abs() * scale[..., None]).sum(-1).amax() * x.float().abs().amax() / 65534
        assert (got.float() - want).abs().max() <= bound + tol * want.abs().max()
    else:
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert got[6].eq(0).all()
    # One row alone gives the same bits as in its group and batch.
    alone = native.grouped(x[3:4], w[2:3], None, scale[2:3] if scale is not None else None)
    assert torch.equal(alone[0], got[3])


def pair_order(x_NI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """bf16 weights' documented order (models/kernels/csrc/pair_dot.h), one rounded fp32 add at a time: 16 chains over
    the column pairs below the last multiple of 32, column 2p + 1 before 2p; the chains added (i, i + 8), (i, i + 4),
    (i, i + 2), (0, 1); the remaining columns in order. A bf16 x bf16 product is exact in fp32, so a product then an
    add rounds as a fused multiply-add does."""
    x, w = x_NI.float()[:, None, :], w_OI.float()[None, :, :]  # [N, 1, I], [1, O, I]
    body = x.shape[-1] // 32 * 32
    c = torch.zeros(x.shape[0], w.shape[1], 16)
    for b in range(0, body, 32):
        odd, even = slice(b + 1, b + 32, 2), slice(b, b + 32, 2)
        c = c + x[..., odd] * w[..., odd]
        c = c + x[..., even] * w[..., even]
    c = c[..., :8] + c[..., 8:]
    c = c[..., :4] + c[..., 4:]
    s = (c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3])
    for k in range(body, x.shape[-1]):
        s = s + x[..., k] * w[..., k]
    return s


def cancelling(g: torch.Generator, out: int, width: int) -> torch.Tensor:
    """bf16 weight rows whose large values (2^20 .. 2^25) come in pairs that cancel exactly, among normal ones: against
    rows of ones and twos the result is the small terms', and the roundings of the large ones, which depend on the
    order of the sum, show even once the result is rounded to bf16."""
    w = torch.randn(out, width, generator=g)
    for o in range(out):
        cols = torch.randperm(width, generator=g)[:width // 4 * 2].view(2, -1)
        sign = torch.randn(cols.shape[1], generator=g).sign()
        big = 2.0 ** torch.randint(20, 26, (cols.shape[1],), generator=g) * sign
        w[o, cols[0]], w[o, cols[1]] = big, -big
    return w.bfloat16()


@pytest.mark.parametrize("width", [512, 100, 31])  # whole 32-column blocks, a tail, only a tail
@pytest.mark.parametrize("kernel", [native.grouped, native.prompt_grouped])
@torch.inference_mode()
def test_bf16_weights_sum_in_the_pair_order_to_the_last_bit(width, kernel):
    """The order both kernels document for bf16 weights, emulated one add at a time: the same bits, whether the CPU's
    bf16 dot-product instruction (bf16 rows, where the CPU has it) or fp32 multiply-adds (fp32 rows, or no such CPU)
    computed them. fp32 rows give fp32 results, which show any other order; bf16 rows against cancelling weights
    (`cancelling`) do too (checked: the sums of torch's product differ); bf16 rows that differ show a row read in
    the place of another on the instruction's path, where the rows of ones and twos cannot."""
    if kernel is native.prompt_grouped and not native.prompts():
        pytest.skip("the prompt kernel needs an AVX2 build")
    g = torch.Generator().manual_seed(width)
    counts = torch.tensor([12, 8])
    x = (torch.randn(20, width, generator=g) * 10.0 ** torch.randint(-3, 4, (20, width), generator=g)).bfloat16()
    w = (torch.randn(2, 45, width, generator=g) * 10.0 ** torch.randint(-3, 4, (2, 45, width), generator=g)).bfloat16()
    ones = torch.ones(20, width).bfloat16()
    ones[12:] = 2
    w_cancelling = torch.stack([cancelling(g, 45, width) for _ in range(2)])
    for rows, weights in ((x.float(), w), (ones, w_cancelling), (x, w)):  # (x, w): bf16 rows that differ
        want = torch.cat([pair_order(rows[:12], weights[0]), pair_order(rows[12:], weights[1])]).to(rows.dtype)
        assert torch.equal(kernel(rows, weights, counts), want)
        if width >= 32 and rows is not x:  # whole blocks: an order of their own, which these inputs tell from torch's
            torch_order = [part.float() @ w_e.float().T for part, w_e in zip(rows.split([12, 8]), weights, strict=True)]
            assert not torch.equal(want, torch.cat(torch_order).to(rows.dtype))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_no_rows_give_an_empty_result(w_dtype, x_dtype):
    """A rank whose experts got no token copies still calls the kernel, with no rows."""
    w = torch.ones(2, 3, 64).to(w_dtype)
    scale = torch.ones(2, 3) if w_dtype == torch.int8 else None
    got = native.grouped(torch.empty(0, 64, dtype=x_dtype), w, torch.zeros(2, dtype=torch.long), scale)
    assert got.shape == (0, 3) and got.dtype == x_dtype


@torch.inference_mode()
def test_int8_sums_cannot_overflow():
    """Rows long enough for the int32 lanes to be widened twice, every term at its largest: the exact sum, for rows
    read 4 at once (rows 0, 3, 6 and 9 of 10, one thread) and one at a time (the rest)."""
    width = 40000
    w = torch.full((1, 10, width), -127, dtype=torch.int8)
    x = torch.full((1, width), 3.0)
    got = native.grouped(x, w, None, torch.ones(1, 10))
    assert got.eq(-127 * 3.0 * width).all()


@torch.inference_mode()
def test_int8_rows_that_are_not_finite_take_the_fp32_path():
    w = torch.randint(-127, 128, (1, 5, 64), dtype=torch.int8)
    x = torch.randn(2, 64)
    x[1, 7] = float("inf")
    got = native.grouped(x, w, None, torch.ones(1, 5))
    assert torch.allclose(got[0], w[0].float() @ x[0], rtol=1e-5, atol=1e-4) and not got[1].isfinite().any()


def test_counts_that_exceed_the_rows_are_refused():
    with pytest.raises(RuntimeError, match="counts exceed the rows"):
        native.grouped(torch.zeros(2, 8), torch.zeros(2, 4, 8), torch.tensor([2, 1]))


@pytest.mark.parametrize("int8", [False, True])
@torch.inference_mode()
def test_streamed_experts_match_the_per_expert_path(int8):
    torch.manual_seed(0)
    experts = GroupedExperts(64, 96, [3, 5, 6])
    for p in experts.parameters():
        p.data.normal_(0, 0.2)
    if int8:
        experts.to(torch.bfloat16)
    experts.prepare_weights(choose("auto", "cpu", torch.bfloat16 if int8 else torch.float32, int8))
    assert experts.choice.native and (experts.scales is not None) == int8
    x = torch.randn(7, 64).to(experts.stacks[1].dtype if not int8 else torch.bfloat16)
    counts = torch.tensor([2, 0, 4])
    grouped = experts(x, counts)  # 7 rows <= MAX_ROWS: one grouped call per weight
    per_expert = torch.cat([weights_pair_swiglu(experts, e, x[a:b]) for e, (a, b) in ((0, (0, 2)), (2, (2, 6)))])
    assert torch.equal(grouped[:6], per_expert)  # the same kernel per row, so the same bits
    assert grouped[6].eq(0).all()


def weights_pair_swiglu(experts, e, x):
    w13, w2 = experts.kernels[e]
    return w2(experts.glu.halves(w13(x)))


@torch.inference_mode()
def test_the_op_compiles_in_a_full_graph():
    w = torch.randn(2, 16, 64)
    x = torch.randn(3, 64)
    counts = torch.tensor([1, 2])
    step = torch.compile(lambda x: torch.relu(native.grouped(x, w, counts)) * 2, fullgraph=True)
    assert torch.equal(step(x), torch.relu(native.grouped(x, w, counts)) * 2)


NO_COMPILER = """
import sys
from moe import MoEModel
model = MoEModel.from_pretrained(sys.argv[1])
print(type(model.engine.model.output.kernel).__name__)
print(model.info.kernels)
print(model.generate([[1, 45, 312]], max_new_tokens=16))
"""


@pytest.mark.slow
def test_without_a_compiler_auto_falls_back_naming_the_build_error(tmp_path):
    """For real, in a process of its own: a compiler that does not exist and an empty extension cache (a new
    virtual environment on a machine without one). The build's error is named, oneDNN runs, the tokens are those
    of the native kernels."""
    from moe import MoEModel

    want = MoEModel.from_pretrained(TRAINED).generate([[1, 45, 312]], max_new_tokens=16)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    run = subprocess.run([sys.executable, "-c", NO_COMPILER, str(TRAINED)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    kernel, kernels, tokens = run.stdout.splitlines()
    assert kernel == "OneDNN" and tokens == str([want[0]])
    why = kernels.split(";")[0]
    assert why.startswith("cpu kernels: no native kernels (not built: RuntimeError: "), kernels
    assert "no-such-c++" in why and "Error building extension" not in why, why  # the shell's line, not ninja's
    assert "float32 decode oneDNN" in kernels
    assert kernels in run.stderr.splitlines()  # said on stderr too, once
