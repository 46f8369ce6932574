"""Build a model from a checkpoint directory: config, meta-device modules, prune, load this rank's tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from models.cpu_kernels import pack_weights
from models.transformer import Transformer
from moe.checkpoint.formats import CheckpointFormat, detect
from moe.checkpoint.loader import load_into, parse_dtype
from moe.progress import Progress


def build_model(directory: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
                prune: Callable[[Transformer], None] | None = None,
                progress: Progress | None = None,
                pack: bool = False) -> tuple[Transformer, CheckpointFormat, dict]:
    """`pack`: an inference model on CPU keeps its linear weights in oneDNN's layout (models.cpu_kernels)."""
    ckpt = detect(directory)
    torch_dtype = parse_dtype(dtype, ckpt.torch_dtype)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    full_shapes = {k: v.shape for k, v in model.state_dict().items()}
    if prune is not None:
        prune(model)
    stats = load_into(model, ckpt, directory, full_shapes, torch_dtype, device, progress)
    materialize_buffers(model, device)
    model.eval().requires_grad_(False)
    if pack:
        pack_weights(model)
    return model, ckpt, stats


def materialize_buffers(model: torch.nn.Module, device: str | torch.device) -> None:
    """Non-persistent buffers (load counters) are not in the checkpoint: create them as zeros."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device), persistent=False)
