"""The safetensors files of a checkpoint directory: which tensor lies in which file, with its dtype and shape.

Only headers are read here (a few KB per file); tensor data stays on disk until a rank asks for it.
Every check that can fail on bad input raises `CheckpointError` with a one-line message naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
HF_INDEX = "model.safetensors.index.json"
CONVERT_HINT = ("convert it to safetensors first, e.g. with transformers: "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) (writes safetensors by default)")


class CheckpointError(ValueError):
    """A checkpoint cannot be read; the message names the file or tensor and the cause."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors code: F32, BF16, F16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that the file holds all the bytes it promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: file is truncated (shorter than a safetensors header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > 100_000_000:
                raise CheckpointError(f"{path}: file is truncated or not safetensors (header of {header_len} bytes)")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    infos, data_end = {}, 0
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        infos[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), 8 + header_len + begin, end - begin)
        data_end = max(data_end, end)
    if 8 + header_len + data_end > size:
        raise CheckpointError(f"{path}: file is truncated ({size} bytes, its header needs {8 + header_len + data_end})")
    return infos


def inside(directory: Path, name: str) -> Path:
    """Resolve a file name taken from an index, refusing anything that leaves the checkpoint directory."""
    root = directory.resolve()
    target = (root / name).resolve()
    if os.path.isabs(name) or not target.is_relative_to(root):
        raise CheckpointError(f"{directory / HF_INDEX}: entry {name!r} points outside the checkpoint directory")
    return target


def refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{directory}: found only pickle weights ({', '.join(pickles[:3])}); "
                              f"this project reads safetensors only: {CONVERT_HINT}")
    raise CheckpointError(f"{directory}: no safetensors weights found")


def index_tensors(directory: Path, weight_files: list[str]) -> dict[str, TensorInfo]:
    """Tensor name -> where it lives, from the HF index if present, else from the given files' headers."""
    index_path = directory / HF_INDEX
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path}: not a valid index (no 'weight_map' object)") from None
        files = {name: inside(directory, name) for name in sorted(set(weight_map.values()))}
    else:
        files = {name: directory / name for name in weight_files if (directory / name).exists()}
        if not files:
            refuse_pickles(directory)
    headers: dict[Path, dict[str, TensorInfo]] = {}
    for path in files.values():
        if not path.exists():
            raise CheckpointError(f"{path}: shard listed in {HF_INDEX} is missing")
        headers[path] = read_header(path)
    if not index_path.exists():
        return {k: v for h in headers.values() for k, v in h.items()}
    tensors = {}
    for tensor, name in weight_map.items():
        info = headers[files[name]].get(tensor)
        if info is None:
            raise CheckpointError(f"{files[name]}: tensor {tensor!r} listed in {HF_INDEX} is not in this file")
        tensors[tensor] = info
    return tensors
