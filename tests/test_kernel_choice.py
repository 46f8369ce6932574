"""The one decision of which product and attention run (`models.kernels.choice`), as a table of cases written out
by hand: CPUs with and without the native kernels or bf16 instructions, every precision, GPUs (whose paths never
ran here: these cases fix what a GPU runs without one)."""

from __future__ import annotations

import pytest
import torch

from models.experts import grouped_mm_runs
from models.kernels import choice as kc
from models.kernels.choice import KernelChoice, choose


def cpu(dtype: str = "float32", native: bool = True, bf16: bool = True, asked: str = "auto",
        fast_bf16: bool | None = None) -> KernelChoice:
    """`fast_bf16` (oneDNN's bf16 outruns fp32 multiply-adds: AMX, AMD) defaults to `bf16`."""
    onednn = dtype == "float32" or (dtype == "bfloat16" and bf16)
    why = "" if native else "not built: no compiler"
    fast = bf16 if fast_bf16 is None else fast_bf16
    return KernelChoice("cpu", dtype, asked, "avx512" if native else "", native, bf16, fast, onednn, why)


GPU = KernelChoice("cuda", "bfloat16", "auto", "", False, False, False, False, "cuda: torch's kernels")
GPU_INT8 = KernelChoice("cuda", "int8", "auto", "", False, False, False, False, "cuda: torch's kernels")

CASES = [  # (choice, rows, the product)
    (cpu(), 1, kc.NATIVE_DECODE), (cpu(), 8, kc.NATIVE_DECODE), (cpu(), 9, kc.NATIVE_PROMPT),
    (cpu("bfloat16"), 64, kc.ONEDNN),  # AMX or AMD's bf16 instructions: oneDNN's bf16 beats the prompt kernel
    (cpu("bfloat16", fast_bf16=False), 64, kc.NATIVE_PROMPT),  # Intel's AVX-512 BF16 alone: level, so ours
    (cpu("bfloat16", asked="native"), 64, kc.NATIVE_PROMPT),  # ... but a row's bits depend on the row count there
    (cpu("bfloat16", bf16=False), 64, kc.NATIVE_PROMPT),
    (cpu("int8"), 1, kc.NATIVE_DECODE), (cpu("int8"), 64, kc.NATIVE_PROMPT),
    (cpu(native=False), 1, kc.ONEDNN), (cpu("bfloat16", native=False, bf16=False), 64, kc.WIDENED),
    (cpu("int8", native=False), 4, kc.INT8_KERNEL), (cpu("int8", native=False), 5, kc.INT8_DEQUANTIZED),
    (cpu("int8", native=False, bf16=False), 5, kc.WIDENED),
    (cpu(native=False, asked="torch"), 1, kc.TORCH), (cpu("bfloat16", False, False, "torch"), 64, kc.TORCH),
    (GPU, 1, kc.TORCH), (GPU, 512, kc.TORCH),
    (GPU_INT8, 1, kc.INT8_KERNEL), (GPU_INT8, 512, kc.INT8_KERNEL),  # never a bf16 copy of a weight per call
]


@pytest.mark.parametrize(("choice", "rows", "product"), CASES)
def test_each_case_runs_its_product(choice, rows, product):
    assert choice.product(rows) == product


APART = [  # (choice, whether the server prefills joining prompts a call each)
    (cpu("bfloat16"), True),  # decode rows the native kernel's, prompts oneDNN's: a prompt's bits follow its batch
    (cpu("bfloat16", fast_bf16=False), False), (cpu("bfloat16", asked="native"), False), (cpu(), False),
    (cpu("int8"), False),  # every product the native kernels', whatever the row count
    (cpu(native=False), False), (cpu(native=False, asked="torch"), False),  # decode steps too follow their batch
    (GPU, False), (GPU_INT8, False),
]


@pytest.mark.parametrize(("choice", "apart"), APART)
def test_joining_prompts_are_prefilled_apart_only_where_that_alone_keeps_a_request_its_own(choice, apart):
    assert choice.prompts_apart == apart


def test_attention_by_case():
    assert cpu().attention(True, False, 16) == kc.NATIVE_ATTENTION
    assert cpu().attention(False, False, 16) == kc.SDPA  # a padded batch or a continued prompt
    assert cpu("bfloat16", bf16=False).attention(False, False, 16) == kc.SDPA_FP32
    assert cpu(native=False).attention(True, False, 16) == kc.SDPA
    assert GPU.attention(True, False, 128) == kc.SDPA


def test_auto_takes_the_native_kernels_only_where_they_were_measured(monkeypatch):
    from models.kernels import native

    monkeypatch.setattr(native, "available", lambda: True)
    for flavour, runs in (("avx512vnni", True), ("avx512", True), ("avx2", True), ("generic", False)):
        monkeypatch.setattr(native, "flavour", lambda f=flavour: f)
        got = choose("auto", "cpu", torch.float32)
        assert got.native == runs, flavour
        assert runs or "a generic build" in got.why_not_native
    assert not choose("torch", "cpu", torch.float32).native
    assert choose("auto", "cpu", torch.float16).why_not_native == "float16 weights"
    with pytest.raises(ValueError, match="cpu_kernels='fast': use one of auto, native, onednn, torch"):
        choose("fast", "cpu", torch.float32)


def test_native_is_refused_where_the_kernels_do_not_run(monkeypatch):
    """Asked for, the project's kernels never fall back to others: the bits they promise would not hold."""
    from models.kernels import native

    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "why_unavailable", lambda: "no compiler")
    with pytest.raises(ValueError, match=r"^cpu_kernels='native': the project's kernels do not run here \(not built: "
                                         r"no compiler\)$"):
        choose("native", "cpu", torch.float32)
    assert not choose("auto", "cpu", torch.float32).native  # auto takes oneDNN or torch's products instead


def test_grouped_experts_on_a_gpu_only_where_torch_has_the_grouped_product():
    assert not grouped_mm_runs(torch.zeros(2, 4, 4, dtype=torch.bfloat16))  # on a CPU: the per-expert loop


def test_the_help_texts_name_what_the_choice_runs():
    """Every command's --cpu-kernels help is the choice's own text, and the kernels it names for "auto" are the
    ones `choose` picks on this machine (a help that named a path no longer taken would fail here)."""
    import re

    from models.kernels import choice as kc
    from moe.cli import generate, serve

    names = {kc.NATIVE_DECODE, kc.NATIVE_PROMPT, kc.ONEDNN}
    assert set(re.findall(r'"([^"]+)"', kc.CPU_KERNELS_HELP)) == names
    for command in (generate, serve):
        flag = next(a for a in command.parser()._actions if "--cpu-kernels" in a.option_strings)
        assert flag.help == kc.CPU_KERNELS_HELP and tuple(flag.choices) == kc.KERNELS
    for dtype in (torch.float32, torch.bfloat16):
        picked = kc.choose("auto", "cpu", dtype)
        if picked.native:
            assert picked.product(1) == kc.NATIVE_DECODE
            assert picked.product(64) == (kc.ONEDNN if dtype == torch.bfloat16 and picked.fast_bf16
                                          else kc.NATIVE_PROMPT)


@pytest.mark.parametrize(("bf16", "amx", "vendor", "fast"), [
    (True, True, "GenuineIntel", True), (True, False, "GenuineIntel", False), (True, False, "AuthenticAMD", True),
    (False, False, "AuthenticAMD", False), (False, False, "GenuineIntel", False)])
def test_onednn_takes_bf16_prompts_only_where_its_bf16_products_were_measured_faster(monkeypatch, bf16, amx, vendor,
                                                                                    fast):
    """AMX (3-9x the prompt kernel) and AMD's AVX-512 BF16 (bf16 prefill 1.8x fp32 on a Zen 4 and a Zen 5): oneDNN.
    Intel's AVX-512 BF16 without AMX: level with the prompt kernel (docs/kernels.md), so the kernel and its bits."""
    from models.kernels import cpuinfo, onednn

    monkeypatch.setattr(onednn, "native_bf16", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(cpuinfo, "fields", lambda: {"vendor_id": vendor})
    assert onednn.fast_bf16.__wrapped__() == fast
