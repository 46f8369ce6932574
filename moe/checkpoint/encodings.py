"""How checkpoints store tensors other than as our parameters, and how each is read as one.

- Experts stacked in one 3-D tensor per block (GraniteMoE, transformers 5's fused layout, gpt-oss). A name map entry
  `base#e` reads row e of `base`; `base#e:k/n` its k-th of n equal parts (contiguous: read as bytes, and a slice of
  it too); `base#e:k%n` every n-th row from row k (gpt-oss interleaves gate and up rows); a last `:T` transposes
  the row first (transformers keeps gpt-oss's experts as [in, out]).
- MXFP4, gpt-oss's experts as shipped: `X_blocks` [E, R, G, 16] uint8 (two FP4 values a byte, low nibble first)
  and `X_scales` [E, R, G] uint8 (E8M0: a power of two, bias 127) stand for `X` [E, R, 32G], decoded as
  transformers' `integrations/mxfp4.py` decodes them.
- FP8 with block scales, DeepSeek-V3's linear weights as shipped: `X.weight` float8_e4m3fn times its
  `X.weight_scale_inv` block's scale (128 x 128 blocks), as transformers' `integrations/finegrained_fp8.py`.

A read takes only what the rank holds: one expert, and of a tensor-parallel slice only its rows (or the stored
columns, or MXFP4 blocks, that hold its columns), decoded one expert at a time into the loading dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.config import ModelConfig
from moe.checkpoint.files import CheckpointError, TensorInfo
from moe.checkpoint.formats import name_map

MXFP4_BLOCK = 32  # values per E8M0 scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
Span = tuple[int, int]
ReadRanges = Callable[[TensorInfo, list[tuple[int, int]], torch.Tensor], None]  # (tensor, byte ranges, into)


def sub_info(info: TensorInfo, index: int, shape: tuple[int, ...]) -> TensorInfo:
    """Row `index` of a tensor whose rows have `shape`, as a tensor of its own."""
    n = info.nbytes // info.shape[0]
    return dataclasses.replace(info, shape=shape, offset=info.offset + index * n, nbytes=n)


def box_ranges(info: TensorInfo, rows: Span, cols: Span | None) -> list[tuple[int, int]]:
    """(offset, bytes) of rows r0..r1 of a tensor (a row: all its other dims; of a 1-D one, an element), and of only
    columns c0..c1 of them where `cols` is given (a 2-D tensor: one range per row)."""
    item = info.nbytes // max(1, math.prod(info.shape))
    width = math.prod(info.shape[1:])
    (r0, r1), (c0, c1) = rows, cols or (0, width)
    if c0 == 0 and c1 == width:
        return [(info.offset + r0 * width * item, (r1 - r0) * width * item)]
    return [(info.offset + (r * width + c0) * item, (c1 - c0) * item) for r in range(r0, r1)]


@dataclass(frozen=True)
class Plain:
    """A stored 3-D (or 2-D, biases) tensor whose row e is expert e's [A, B] (or [A])."""

    info: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape[1:]

    def box(self, read: ReadRanges, e: int, rows: Span, cols: Span | None) -> torch.Tensor:
        if self.info.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.info.file.name}: an expert tensor has unsupported dtype {self.info.dtype}")
        expert = sub_info(self.info, e, self.shape)
        shape = (rows[1] - rows[0], *((cols[1] - cols[0],) if cols else self.shape[1:]))
        out = torch.empty(shape, dtype=SAFETENSORS_DTYPES[self.info.dtype])
        read(expert, box_ranges(expert, rows, cols), out)
        return out


@dataclass(frozen=True)
class Mxfp4:
    """`blocks` [E, R, G, 16] and `scales` [E, R, G]: expert e's [R, 32G] values."""

    blocks: TensorInfo
    scales: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.scales.shape[1], self.scales.shape[2] * MXFP4_BLOCK

    def box(self, read: ReadRanges, e: int, rows: Span, cols: Span | None) -> torch.Tensor:
        R, G = self.scales.shape[1:]
        c0, c1 = cols or (0, G * MXFP4_BLOCK)
        g0, g1 = c0 // MXFP4_BLOCK, -(-c1 // MXFP4_BLOCK)  # the blocks that hold columns c0..c1
        half = MXFP4_BLOCK // 2
        blocks = sub_info(dataclasses.replace(self.blocks, shape=(self.blocks.shape[0], R, G * half)), e, (R, G * half))
        scales = sub_info(self.scales, e, (R, G))
        packed = torch.empty(rows[1] - rows[0], (g1 - g0) * half, dtype=torch.uint8)
        exps = torch.empty(rows[1] - rows[0], g1 - g0, dtype=torch.uint8)
        read(blocks, box_ranges(blocks, rows, (g0 * half, g1 * half)), packed)
        read(scales, box_ranges(scales, rows, (g0, g1)), exps)
        return decode_mxfp4(packed, exps)[:, c0 - g0 * MXFP4_BLOCK:c1 - g0 * MXFP4_BLOCK]


@dataclass(frozen=True)
class Fp8:
    """`weight` [R, C] float8_e4m3fn and `scales` [ceil(R/b), ceil(C/b)] fp32 (`weight_scale_inv`): one scale per b x b
    block, as DeepSeek-V3 ships its linear weights. A single tensor: `e` is ignored."""

    weight: TensorInfo
    scales: TensorInfo
    block: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def box(self, read: ReadRanges, e: int, rows: Span, cols: Span | None) -> torch.Tensor:
        (r0, r1), (c0, c1), b = rows, cols or (0, self.weight.shape[1]), self.block
        raw = torch.empty(r1 - r0, c1 - c0, dtype=torch.uint8)
        read(self.weight, box_ranges(self.weight, rows, (c0, c1)), raw)
        (s0, s1), (t0, t1) = (r0 // b, -(-r1 // b)), (c0 // b, -(-c1 // b))  # the blocks that hold the box
        scales = torch.empty(s1 - s0, t1 - t0)
        read(self.scales, box_ranges(self.scales, (s0, s1), (t0, t1)), scales)
        scales = scales.repeat_interleave(b, 0)[r0 - s0 * b:r1 - s0 * b]
        return raw.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(b, 1)[:, c0 - t0 * b:c1 - t0 * b]


def decode_mxfp4(packed: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """[rows, G*16] uint8 blocks and [rows, G] uint8 scales -> [rows, 32G] fp32 values (exactly: an FP4 value times
    a power of two, so casting to bf16 gives transformers' bf16 decode bit for bit). One lookup per byte gives both
    of its values (low nibble first)."""
    values = _byte_values()[packed.int()].view(packed.shape[0], exps.shape[1], MXFP4_BLOCK)
    return (values * torch.exp2(exps.float() - 127)[..., None]).view(packed.shape[0], -1)


@functools.cache
def _byte_values() -> torch.Tensor:
    """[256, 2]: the two FP4 values of each byte, low nibble first."""
    table = torch.tensor(FP4_VALUES)
    return torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=1)


def encode_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 32G] -> (blocks [rows, G, 16] uint8, scales [rows, G] uint8), each group of 32 scaled by the power of
    two that brings its largest magnitude to at most 6 and rounded to the nearest FP4 value (`decode_mxfp4`'s
    inverse on values it gives). For checkpoints built the way gpt-oss ships its experts."""
    groups = values.float().reshape(values.shape[0], -1, MXFP4_BLOCK)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exps = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exps)[..., None]
    table = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # the nearest value (+0 before -0)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)), (exps + 127).to(torch.uint8)


@dataclass(frozen=True)
class Derived(TensorInfo):
    """Expert `expert`'s tensor of a stacked `source`, computed at read time: rows k, k+n, ... of its row (after a
    transpose where `transpose`). `shape` and `dtype` are the result's."""

    source: Plain | Mxfp4 | Fp8 | None = None
    expert: int = 0
    k: int = 0
    n: int = 1
    transpose: bool = False

    def fill(self, read: ReadRanges, cache: dict, out: torch.Tensor, part: tuple[int, int, int] | None) -> None:
        """Write the tensor, or its slice `part` = (dim, start, stop), into `out`. `cache` keeps boxes already
        decoded (gate and up of one expert come from one box)."""
        dim, start, stop = part or (0, 0, self.shape[0])
        chosen = (self.n * start, self.n * stop) if dim == 0 else (0, self.n * self.shape[0])
        other = (start, stop) if dim == 1 else (0, self.shape[1]) if len(self.shape) > 1 else None
        rows, cols = (other, chosen) if self.transpose else (chosen, other)
        key = (self.source, self.expert, rows, cols)
        if key not in cache:
            while len(cache) >= 4:  # an expert's tensors: gate/up, down and their biases
                cache.pop(next(iter(cache)))
            cache[key] = self.source.box(read, self.expert, rows, cols)
        box = cache[key]
        out.copy_((box.T if self.transpose else box)[self.k::self.n])


def catalog(tensors: dict[str, TensorInfo], fmt: str, cfg: ModelConfig, dtype: torch.dtype | None = None,
            fp8_block: int = 128) -> dict[str, TensorInfo]:
    """The checkpoint's tensors as the name map reads them: MXFP4 pairs and FP8 weights with their block scales as
    the tensors they stand for (decoded into `dtype`), and each 3-D expert tensor the map reads by rows replaced by
    one entry per expert (and part). Multi-token-prediction blocks past the last one (DeepSeek-V3's
    `num_nextn_predict_layers`) are left out."""
    extra = {f"model.layers.{cfg.n_layers + k}." for k in range(cfg.mtp_layers)}
    tensors, packed = {n: t for n, t in tensors.items() if not n.startswith(tuple(extra))}, {}
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        if weight in tensors and tensors[weight].dtype == "F8_E4M3":
            pair = Fp8(tensors[weight], tensors.pop(name), fp8_block)
            check_pair(name, pair.scales, tuple(-(-n // fp8_block) for n in pair.weight.shape), "F32",
                       f"{weight} {list(pair.weight.shape)} in blocks of {fp8_block}")
            tensors[weight] = Derived(pair.weight.file, CODES.get(dtype, "F32"), pair.shape, 0, pair.weight.nbytes,
                                      pair)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        if base + "_scales" in tensors:
            pair = packed[base] = Mxfp4(tensors.pop(name), tensors.pop(base + "_scales"))
            check_pair(name, pair.blocks, (*pair.scales.shape, MXFP4_BLOCK // 2), "U8",
                       f"{base}_scales {list(pair.scales.shape)}")
            check_pair(base + "_scales", pair.scales, pair.scales.shape, "U8", "E8M0 exponents")
            tensors[base] = dataclasses.replace(pair.blocks, dtype="MXFP4", shape=(pair.scales.shape[0], *pair.shape))
    selectors: dict[str, set[str]] = {}
    for template in name_map(fmt, cfg).values():
        if "#" in template:
            base, _, selector = template.partition("#")
            selectors.setdefault(base, set()).add(selector.partition(":")[2])
    for template, kinds in selectors.items():
        for i in range(cfg.n_layers):
            base = template.format(i=i)
            info = tensors.pop(base, None)
            if info is not None:
                tensors |= expert_entries(base, info, packed.get(base), kinds, dtype)
    return tensors


def check_pair(name: str, info: TensorInfo, shape: tuple[int, ...], dtype: str, what: str) -> None:
    """A quantized weight's blocks or scales have the shape and dtype the other half implies: a wrong one would read
    another tensor's bytes as its own."""
    if tuple(info.shape) != tuple(shape) or info.dtype != dtype:
        raise CheckpointError(f"{info.file.name}: tensor {name} is {info.dtype} {list(info.shape)}; {what} need "
                              f"{dtype} {list(shape)}")


def parse_kind(kind: str) -> tuple[int, int, str, bool]:
    """A selector's (k, n, "/" contiguous parts or "%" interleaved rows, transposed first)."""
    transpose = kind.endswith("T")
    part = kind.removesuffix("T").rstrip(":")
    sep = "%" if "%" in part else "/"
    k, n = map(int, part.split(sep)) if part else (0, 1)
    return k, n, sep, transpose


def expert_entries(base: str, info: TensorInfo, mxfp4: Mxfp4 | None, kinds: set[str],
                   dtype: torch.dtype | None) -> dict[str, TensorInfo]:
    """One entry per expert and selector of the stacked tensor `base`."""
    out: dict[str, TensorInfo] = {}
    experts, rows, rest = info.shape[0], info.shape[1], info.shape[2:]
    item = 0 if mxfp4 else info.nbytes // max(1, math.prod(info.shape))
    for e, kind in itertools.product(range(experts), sorted(kinds)):
        name = f"{base}#{e}" + (f":{kind}" if kind else "")
        k, n, sep, transpose = parse_kind(kind)
        if mxfp4 is None and not transpose and sep == "/":  # contiguous: read as the bytes it is
            size = rows // n * math.prod(rest) * item
            out[name] = dataclasses.replace(info, shape=(rows // n, *rest), nbytes=size,
                                            offset=info.offset + (e * n + k) * size)
            continue
        shape = info.shape[1:][::-1] if transpose else info.shape[1:]
        shape = (shape[0] // n, *shape[1:])
        if mxfp4 is not None:  # 16 bytes of blocks and one of scales hold 32 values
            out[name] = Derived(info.file, CODES.get(dtype, "F32"), shape, 0, math.prod(shape) * 17 // 32, mxfp4, e,
                                k, n, transpose)
        else:
            out[name] = Derived(info.file, info.dtype, shape, 0, math.prod(shape) * item, Plain(info), e, k, n,
                                transpose)
    return out


def restack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`catalog`'s expert entries undone for a save: each 3-D expert tensor stacked back from its experts' parts."""
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    shapes: dict[str, tuple[str, int, bool]] = {}
    for name, t in tensors.items():
        if "#" not in name:
            out[name] = t
            continue
        base, _, selector = name.partition("#")
        e, _, kind = selector.partition(":")
        k, n, sep, transpose = parse_kind(kind)
        grouped.setdefault(base, {})[(int(e), k)] = t
        shapes[base] = (sep, n, transpose)
    for base, pieces in grouped.items():  # experts in order, each expert's parts in order
        sep, n, transpose = shapes[base]
        experts = []
        for _, keys in itertools.groupby(sorted(pieces), key=lambda key: key[0]):
            parts = [pieces[key] for key in keys]
            whole = torch.stack(parts, 1).flatten(0, 1) if sep == "%" else torch.cat(parts)
            experts.append(whole.T if transpose else whole)
        out[base] = torch.stack(experts)
    return out
