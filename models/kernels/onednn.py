"""Linear products on CPU through oneDNN, with weights reordered once at load ("packed").

torch's `F.linear` on CPU calls MKL, which on AMD CPUs takes a generic code path: measured on an AMD EPYC with
AVX-512, fp32 products of 128 rows run at ~100 GFLOP/s per core and bf16 matrix-vector products read weights at
~12 GB/s. oneDNN, with each weight reordered once into its blocked layout, reaches ~240 GFLOP/s per core in
fp32 and ~26 GB/s in bf16 matrix-vector products, and spreads even one-row products over all threads.

A packed weight is an opaque oneDNN tensor of the same size as the dense one; `unpack` gives the dense weight
back exactly. Only inference packs: these ops have no autograd.

oneDNN keeps a primitive, with its own scratch memory (~0.6 MB here), for every shape it has run, so a row
count that changes with every prompt and every expert would grow memory without end (measured: 800 row
counts through one weight, twice, +2.5 GB). Row counts above 16 are therefore rounded up to one of eight
sizes per power of two (at most 12.5% more rows, zeros, whose results are dropped).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from models.kernels import cpuinfo


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN runs this weight's dtype on this CPU (fp32; bf16 where the CPU has bf16 instructions)."""
    mkldnn = torch.backends.mkldnn
    if weight.device.type != "cpu" or weight.is_meta or not (mkldnn.is_available() and mkldnn.enabled):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def native_bf16() -> bool:
    """The CPU has bf16 instructions (oneDNN runs bf16 products on it)."""
    mkldnn = torch.backends.mkldnn
    return mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def fast_bf16() -> bool:
    """oneDNN's bf16 products outrun fp32 multiply-adds here: AMX tiles, or AMD's AVX-512 BF16 (a Zen 4 and a Zen 5
    prefilled bf16 1.8x faster than fp32). Intel's AVX-512 BF16 without AMX (a Xeon whose hypervisor hides its AMX)
    runs a bf16 dot product at the fp32 multiply-adds' rate: oneDNN's bf16 products were level with the native
    prompt kernel there (docs/kernels.md)."""
    tiles = getattr(torch.cpu, "_is_amx_tile_supported", None)  # the OS's permission too; older torch: the flag
    amx = tiles() if tiles else "amx_tile" in cpuinfo.flags()
    return native_bf16() and (amx or cpuinfo.fields().get("vendor_id") == "AuthenticAMD")


def widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32, for bf16 or int8 weights of many rows on a CPU without bf16 instructions: there torch's
    bf16 products take a generic path, 5-7x slower than widening both to fp32 first (measured on an AVX2 EPYC,
    128 and 512 rows against 3584 x 512 and 512 x 1792, the widening included). Exact products, fp32 sums."""
    w = weight.float()
    return linear(x.float(), w) if can_pack(w) else F.linear(x.float(), w)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> oneDNN's layout for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with a packed weight; x [..., in] of the weight's dtype."""
    rows = x.numel() // x.shape[-1]
    padded_rows = row_bucket(rows)
    if padded_rows == rows:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    padded = x.new_zeros((padded_rows, x.shape[-1]))
    padded[:rows] = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(padded, packed, None, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def row_bucket(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per power of two above 16 (16, 18, 20, ..., 32, 36, ..., 64, 72)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 2^(floor(log2 rows) - 3)
    return -(-rows // step) * step


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return packed.to_dense()
