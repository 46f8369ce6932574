"""Which kernels a model runs: one decision, made once at load from the device, the weights' precision, what the
caller asked for (`cpu_kernels`) and what this machine has. The linear weights, the attention, `model.info`, the
line on stderr and the ranks' agreement check all read this one object; nothing else decides.

- `native`: the project's C++ kernels (`models.kernels.native`): "auto" on a CPU whose build flavour they were
  measured on (x86 with AVX2, AVX-512, AVX-512 VNNI), where they built. Elsewhere (aarch64, x86 without AVX2, no
  compiler) "auto" takes oneDNN where it runs the dtype, else torch's own products: `why_not_native` says why.
- Decode rows (up to `native.MAX_ROWS` per weight) and prompts take different products (`product`); a decode
  step's attention and a prompt's too (`attention`).
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

from models.kernels import native, onednn

KERNELS = ("auto", "native", "onednn", "torch")  # choices for MoEModel.from_pretrained(cpu_kernels=...)
NATIVE_ASKS = ("auto", "native")  # the choices that run the project's kernels where they build
MEASURED_FLAVOURS = ("avx2", "avx512", "avx512vnni")  # builds whose speed and bits the project has measured
# Up to this many rows an int8 product without our kernels runs torch's weight-only kernel (`_weight_int8pack_mm`,
# CPU and CUDA), which reads the int8 weight as it is: no weight-sized temporary per decode step. On a GPU every
# row count does (a bf16 copy of each weight per call would cost its reads twice); on a CPU many rows are bound by
# arithmetic, where x q^T in bf16 (int8 values are exact in bf16), then the fp32 scales, is 3.5x faster.
INT8_KERNEL_MAX_ROWS = 4

# Names of the products and attentions (what `model.info.kernels` and the stderr line show).
NATIVE_DECODE, NATIVE_PROMPT = "native matvec", "native gemm"
ONEDNN, WIDENED, TORCH = "oneDNN", "fp32-widened", "torch"
INT8_KERNEL, INT8_DEQUANTIZED = "torch int8 kernel", "bf16 of int8"
NATIVE_ATTENTION, NATIVE_PROMPT_ATTENTION = "native one-query", "native causal"
SDPA, SDPA_FP32 = "SDPA", "SDPA in fp32"
# What every help text and docstring says of `cpu_kernels`, made from the names above (tests/test_kernel_choice.py
# checks that it names what `choose` runs).
CPU_KERNELS_HELP = (f"on CPU: auto (default) runs the project's kernels where they built for a measured flavour "
                    f"({', '.join(MEASURED_FLAVOURS)}): decode rows through \"{NATIVE_DECODE}\", prompts through "
                    f"\"{NATIVE_PROMPT}\" (bf16 where AMX or AMD's bf16 instructions run: \"{ONEDNN}\", faster, "
                    f"whose bits depend on a product's row count), else \"{ONEDNN}\" or torch's products; native: the "
                    f"project's kernels for every product, a row's bits its own whatever the batch (refused where "
                    f"they did not build); onednn packs every weight for oneDNN; torch: plain torch products. "
                    f"model.info.kernels and a line on stderr say what runs")


@dataclass(frozen=True)
class KernelChoice:
    device: str  # "cpu" or "cuda"
    dtype: str  # the weights' precision: "float32", "bfloat16", "float16" or "int8"
    asked: str  # cpu_kernels: "auto", "native", "onednn" or "torch"
    flavour: str  # the native build's flavour on this CPU ("avx512vnni", ...), "" where none was asked or built
    native: bool  # the native kernels run this model's products and attention
    bf16_instructions: bool  # the CPU runs bf16 products natively (oneDNN does bf16 there)
    fast_bf16: bool  # oneDNN's bf16 products outrun the native prompt kernel here (`onednn.fast_bf16`)
    onednn: bool  # oneDNN runs this dtype's products on this CPU (packed weights with "onednn")
    why_not_native: str  # "" where `native`, else the reason ("cpu_kernels='torch'", the build's error, the CPU)

    @property
    def int8(self) -> bool:
        return self.dtype == "int8"

    @property
    def activations(self) -> str:
        """The activations' precision (int8 weights: bf16 activations)."""
        return "bfloat16" if self.int8 else self.dtype

    @property
    def native_prompts(self) -> bool:
        """Prompts run the native prompt kernel: int8 and fp32, and bf16 where oneDNN's bf16 products are no faster
        (no AMX, not AMD's AVX-512 BF16) or `native` was asked. Where they are faster, a row's bits depend on how
        many rows its product has: oneDNN's blocking changes with the row count."""
        return self.native and (self.dtype != "bfloat16" or not self.fast_bf16 or self.asked == "native")

    @property
    def prompts_apart(self) -> bool:
        """Prompts that join a running batch are best prefilled a call each: decode steps give a row the same bits
        whatever the batch (the native decode kernel) but prompts do not (oneDNN's bf16 products), so a prompt is
        answered as alone only where its products have the rows they have alone."""
        return self.native and not self.native_prompts

    @property
    def attends_fp32(self) -> bool:
        """bf16 attention through SDPA in fp32: torch's bf16 SDPA takes a generic path on a CPU without bf16
        instructions, 3x slower than with the casts (a decode step of `small`, 256 slots, an AVX2 EPYC)."""
        return self.device == "cpu" and self.activations == "bfloat16" and not self.bf16_instructions

    def product(self, rows: int, limit: int = native.MAX_ROWS) -> str:
        """Which product runs `rows` rows against one linear weight (`limit`: the weight's decode-row limit)."""
        if self.native and native.takes(rows, limit):
            return NATIVE_DECODE
        if self.native_prompts:
            return NATIVE_PROMPT
        if self.int8:
            if self.device != "cpu" or rows <= INT8_KERNEL_MAX_ROWS:
                return INT8_KERNEL
            return WIDENED if not self.bf16_instructions else INT8_DEQUANTIZED
        if self.device != "cpu" or self.asked == "torch":
            return TORCH  # F.linear on plain weights
        if self.onednn:
            return ONEDNN  # packed weights ("onednn"), or plain ones where the native kernels run decode rows only
        # bf16 on a CPU without bf16 instructions: torch's bf16 products take a generic path there, 5-7x slower
        # than widening both operands to fp32 first
        return WIDENED if self.dtype == "bfloat16" else TORCH

    def attention(self, decoding: bool, causal_from_slot0: bool, head_dim: int) -> str:
        """Which attention runs a step: one query per sequence (`decoding`), or a prompt."""
        if self.native:
            if decoding:
                return NATIVE_ATTENTION
            if causal_from_slot0 and native.prompt_attention_runs() and head_dim % 16 == 0:
                return NATIVE_PROMPT_ATTENTION
        return SDPA_FP32 if self.attends_fp32 else SDPA

    def describe(self) -> str:
        """One line: where the products and attention run, for a decode step and for a prompt."""
        if self.device != "cpu":
            return f"{self.device} kernels: {self.dtype} decode {self.product(1)}, prompts {self.product(64)}"
        native_part = f"native {self.flavour}" if self.native else f"no native kernels ({self.why_not_native})"
        return (f"cpu kernels: {native_part}; {self.dtype} decode {self.product(1)}, attention "
                f"{self.attention(True, False, 16)}; prompts {self.product(64)}, attention "
                f"{self.attention(False, True, 16)}")

    def settings(self) -> dict:
        """What must be the same on every rank, where ranks depend on computing the same bits."""
        return asdict(self) | {"torch": torch.__version__, "machine": platform.machine()}


def choose(asked: str, device: str | torch.device, dtype: torch.dtype, int8: bool = False) -> KernelChoice:
    """The kernels for weights of `dtype` (int8: quantized from `dtype`, activations bf16) on `device`."""
    if asked not in KERNELS:
        raise ValueError(f"cpu_kernels={asked!r}: use one of {', '.join(KERNELS)}")
    device = torch.device(device).type
    name = "int8" if int8 else str(dtype).removeprefix("torch.")
    if device != "cpu":
        return KernelChoice(device, name, asked, "", False, False, False, False, f"{device}: torch's kernels")
    bf16 = onednn.native_bf16()
    packs = onednn.can_pack(torch.empty(0, dtype=dtype)) and not int8
    flavour, why = "", ""
    if asked not in NATIVE_ASKS:
        why = f"cpu_kernels={asked!r}"
    elif dtype not in (torch.float32, torch.bfloat16):
        why = f"{name} weights"
    elif not native.available():
        why = f"not built: {native.why_unavailable()}"
    else:
        flavour = native.flavour()
        if flavour not in MEASURED_FLAVOURS:
            why = f"a {flavour} build ({platform.machine()}), whose speed the project has not measured"
    if why and asked == "native":
        raise ValueError(f"cpu_kernels='native': the project's kernels do not run here ({why})")
    return KernelChoice(device, name, asked, flavour, not why, bf16, onednn.fast_bf16(), packs, why)
