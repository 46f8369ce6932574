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
from safetensors import SafetensorError, safe_open
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


class TensorReader:
    """Lazily opened safetensors files; reads one named tensor at a time."""

    def __init__(self, tensors: dict[str, TensorInfo], stack: ExitStack) -> None:
        self.tensors, self.stack, self.handles = tensors, stack, {}
        self.bytes_read = 0

    def read(self, name: str) -> torch.Tensor:
        path = self.tensors[name].file
        try:
            if path not in self.handles:
                self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            t = self.handles[path].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path.name}: cannot read tensor {name} ({e})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t


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
                owner = model.get_submodule(name.rsplit(".", 1)[0])
                parts = [reader.read(external_name(ckpt.fmt, cfg, name, e)) for e in owner.expert_ids]
                t = torch.stack(parts) if parts else torch.empty(param.shape)
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
            state[name] = t.to(device=device, dtype=dtype)
        if progress:
            progress(f"read {reader.bytes_read / 2**20:.1f} MiB from {len(reader.handles)} file(s)")
    model.load_state_dict(state, strict=True, assign=True)
    return {"load_seconds": time.perf_counter() - t0, "bytes_read": reader.bytes_read}
