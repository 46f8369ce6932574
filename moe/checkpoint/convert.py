"""Convert a checkpoint between layouts (Hugging Face, Mistral consolidated) and dtypes (fp32, bf16, fp16)."""

from __future__ import annotations

import re
from pathlib import Path

from moe.checkpoint.files import beside_weights
from moe.checkpoint.writer import save_checkpoint
from moe.engine.build import build_model
from moe.progress import Progress

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'200MB' -> 200_000_000 bytes (KB/MB/GB decimal, KiB/MiB/GiB binary, as Hugging Face does)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not like 200MB, 1.5GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def convert_checkpoint(src: str | Path, out: str | Path, fmt: str, dtype: str | None = None,
                       max_shard_bytes: int | None = None, progress: Progress | None = None) -> Path:
    """Load `src` on one rank (in `dtype`, default its own) and write it to `out` in layout `fmt`."""
    model, ckpt, _ = build_model(src, dtype)
    return save_checkpoint(model.state_dict(), ckpt.config, out, fmt=fmt, beside=beside_weights(src),
                           max_shard_bytes=max_shard_bytes, progress=progress)
