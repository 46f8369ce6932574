"""Build a model from a checkpoint directory: config, meta-device modules, prune, load this rank's tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from models import weights
from models.kernels import tuning
from models.kernels.choice import choose
from models.transformer import Transformer
from moe.checkpoint.formats import CheckpointFormat, detect
from moe.checkpoint.loader import INT8, activation_dtype, load_into, parse_dtype
from moe.memory import return_freed_memory
from moe.progress import Progress


def build_model(directory: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
                prune: Callable[[Transformer], None] | None = None,
                progress: Progress | None = None,
                kernels: str | None = None) -> tuple[Transformer, CheckpointFormat, dict]:
    """`kernels` ("auto", "native", "onednn" or "torch"; `models.kernels.choice`): an inference model, its linear
    weights converted to their fastest format block by block as they are read; `dtype="int8"` (inference only)
    quantizes them."""
    ckpt = detect(directory)
    int8 = dtype == INT8
    if int8 and kernels is None:
        raise ValueError("dtype='int8' is for inference only (a model built for training keeps float weights)")
    torch_dtype = activation_dtype(INT8) if int8 else parse_dtype(dtype, ckpt.torch_dtype)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    full_shapes = {k: v.shape for k, v in model.state_dict().items()}
    if prune is not None:
        prune(model)
    choice = choose(kernels, device, torch_dtype, int8) if kernels is not None else None

    def convert(unit: torch.nn.Module) -> None:  # as each block is read: the originals go before the next one
        weights.prepare(unit, choice)
        return_freed_memory()

    stats = load_into(model, ckpt, directory, full_shapes, torch_dtype, device, progress,
                      on_unit=convert if choice is not None else None)
    if choice is not None:  # what this rank runs, for `model.info` and the ranks' agreement (`moe.api`)
        stats |= {"kernels": choice.describe(), "kernel_settings": choice.settings()}
        if choice.native:  # the decode kernel's prefetch distance, measured here once for such weights
            stats["prefetch_bytes"] = tuning.tune(weights.decode_reads(model))
    materialize_buffers(model, device)
    model.kernel_choice = choice  # what a compiled step's key names (`moe.engine.ahead`)
    model.eval().requires_grad_(False)
    return model, ckpt, stats


def materialize_buffers(model: torch.nn.Module, device: str | torch.device) -> None:
    """Non-persistent buffers (load counters) are not in the checkpoint: create them as zeros."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device), persistent=False)
