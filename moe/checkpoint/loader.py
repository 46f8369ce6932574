"""Fill a (possibly pruned) meta-device model with exactly the tensors it holds.

Plain steps: check the checkpoint's names and shapes against the full model (headers only), then
read, per parameter this rank holds, the tensors it needs through lazily opened safetensors files,
and assign them. A rank never touches the bytes of blocks or experts it does not hold.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from models.weights import INT8
from moe.checkpoint.encodings import SAFETENSORS_DTYPES, Derived, box_ranges, catalog
from moe.checkpoint.files import CheckpointError, TensorInfo, index_tensors
from moe.checkpoint.formats import (
    CheckpointFormat,
    all_external_names,
    dense_layer,
    external_name,
    is_stacked_expert,
    latent_rope_rows,
    needs_rope_permute,
    rope_rows,
    to_half_split,
)
from moe.progress import Progress, silent

# vLLM's and transformers' spellings too ("half", "float"); "auto" (theirs) or None is the checkpoint's own
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None, default: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (dtype if dtype != "auto" else None) or default or "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[name]


def parse_precision(dtype: str | torch.dtype | None, default: str | None = None) -> str:
    """An inference model's precision by name: "float32", "bfloat16", "float16" or "int8"."""
    if dtype == INT8:
        return INT8
    try:
        return str(parse_dtype(dtype, default)).removeprefix("torch.")
    except ValueError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of float32, bfloat16, float16, int8") from None


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype activations (and embeddings, norms, routers, KV caches) have at this precision."""
    return torch.bfloat16 if precision == INT8 else DTYPES[precision]


def check_names_and_shapes(ckpt: CheckpointFormat, full_shapes: dict[str, torch.Size],
                           tensors: dict[str, TensorInfo]) -> None:
    """Every expected tensor present with the right shape, nothing unexpected; messages name the tensors."""
    expected = all_external_names(ckpt.fmt, ckpt.config, list(full_shapes))
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:4])}"
                              + (" ..." if len(missing) > 4 else ""))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:4])}"
                              + (" ..." if len(unexpected) > 4 else ""))
    for name, shape in full_shapes.items():
        stacked = is_stacked_expert(name)
        if stacked and dense_layer(ckpt.config, name):
            continue
        want = tuple(shape[1:]) if stacked else tuple(shape)
        for e in range(ckpt.config.n_experts) if stacked else [None]:
            ext = external_name(ckpt.fmt, ckpt.config, name, e)
            info = tensors[ext]
            if info.shape != want:
                raise CheckpointError(f"{info.file.name}: tensor {ext} has shape {list(info.shape)}, "
                                      f"the config implies {list(want)}")



def writable_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer, for `readinto` (no numpy needed)."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.is_contiguous())
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class TensorReader:
    """Reads named tensors straight from the files into preallocated tensors.

    Plain positioned reads rather than a memory map: the bytes land once, in the destination, and the
    file's pages are not counted in this rank's resident memory. Files are opened on first use.
    """

    def __init__(self, tensors: dict[str, TensorInfo], stack: ExitStack,
                 on_file_done: Callable[[Path, int, int], None] | None = None,
                 on_read: Callable[[int], None] | None = None) -> None:
        self.tensors, self.stack, self.handles = tensors, stack, {}
        self.bytes_read = 0
        self.on_file_done = on_file_done  # (file, files done, files to read), when its last needed tensor is in
        self.on_read = on_read  # bytes of each tensor read
        self.pinned: torch.Tensor | None = None  # staging buffer for reads that go to a GPU
        self.remaining: dict[Path, int] = {}
        self.boxes: dict = {}  # decoded pieces of stored tensors that several of ours come from (`encodings.Derived`)
        self.shapes_read: dict[str, list[list[int]]] = {}  # what was read of each tensor: its shape, or its slices'
        # (a tensor read twice: a tied embedding for the head and a slice of it for the embedding)

    def expect(self, names: list[str]) -> None:
        """The tensors about to be read, so progress can count files as they complete."""
        for n in names:
            info = self.tensors[n]
            self.remaining[info.file] = self.remaining.get(info.file, 0) + 1
        self.n_files = len(self.remaining)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def empty(self, name: str, leading: tuple[int, ...] = (), device: torch.device | str = "cpu",
              part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """A buffer for the tensor `name` (or its slice `part`), `leading` dimensions first."""
        info = self.tensors[name]
        if info.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{info.file.name}: tensor {name} has unsupported dtype {info.dtype}")
        shape = list(info.shape)
        if part is not None:
            shape[part[0]] = part[2] - part[1]
        return torch.empty((*leading, *shape), dtype=SAFETENSORS_DTYPES[info.dtype], device=device)

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer shaped like `like`, reused (grown to the largest tensor): reads for a GPU land
        here and are copied over, so host memory holds one tensor at a time, not the rank's share."""
        n = like.numel() * like.element_size()
        if self.pinned is None or self.pinned.numel() < n:
            self.pinned = None  # free the smaller one first
            self.pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self.pinned[:n].view(like.dtype).view(like.shape)

    def read_into(self, name: str, out: torch.Tensor, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or with `part` = (dim, start, stop) only that slice of it (rows of any tensor, or
        columns of a matrix: one read per row), into `out`. A tensor stored otherwise (`encodings.Derived`) is
        decoded from what it is stored as."""
        if out.device.type != "cpu":
            host = self._staging(out)
            self.read_into(name, host, part)
            return out.copy_(host)  # from pinned memory; returns once copied, so the buffer is free again
        info = self.tensors[name]
        before = self.bytes_read
        if isinstance(info, Derived):
            info.fill(lambda stored, ranges, into: self.read_ranges(name, stored, ranges, into), self.boxes, out, part)
        else:
            self.read_ranges(name, info, byte_ranges(info, part), out, part)
        got = self.bytes_read - before
        self.shapes_read.setdefault(name, []).append(list(out.shape))
        if self.on_read is not None:
            self.on_read(got)
        if info.file in self.remaining:
            self.remaining[info.file] -= 1
            if self.remaining[info.file] == 0 and self.on_file_done is not None:
                done = sum(1 for v in self.remaining.values() if v == 0)
                self.on_file_done(info.file, done, self.n_files)
        return out

    def read_ranges(self, name: str, info: TensorInfo, ranges: list[tuple[int, int]], out: torch.Tensor,
                    part: tuple[int, int, int] | None = None) -> None:
        """The bytes `ranges` of `info`'s file, in order, into `out` (the tensor `name` or a piece of it)."""
        buf = writable_bytes(out)
        want = sum(n for _, n in ranges)
        if buf.nbytes != want:
            raise CheckpointError(f"{info.file.name}: tensor {name} holds {want} bytes"
                                  f"{' in the slice read' if part else ''}, its dtype and shape need {buf.nbytes}")
        got = 0
        try:
            if info.file not in self.handles:
                self.handles[info.file] = self.stack.enter_context(open(info.file, "rb", buffering=0))
            f = self.handles[info.file]
            for offset, n in ranges:
                f.seek(offset)
                got += f.readinto(buf[got:got + n])
        except OSError as e:
            raise CheckpointError(f"{info.file.name}: cannot read tensor {name} ({e.strerror})") from None
        if got != want:
            raise CheckpointError(f"{info.file.name}: file is truncated inside tensor {name}")
        self.bytes_read += got

    def read(self, name: str, device: torch.device | str = "cpu", part: tuple[int, int, int] | None = None):
        return self.read_into(name, self.empty(name, device=device, part=part), part)


def byte_ranges(info: TensorInfo, part: tuple[int, int, int] | None) -> list[tuple[int, int]]:
    """(file offset, bytes) of each contiguous run of the tensor, or of its slice `part` = (dim, start, stop). Of a
    tensor stored otherwise (`encodings.Derived`), only how many bytes it takes, for progress."""
    if isinstance(info, Derived):
        return [(0, info.nbytes if part is None else info.nbytes * (part[2] - part[1]) // info.shape[part[0]])]
    if part is None:
        return [(info.offset, info.nbytes)]
    dim, start, stop = part
    if dim == 0:
        return box_ranges(info, (start, stop), None)
    assert dim == 1 and len(info.shape) == 2, (dim, info.shape)
    return box_ranges(info, (0, info.shape[0]), (start, stop))


def needed_sources(model: nn.Module, fmt: str, cfg) -> dict[str, list[str]]:
    """Checkpoint tensor names each of this rank's parameters is read from (experts: one per held expert)."""
    out = {}
    for name in model.state_dict(keep_vars=True):
        if is_stacked_expert(name):
            ids = model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
            out[name] = [external_name(fmt, cfg, name, e) for e in ids]
        else:
            out[name] = [external_name(fmt, cfg, name)]
    return out


def read_parameter(reader: TensorReader, ckpt: CheckpointFormat, name: str, shape: torch.Size, names: list[str],
                   by_source: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str,
                   part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """One parameter from its checkpoint tensors `names` (a stacked expert parameter: one per held expert), or
    only the slice `part` of each (tensor parallelism, `moe.parallel.tensor`)."""
    if is_stacked_expert(name):  # with held experts: `read_experts`
        return torch.empty(shape, dtype=dtype, device=device)
    source = names[0]
    if source in by_source and part is None:  # tied embeddings: one tensor, two parameters
        return by_source[source]
    t = reader.read(source, device, part)
    kind = needs_rope_permute(ckpt.fmt, name)
    if kind is not None:  # per head, so a slice of whole heads converts alone
        t = to_half_split(t, t.shape[0] // ckpt.config.head_dim)
    rows = latent_rope_rows(ckpt.fmt, ckpt.config, name)
    if rows is not None:  # likewise
        t = rope_rows(t, rows)
    t = t.to(device=device, dtype=dtype)
    if part is None:
        by_source[source] = t
    return t


def read_experts(reader: TensorReader, stacked: dict[str, tuple[list[str], tuple[int, int, int] | None]],
                 dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A block's stacked expert parameters (name -> their sources, one per held expert, and slice), one buffer each,
    read expert by expert: the tensors of one expert that come from one stored tensor (gpt-oss's interleaved gate
    and up, MXFP4 blocks) are decoded once."""
    buffers = {name: reader.empty(names[0], (len(names),), device, part) for name, (names, part) in stacked.items()}
    for row in range(max(len(names) for names, _ in stacked.values())):
        for name, (names, part) in stacked.items():
            if row < len(names):
                reader.read_into(names[row], buffers[name][row], part)
    reader.boxes.clear()
    return {name: t.to(device=device, dtype=dtype) for name, t in buffers.items()}  # no copy when already there


def load_into(model: nn.Module, ckpt: CheckpointFormat, directory: str | Path, full_shapes: dict[str, torch.Size],
              dtype: torch.dtype, device: torch.device | str, progress: Progress | None = None,
              on_unit: Callable[[nn.Module], None] | None = None) -> dict[str, float]:
    """Load this rank's tensors into `model` (built on meta, already pruned to what the rank holds).

    `progress` counts the bytes read, with a line per checkpoint file as the last tensor this rank needs
    from it is read. Tensors are assigned a unit at a time (a block, the embedding, the final norm, the head);
    `on_unit(module)` then sees it whole, so converting its weights (packing, int8) holds one unit's original
    tensors at a time, not the model's.
    """
    progress = progress or silent()
    t0 = time.perf_counter()
    tensors = catalog(index_tensors(Path(directory), ckpt.weight_files), ckpt.fmt, ckpt.config, dtype,
                      ckpt.fp8_block)
    check_names_and_shapes(ckpt, full_shapes, tensors)
    cfg = ckpt.config
    sources = needed_sources(model, ckpt.fmt, cfg)
    slices = getattr(model, "slices", {})  # tensor parallelism: the slice of each split parameter (moe.parallel.tensor)
    state, by_source, stacked = {}, {}, {}

    def file_done(path: Path, done: int, total: int) -> None:
        progress.note(f"loaded {path.name} ({done}/{total} files, {reader.bytes_read / 2**20:.1f} MiB, "
                 f"{time.perf_counter() - t0:.2f} s)")

    with ExitStack() as stack:
        reader = TensorReader(tensors, stack, file_done, progress.update)
        # Each read once (a tied embedding is one read for two parameters, unless one of them is a slice).
        reads = {(n, slices.get(ours)) for ours, names in sources.items() for n in names}
        reader.expect([n for n, _ in reads])
        stack.enter_context(progress.start(sum(n for name, part in reads
                                               for _, n in byte_ranges(tensors[name], part))))
        unit = None

        def assign() -> None:  # the finished unit's tensors into the model (every name of the unit is in `state`)
            if stacked:
                state.update(read_experts(reader, stacked, dtype, device))
                stacked.clear()
            unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
            assert not unexpected, unexpected
            state.clear()
            if on_unit is not None:
                on_unit(model.get_submodule(unit))

        for name, param in model.state_dict(keep_vars=True).items():
            parts = name.split(".")
            if unit != (this := ".".join(parts[:2]) if parts[0] == "layers" else parts[0]):
                if unit is not None:
                    assign()
                unit = this
            if is_stacked_expert(name) and sources[name]:
                stacked[name] = (sources[name], slices.get(name))
                continue
            state[name] = read_parameter(reader, ckpt, name, param.shape, sources[name], by_source, dtype, device,
                                         slices.get(name))
        if unit is not None:
            assign()
        files_read = sorted(p.name for p in reader.handles)
    return {"load_seconds": time.perf_counter() - t0, "bytes_read": reader.bytes_read, "files_read": files_read,
            "tensors_read": reader.shapes_read}
