"""Fill a (possibly pruned) meta-device model with exactly the tensors it holds.

Plain steps: check the checkpoint's names and shapes against the full model (headers only), then
read, per parameter this rank holds, the tensors it needs through lazily opened safetensors files,
and assign them. A rank never touches the bytes of blocks or experts it does not hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from moe.checkpoint.files import CheckpointError, TensorInfo, index_tensors
from moe.checkpoint.formats import (
    CheckpointFormat,
    all_external_names,
    external_name,
    is_stacked_expert,
    needs_rope_permute,
    to_half_split,
)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None, default: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or default or "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[name]


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
        want = tuple(shape[1:]) if stacked else tuple(shape)
        for e in range(ckpt.config.n_experts) if stacked else [None]:
            ext = external_name(ckpt.fmt, ckpt.config, name, e)
            info = tensors[ext]
            if info.shape != want:
                raise CheckpointError(f"{info.file.name}: tensor {ext} has shape {list(info.shape)}, "
                                      f"the config implies {list(want)}")


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


class TensorReader:
    """Reads named tensors straight from the files into preallocated tensors.

    Plain positioned reads rather than a memory map: the bytes land once, in the destination, and the
    file's pages are not counted in this rank's resident memory. Files are opened on first use.
    """

    def __init__(self, tensors: dict[str, TensorInfo], stack: ExitStack) -> None:
        self.tensors, self.stack, self.handles = tensors, stack, {}
        self.bytes_read = 0

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def empty(self, name: str, leading: tuple[int, ...] = ()) -> torch.Tensor:
        info = self.tensors[name]
        if info.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{info.file.name}: tensor {name} has unsupported dtype {info.dtype}")
        return torch.empty((*leading, *info.shape), dtype=SAFETENSORS_DTYPES[info.dtype])

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        info = self.tensors[name]
        buf = out.view(-1).view(torch.uint8).numpy()
        if buf.nbytes != info.nbytes:
            raise CheckpointError(f"{info.file.name}: tensor {name} holds {info.nbytes} bytes, "
                                  f"its dtype and shape need {buf.nbytes}")
        try:
            if info.file not in self.handles:
                self.handles[info.file] = self.stack.enter_context(open(info.file, "rb", buffering=0))
            f = self.handles[info.file]
            f.seek(info.offset)
            got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(f"{info.file.name}: cannot read tensor {name} ({e.strerror})") from None
        if got != info.nbytes:
            raise CheckpointError(f"{info.file.name}: file is truncated inside tensor {name}")
        self.bytes_read += got
        return out

    def read(self, name: str) -> torch.Tensor:
        return self.read_into(name, self.empty(name))


def load_into(model: nn.Module, ckpt: CheckpointFormat, directory: str | Path, full_shapes: dict[str, torch.Size],
              dtype: torch.dtype, device: torch.device | str,
              progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Load this rank's tensors into `model` (built on meta, already pruned to what the rank holds)."""
    t0 = time.perf_counter()
    tensors = index_tensors(Path(directory), ckpt.weight_files)
    check_names_and_shapes(ckpt, full_shapes, tensors)
    cfg = ckpt.config
    state, by_source = {}, {}
    with ExitStack() as stack:
        reader = TensorReader(tensors, stack)
        for name, param in model.state_dict(keep_vars=True).items():
            if is_stacked_expert(name):
                ids = model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
                if not ids:
                    state[name] = torch.empty(param.shape, dtype=dtype, device=device)
                    continue
                sources = [external_name(ckpt.fmt, cfg, name, e) for e in ids]
                t = reader.empty(sources[0], leading=(len(ids),))  # one buffer, each expert read into its row
                for row, source in enumerate(sources):
                    reader.read_into(source, t[row])
            else:
                source = external_name(ckpt.fmt, cfg, name)
                if source in by_source:  # tied embeddings: one tensor, two parameters
                    state[name] = by_source[source]
                    continue
                t = reader.read(source)
                kind = needs_rope_permute(ckpt.fmt, name)
                if kind is not None:
                    t = to_half_split(t, cfg.n_heads if kind == "wq" else cfg.n_kv_heads)
                t = by_source[source] = t.to(device=device, dtype=dtype)
            state[name] = t.to(device=device, dtype=dtype)  # no copy when already there
        if progress:
            progress(f"read {reader.bytes_read / 2**20:.1f} MiB from {len(reader.handles)} file(s)")
    model.load_state_dict(state, strict=True, assign=True)
    return {"load_seconds": time.perf_counter() - t0, "bytes_read": reader.bytes_read}
