"""The CPU kernels of our own: grouped matrix-vector products that read each weight once (`matvec.cpp`, decode
steps), grouped matrix products for prompts (`prompt_gemm.cpp`), a decode step's attention (`decode_attention.cpp`)
and, built with AVX-512, a prompt's (`prompt_attention.cpp`).

Why a kernel of our own: a decode step is bound by reading weights, and none of torch's CPU products streams them
at the memory's read rate for a few rows. Measured on a 2-core AMD EPYC (AVX2), one row against 40 distinct
weights, 2 threads, read bandwidth 16-23 GB/s that day: 3584 x 512 fp32 this kernel 19.0 GB/s, oneDNN packed
12.1, MKL (`F.linear`) 6.3, an inductor-compiled multiply-sum 12.5; bf16 16.3 against MKL's 10.6; int8 12.4
against torch's int8 kernel's 6.8 (git log docs/benchmarks.md). It also takes the experts of a block as one stacked
weight with per-expert row counts, read inside the kernel: no sort of weights, no loop over experts in Python, no
host read of the counts.

`grouped(x_ND, w_EOI, counts_E, scale_EO)`: y[n] = scale[e] * (w[e] @ x[n]) for the rows of expert e (rows
grouped, counts[e] of them; rows past the last group are zeros). With int8 weights each row of x is rounded to
int16 against its largest value and the products are summed exactly in integers (`matvec.cpp` says why).
`prompt_grouped(...)`, the same for many rows, at a matrix product's rate; with int8 weights the same bits per row
(2 threads on the AVX2 EPYC, 128 rows against 3584 x 512: int8 263 GFLOP/s, bf16 174, fp32 173, where oneDNN
gives 127-149; `prompt_gemm.cpp` has the figures).
`decode_attention(q, k, v, mask)`: SDPA of one query per sequence, in fp32, reading only the visible cache slots.
`prompt_attention(q, k, v, start)`: causal SDPA of a prompt (or its chunk from slot `start`), in fp32
(`prompt_attention_runs`).
A block's steps between its products, an op each where eager torch takes several (`block_glue.cpp`): `rms_norm`,
`rotary_into_cache`, `group_by_expert`, `combine`, `count_ids`, `silu_mul`, and `attend_one` (a decode step's
attention from its q/k/v product); an eager model runs them where `glue_runs`. A decode step's block in two ops
(`decode_block.cpp`): `models.kernels.decode_block`.
`set_prefetch(bf16, int8)`: how far ahead of its reads the decode kernel asks for weights, measured per machine and
model shape by `models.kernels.tuning`.
`available()` builds the kernels on first use (torch.utils.cpp_extension: a C++ compiler and ninja; 20-40 s,
once per torch installation, kept in torch's extension cache) and says whether it can run; without it the
weights fall back to oneDNN or torch's products.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from models.kernels import cpuinfo

# The decode kernel, the prompt kernel, the activation rounding both use for int8, the fp32 row product the decode
# kernel and the decode attention share, the prompt kernel's inner loops and its moves between rows and blocks, a
# decode step's attention, a prompt's, a block's steps between its products.
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("matvec.cpp", "prompt_gemm.cpp", "int8_rows.h", "row_dot.h", "pair_dot.h", "gemm_micro.h",
                        "gemm_layout.h", "decode_attention.cpp", "prompt_attention.cpp", "block_glue.h",
                        "block_glue.cpp", "router.cpp", "decode_block.cpp", "unity0.cpp", "unity1.cpp")]
# What the compiler is given: two units that include the .cpp files above (unity0.cpp says why), one per core.
UNITS = [p for p in SOURCES if p.name.startswith("unity")]
# Up to this many rows per weight the kernel runs (a decode step, small batches); more rows (prompts) are bound
# by arithmetic and go to the prompt kernel (or oneDNN, MKL where it does not run).
MAX_ROWS = 8
# A block's experts share the rows of a step: up to this many copies (a decode batch of 16 at top-2), or MAX_ROWS
# per local expert on average where that is more (`GroupedExperts.decode_rows`), they run the decode kernel in one
# grouped call. With up to 8 rows an expert it ran 1.4-3x faster than the prompt kernel, which widens every expert's
# weight first; at 16 rows bf16 1.2-1.5x, int8 0.5-0.95x (64 experts [384, 512] and [512, 192], 8 [3584, 512] and
# [512, 1792]; docs/kernels.md).
EXPERT_MAX_ROWS = 4 * MAX_ROWS
# -ffp-contract=off: the compiler never fuses a multiply and an add on its own, so each kernel rounds exactly where
# its code says, and the decode and prompt kernels, which sum in one order (row_dot.h: `dot_rows`; bf16 weights:
# pair_dot.h), agree bit for bit.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_why = ""  # why the kernel is unavailable, once `available()` said so


AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=256"]
# MOE_CPU_KERNELS=avx2 (or generic) builds for less than the CPU runs, as ATEN_CPU_CAPABILITY does for torch's:
# every build gives the same bits, so it is for comparing them, never needed for an answer.
FLAVOURS = ("generic", "avx2", "avx512")


@functools.cache
def _simd_flags() -> tuple[str, list[str]]:
    """Flags for what this CPU runs, named in the build's name so machines sharing a cache never mix builds. AVX-512
    reaches the prompt kernel's inner loops (`gemm_micro.h`, written for it) and, with VNNI, the decode kernel's
    int8 loop (`matvec.cpp: dot_int`); the compiler's own loops stay 256-bit (-mprefer-vector-width=256), so the
    other decode loops compile as in the AVX2 build (a 512-bit bf16 loop measured no faster; git log
    docs/benchmarks.md)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flavour = {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "generic")
    asked = os.environ.get("MOE_CPU_KERNELS", "").lower()
    if asked and asked not in FLAVOURS:
        raise ValueError(f"MOE_CPU_KERNELS={asked!r}: one of {', '.join(FLAVOURS)}")
    if asked and FLAVOURS.index(asked) < FLAVOURS.index(flavour):
        flavour = asked
    if flavour == "avx512":
        cpu = cpuinfo.flags()
        # bf16 weights' products through the CPU's bf16 dot product where it has one: the same bits (pair_dot.h)
        bf16 = ["-mavx512bf16"] if "avx512_bf16" in cpu else []
        if "avx512_vnni" in cpu:
            return "avx512vnni", [*AVX512, "-mavx512vnni", *bf16]
        return "avx512", [*AVX512, *bf16]
    return flavour, AVX2 if flavour == "avx2" else []


@functools.cache
def available() -> bool:
    """Build (once per torch installation) and load the kernel; False where it cannot be built (reason:
    `why_unavailable`)."""
    global _why
    if sys.platform != "linux":
        _why = f"not built on {sys.platform}"
        return False
    flags = _simd_flags()[1]  # a bad MOE_CPU_KERNELS is the user's error, raised, not a fallback
    library = built_library()
    name = library.stem
    try:
        if not _load_built(library):
            from torch.utils import cpp_extension

            print("building the CPU kernels (models/kernels/csrc: matvec.cpp, prompt_gemm.cpp, decode_attention.cpp, "
                  "prompt_attention.cpp, block_glue.cpp, router.cpp, decode_block.cpp), once per torch installation: "
                  "20-40 s",
                  file=sys.stderr)
            library.parent.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name=name, sources=[str(p) for p in UNITS],
                               build_directory=str(library.parent), is_python_module=False,
                               extra_cflags=[*CFLAGS, *flags], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the model still runs, on oneDNN/MKL
        _why = first_error(exc)
        return False
    _register_fake()
    return True


def _build_key() -> str:
    """The source, its flags and the torch install it builds against: a build's name, so that a build found under
    that name is up to date by construction."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES))
    key.update(" ".join(CFLAGS + _simd_flags()[1]).encode())
    key.update(f"{torch.__version__}:{Path(torch.__file__).parent}".encode())
    return key.hexdigest()[:12]


def built_library() -> Path:
    """Where this CPU's build of the kernels is (or goes): in torch's extension cache ($TORCH_EXTENSIONS_DIR, else
    torch_extensions in the user's cache folder), a folder of its own per build name."""
    name = f"moe_matvec_{_simd_flags()[0]}_{_build_key()}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return Path(root) / name / f"{name}.so"


def _load_built(library: Path) -> bool:
    """Load a build made earlier, without torch's build machinery: importing it and asking ninja whether the build
    is up to date cost 0.12 s a process here, and ninja rebuilt it (15 s, silently) whenever the ninja found first
    on PATH was another version than the one that built it. Its name says it is up to date (`_build_key`)."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # a build cut short (ninja would call it up to date): removed, so that the caller links it again
        library.unlink(missing_ok=True)
        return False
    return True


def first_error(exc: Exception) -> str:
    """The line of a failed build that says what went wrong: the compiler's first error (ninja's log holds every
    command and its output), else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("Error building extension", "FAILED:", "ninja:", "["))
            and not (" -c " in line and " -o " in line)]  # ninja's log echoes each command before its output
    errors = [line for line in said if "error" in line.lower() or "not found" in line.lower()]
    found = (errors or said or lines[-1:] or [""])[0]
    return f"{type(exc).__name__}: {found}"[:300]


def flavour() -> str:
    """This CPU's build of the kernels: "avx512vnni", "avx512", "avx2" or "generic" (`MOE_CPU_KERNELS` can ask for
    less)."""
    return _simd_flags()[0]


def prompts() -> bool:
    """Prompts run `prompt_grouped`: the kernels are built with AVX2 or AVX-512 (without, the prompt kernel is plain
    C++, slower than oneDNN)."""
    return available() and _simd_flags()[0] != "generic"


def prompt_attention_runs() -> bool:
    """A prompt's causal attention runs `prompt_attention`: the kernels are built with AVX-512 (elsewhere torch's
    SDPA, whose products are faster than a 256-bit kernel of ours would be)."""
    return available() and _simd_flags()[0].startswith("avx512")


def why_unavailable() -> str:
    return _why


def _register_fake() -> None:
    """Shapes for torch.compile: the op's output is [N, out] in the activations' dtype."""
    @torch.library.register_fake("moe_cpu::grouped_matvec")
    def _(x, w, counts, scale):
        return x.new_empty((*x.shape[:-1], w.shape[-2]))

    @torch.library.register_fake("moe_cpu::grouped_gemm")
    def _(x, w, counts, scale):
        return x.new_empty((x.shape[0], w.shape[1]))

    @torch.library.register_fake("moe_cpu::prompt_attention")
    def _(q, k, v, start=0):
        B, H, S, D = q.shape
        return q.new_empty((B, S, H, D)).transpose(1, 2)

    @torch.library.register_fake("moe_cpu::decode_attention")
    def _(q, k, v, mask):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


class _Ops:
    """The kernels' ops (their one overload each), found once: `torch.ops.moe_cpu.name` looks each up again at every
    call, 0.3 us of the 1.2-1.5 us that calling one from Python costs."""

    def __getattr__(self, name: str):
        op = getattr(torch.ops.moe_cpu, name).default
        setattr(self, name, op)
        return op


_ops = _Ops()


def takes(rows: int, limit: int = MAX_ROWS) -> bool:
    """A product of `rows` rows runs the kernel: up to `limit`, and any number inside a compiled step, where the
    other paths (oneDNN's opaque weights, a host read of the experts' counts) would break the graph."""
    return rows <= limit or torch.compiler.is_compiling()


def grouped(x_ND: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor | None = None,
            scale_EO: torch.Tensor | None = None) -> torch.Tensor:
    """[N, out] in x's dtype; `counts_E` may be None for one weight (E = 1) and all rows. One weight [out, in]
    (its scale [out]) takes rows [..., in] and gives [..., out]."""
    return _ops.grouped_matvec(x_ND, w_EOI, counts_E, scale_EO)


def decode_attention(q_BH1D: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor,
                     mask_B11L: torch.Tensor | None) -> torch.Tensor:
    """SDPA of one query per sequence (scale 1/sqrt(D), heads grouped over the key heads), in fp32, reading only
    the keys the mask lets through; [B, H, 1, D] in q's dtype (`decode_attention.cpp`)."""
    return _ops.decode_attention(q_BH1D, k_BGLD, v_BGLD, mask_B11L)


def prompt_grouped(x_ND: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor | None = None,
                   scale_EO: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped` for many rows (prompts); for int8 weights the same result, row for row, bit for bit."""
    return _ops.grouped_gemm(x_ND, w_EOI, counts_E, scale_EO)


def prompt_attention(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, start: int = 0
                     ) -> torch.Tensor:
    """Causal SDPA of a prompt's queries at slots start .. start + S - 1 over keys 0 .. start + S - 1 (no padding), in
    fp32, heads grouped over the key heads; [B, H, S, D] in q's dtype, a view of a [B, S, H, D] tensor
    (`prompt_attention.cpp`). A query's bits depend on its slot alone, not on `start`."""
    return _ops.prompt_attention(q_BHSD, k_BGSD, v_BGSD, start)


def glue_runs(native_kernels: bool) -> bool:
    """A block's glue runs the ops of `block_glue.cpp`: where the model's kernels are native (`KernelChoice.native`),
    outside a compiled step (inductor fuses torch's ops there, and a traced step takes no op it cannot see into)."""
    return native_kernels and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """RMSNorm of each row in fp32, the weight applied after the cast back (or before it: `weight_in_fp32`)."""
    return _ops.rms_norm(x, weight, eps, weight_in_fp32)


def rotary_into_cache(q_BSHD: torch.Tensor, k_BSGD: torch.Tensor, v_BSGD: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """q and k turned by RoPE (`apply_rotary`'s bits), k and v written into the caches [B, G, L, Dh] at slots
    start..start+S; the turned q [B, H, S, Dh]."""
    return _ops.rotary_into_cache(q_BSHD, k_BSGD, v_BSGD, cos, sin, k_cache, v_cache, start)


def group_by_expert(x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                    n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The copies grouped by expert as a stable sort of their ids groups them: (rows [N, D], copies per expert [E],
    token [N], router weight [N])."""
    return _ops.group_by_expert(x_TD, weights_TK, ids_TK, n_experts)


def combine(y_ND: torch.Tensor, weight_N: torch.Tensor, token_N: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[T, D]: each row weighted (rounded to y's dtype), a token's rows summed in fp32 in row order and rounded once
    (`weighted_sum`'s bits on CPU, where index_add_ sums reduced precision in fp32)."""
    return _ops.combine(y_ND, weight_N, token_N, n_tokens)


def count_ids(table: torch.Tensor, row: int, ids: torch.Tensor) -> None:
    """table[row, id] += 1 for each of `ids`."""
    _ops.count_ids(table, row, ids)


ROUTE_RENORMALISES = (1, 2, 3, 4, 8)  # top-k counts `route` renormalises with torch's bits (router.cpp: why)


@functools.cache
def route_runs() -> bool:
    """`route` computes the softmax with ATen's vector functions as this build compiles them: torch's own bits where
    the build's vectors are the ones torch runs, so not in a build for less (`MOE_CPU_KERNELS`), whose wider sums
    are added in another order."""
    torch_runs = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "generic")
    return available() and flavour().startswith(torch_runs)


def route(logits_TE: torch.Tensor, top_k: int, kind: int, renormalise: bool,
          round_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, ids [T, K]) of the router kinds "mixtral" (`kind` 0) and "softmax" (1), with the
    bits of the torch chain `Router.forward` runs for them (`router.cpp`)."""
    return _ops.route(logits_TE, top_k, kind, renormalise, round_bf16)


def silu_mul(h_NF2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h [N, 2F], gate columns first: `F.silu(gate).mul_(up)`'s bits (`torch_vector_width`)."""
    return _ops.silu_mul(h_NF2, torch_vector_width(h_NF2.dtype))


@functools.cache
def torch_vector_width(dtype: torch.dtype) -> int:
    """Values of `dtype` that torch's CPU elementwise loop takes at once, two of its vectors (64 bytes each with
    AVX-512, else 32): the last values of a row, past a multiple of it, go one by one."""
    return 2 * (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32) // dtype.itemsize


def attend_one(qkv_B1W: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
    """A decode step's attention from its q/k/v product [B, 1, (H + 2G) Dh]: per-head norms (where given),
    `rotary_into_cache` at `start`, `decode_attention` over slots 0..start; [B, 1, H Dh], the bits of those ops."""
    return _ops.attend_one(qkv_B1W, heads, kv_heads, q_norm, k_norm, eps, cos, sin, k_cache, v_cache,
                                        start, mask)

